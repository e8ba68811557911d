"""What a batch means: how the model is called on it, where the loss comes from, and the
evaluation metrics.

A batch is a tuple ``(inputs, targets, ...)`` (kiln's data sets, ``TensorDataset``) or a
mapping (Hugging Face style: ``input_ids``, ``attention_mask``, ``labels``). The model is
called as ``model(inputs)`` on a tuple and as ``model(**batch)`` on a mapping, and may return

- logits (a tensor; a 0-d tensor is a loss),
- a mapping or ``ModelOutput`` with ``loss`` and/or ``logits``,
- a tuple whose first element is one of these (``return_dict=False``: ``(loss, logits, ...)``).

- a tuple holding logits and a loss in any order (``(loss, logits, ...)`` with
  ``return_dict=False``, nanoGPT's ``(logits, loss)``): the loss is its 0-d tensor, the logits
  its first tensor of more dimensions.

With ``train.pass_targets=true`` a tuple batch ``(inputs, targets)`` is called as
``model(inputs, targets)``, for models whose forward takes the targets and returns the loss
(nanoGPT's ``forward(idx, targets=None)``).

The loss of a micro-batch is, in this order: ``train.loss(outputs, batch)`` when the config
sets one, the loss the model returned, or the task's cross-entropy of the logits against the
targets (a tuple's second element, a mapping's ``labels``).

The task decides how targets line up with logits, and the metrics (:func:`model_kind`):

- ``lm``, a causal language model: a mapping follows the Hugging Face convention, ``labels``
  are the input ids themselves and token t predicts label t + 1 (kiln's own lm data gives
  tuple targets already shifted); without ``labels`` the input ids are the targets;
- ``mlm`` (masked LM) and ``seq2seq`` (an encoder-decoder's decoder targets): each position is
  scored against its own label;
- ``classification``: one label per sample (or per token, for token classification).

Under ``train.chunked_lm_loss`` (``Task.head``, kiln/train/_chunked_loss.py) a causal LM returns
the hidden states its output projection took in place of its logits, and the loss and the
evaluation make the logits from them chunk by chunk; a mapping's ``labels`` are then not passed
to the model (which would score its hidden states as logits), and are scored here as above.

A loss over tokens averages over the positions it scores (labels other than -100); with
padding those differ from batch to batch, so the micro-batches of a step are weighted by the
positions each scores (:func:`loss_weights`), over every micro-batch and data-parallel rank of
the step: the step is then one big batch's, as transformers' Trainer does with
``num_items_in_batch``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ConfigError

IGNORE = -100  # cross_entropy's ignore_index: mlm positions that were not masked, padding
KINDS = ("classification", "lm", "mlm", "seq2seq")


@dataclass
class Task:
    """The loss and metrics of a run: the data's kind plus what the config plugs in."""

    kind: str | None  # one of KINDS, or None: unknown (the loss alone is reported)
    loss: Callable[[Any, Any], torch.Tensor] | None = None  # train.loss
    metrics: dict[str, Callable[[Any, Any], Any]] | None = None  # train.metrics; None: the kind's
    pass_targets: bool = False  # train.pass_targets: a tuple batch is called model(inputs, targets)
    # train.chunked_lm_loss: the model's output projection (kiln/train/_chunked_loss.ChunkedHead),
    # skipped by the model, which then returns the hidden states the loss computes the logits from
    head: Any = None

    def metric_names(self) -> list[str]:
        """The eval metrics this task reports, ``loss`` first."""
        if self.metrics is not None:
            return ["loss", *self.metrics]
        names = ["loss"]
        if self.kind is not None:
            names.append("accuracy")
        if self.kind in ("lm", "mlm", "seq2seq"):
            names.append("perplexity")
        return names


# transformers' heads by the end of their class's name (an encoder-decoder's
# ForConditionalGeneration is seq2seq; a decoder-only one, a vision-language model, is causal)
_HEADS = (("ForMaskedLM", "mlm"), ("ForSeq2SeqLM", "seq2seq"), ("ForCausalLM", "lm"), ("LMHeadModel", "lm"),
          ("ForConditionalGeneration", "lm"), ("ForSequenceClassification", "classification"),
          ("ForTokenClassification", "classification"), ("ForImageClassification", "classification"),
          ("ForMultipleChoice", "classification"))


def model_kind(model: Any) -> str | None:
    """The task a model's class declares, transformers' way: ``*ForCausalLM`` and
    ``*LMHeadModel`` are ``lm``, ``*ForMaskedLM`` ``mlm``, an encoder-decoder's
    ``*ForConditionalGeneration`` ``seq2seq``, ``*For*Classification`` ``classification``;
    None for any other model (kiln then goes by the data, or ``data.task``).

    >>> class GPT2LMHeadModel(nn.Module): ...
    >>> model_kind(GPT2LMHeadModel()), model_kind(nn.Linear(2, 2))
    ('lm', None)
    """
    name = type(model).__name__
    for suffix, kind in _HEADS:
        if name.endswith(suffix):
            if kind == "lm" and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
                return "seq2seq"
            return kind
    return None


def call_model(model: Callable[..., Any], batch: Any, pass_targets: bool = False) -> Any:
    """``model(**batch)`` for a mapping, ``model(inputs)`` for a tuple ``(inputs, ...)``
    (``model(inputs, targets)`` with ``pass_targets``)."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if pass_targets and len(batch) > 1:
        return model(batch[0], batch[1])
    return model(batch[0])


def split_outputs(outputs: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(loss, logits)`` of whatever the model returned (either may be None). In a tuple the
    loss is found by what it is, a 0-d tensor, wherever it stands; the logits are its first
    tensor of more dimensions."""
    if isinstance(outputs, torch.Tensor):
        return (outputs, None) if outputs.ndim == 0 else (None, outputs)
    if isinstance(outputs, Mapping):  # transformers' ModelOutput is an OrderedDict
        return outputs.get("loss"), outputs.get("logits")
    if isinstance(outputs, (tuple, list)) and outputs:
        if not isinstance(outputs[0], torch.Tensor) and outputs[0] is not None:
            return split_outputs(outputs[0])  # ({"logits": ...}, ...)
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        loss = next((t for t in tensors if t.ndim == 0), None)
        logits = next((t for t in tensors if t.ndim > 0), None)
        return loss, logits
    raise TypeError(
        f"the model returned {type(outputs).__name__}; kiln takes logits (a tensor), a mapping or ModelOutput "
        "with 'loss' and/or 'logits', or a tuple of a 0-d loss and/or logits. Return one of those, "
        "or set train.loss to a function (outputs, batch) -> loss")


def targets_of(batch: Any, kind: str | None = None) -> torch.Tensor | None:
    """A tuple's second element, a mapping's ``labels``, or None; a causal LM's mapping
    without ``labels`` is scored against its ``input_ids`` (padding, where ``attention_mask``
    is 0, not scored)."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        ids = batch.get("input_ids")
        if labels is None and kind == "lm" and isinstance(ids, torch.Tensor) and ids.ndim == 2:
            mask = batch.get("attention_mask")
            return ids if mask is None else ids.masked_fill(mask == 0, IGNORE)
        return labels
    return batch[1] if len(batch) > 1 else None


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    items = batch.values() if isinstance(batch, Mapping) else batch
    for item in items:
        if isinstance(item, torch.Tensor) and item.ndim > 0:
            return item.shape[0]
        if isinstance(item, (Mapping, tuple, list)):
            return batch_size(item)
    raise ValueError(f"cannot tell the number of samples of a batch of {type(batch).__name__}: it holds no tensor")


def to_device(batch: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """The batch on ``device``, recursively; floating tensors take ``dtype`` (fp64 runs), token
    ids and masks of other dtypes stay as they are."""
    if isinstance(batch, torch.Tensor):
        floating = batch.is_floating_point()
        if batch.device == device and (batch.dtype == dtype or not floating):
            return batch  # (a call of .to that does nothing still costs microseconds a step)
        return batch.to(device, dtype=dtype if floating else None, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        moved = [to_device(v, device, dtype) for v in batch]
        # nothing moved (the data is already where and what it must be, as on a CPU): the
        # batch itself, no new container a step
        return batch if all(map(operator.is_, moved, batch)) else type(batch)(moved)
    if isinstance(batch, Mapping):  # (a BatchEncoding, too) -> a dict, which model(**batch) takes
        return {k: to_device(v, device, dtype) for k, v in batch.items()}
    return batch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32: bf16/fp16 logits are upcast for the loss, fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def loss_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits (B, C) for classification, (B, T, V) for lm and mlm.

    Targets equal to -100 (cross_entropy's ignore_index) are not scored."""
    if logits.shape[:-1].numel() != targets.numel():
        raise ConfigError(
            f"the model's logits {tuple(logits.shape)} do not line up with the batch's targets {tuple(targets.shape)}: "
            "kiln scores one row of logits per target. If the model's forward takes the targets (nanoGPT's "
            "forward(idx, targets) returns only the last position's logits without them), set "
            "train.pass_targets=true; or return the loss from the model, or set train.loss")
    if logits.ndim != 2 or targets.ndim != 1:
        logits, targets = logits.flatten(0, -2), targets.flatten()
    return F.cross_entropy(logits if logits.dtype in _WIDE else upcast(logits), targets)


_WIDE = (torch.float32, torch.float64)  # the logits' dtypes cross-entropy takes as they are


def _shifted(task: Task, batch: Any) -> bool:
    """Whether a batch's targets are its inputs (a causal LM's mapping: token t predicts t + 1)."""
    return task.kind == "lm" and isinstance(batch, Mapping)


def _aligned(task: Task, batch: Any, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the targets they predict: a mapping's lm labels are the inputs (shift by one)."""
    if _shifted(task, batch):
        return logits[:, :-1], targets[:, 1:]
    return logits, targets


def scored_items(task: Task, batch: Any) -> torch.Tensor | None:
    """The positions a micro-batch's mean loss averages over, where that is not its samples:
    the targets a token-level loss scores (neither -100 nor, for a causal LM, the first
    position), as a 0-d tensor on the batch's device (counted there: no wait for the device);
    None where the loss is a mean over samples (one label each, float targets, ``train.loss``,
    no targets)."""
    if task.loss is not None:
        return None
    targets = targets_of(batch, task.kind)
    if targets is None or targets.ndim < 2 or targets.is_floating_point():
        return None
    if _shifted(task, batch):
        targets = targets[:, 1:]
    return (targets != IGNORE).sum()


def loss_parts(task: Task, micro: list[Any], samples: int, dp: int,
               sum_over_dp: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> list[Any]:
    """What each micro-batch's mean loss is divided by, so that the step's gradient, averaged
    over the ``dp`` ranks, is that of the mean over the whole step, as one big batch would give:
    ``N / (n_i * dp)`` with ``n_i`` the micro-batch's samples and ``N`` the step's
    (``samples``), or, for a loss over tokens, its scored positions and the step's, summed over
    the ranks (``sum_over_dp``: one all-reduce of one number, kept on the device). Exactly K
    when each of K micro-batches holds ``samples / (K x dp)`` samples.

    A micro-batch that scores no position has a mean of 0/0 (nan), in kiln as in a plain loop:
    pad no batch completely. One micro-batch on one rank is the whole step: its part is 1."""
    if len(micro) == 1 and dp == 1:
        return [1]
    items = [scored_items(task, b) for b in micro]
    if not items or any(n is None for n in items):  # (the same on every rank: it depends on the data's form)
        return [samples / (batch_size(b) * dp) for b in micro]
    total = sum_over_dp(torch.stack(items).sum().to(device, torch.float64))
    return [total / (n.to(device) * dp) for n in items]


def _without_labels(batch: Any) -> Any:
    """A mapping batch without ``labels``: a Hugging Face model given them computes its own loss,
    on what it returns as logits (under the chunked loss, the hidden states)."""
    return {k: v for k, v in batch.items() if k != "labels"} if isinstance(batch, Mapping) else batch


def _hidden_and_targets(task: Task, outputs: Any, batch: Any, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Under the chunked loss: the hidden states the model returned in place of its logits, and
    the targets they predict, aligned. (Evaluation's forward may gather tensor-parallel outputs
    into new tensors: only training's are checked to be the head's input itself.)"""
    hidden = split_outputs(outputs)[1]
    targets = targets_of(batch, task.kind)
    if hidden is None or targets is None:
        missing = ("hidden states (the model returned no logits)" if hidden is None else
                   "targets (a tuple's second element or a mapping's 'labels')")
        raise ValueError(f"train.chunked_lm_loss: kiln found no {missing} to compute the loss from; "
                         "set train.chunked_lm_loss=false")
    task.head.check(hidden, returned_as_is=training)
    return _aligned(task, batch, hidden, targets)


def micro_batch_loss(task: Task, model: Callable[..., Any], batch: Any) -> torch.Tensor:
    """The mean loss of ``model`` on one (micro-)batch already on the device (see the module)."""
    if task.head is not None:  # the model returns hidden states: the head and loss in chunks
        outputs = call_model(model, _without_labels(batch))
        return task.head.loss(*_hidden_and_targets(task, outputs, batch, training=True))
    outputs = call_model(model, batch, task.pass_targets)
    if task.loss is not None:
        loss = task.loss(outputs, batch)
    else:
        loss, logits = split_outputs(outputs)
        if loss is None:
            targets = targets_of(batch, task.kind)
            if logits is None or targets is None:
                raise ValueError(
                    "the model returned no loss, and kiln found no " + ("logits" if logits is None else "targets")
                    + " to compute one (a batch's targets are a tuple's second element or a mapping's 'labels'); "
                    "return a loss from the model, or set train.loss to a function (outputs, batch) -> loss")
            loss = loss_from_logits(*_aligned(task, batch, logits, targets))
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the loss must be a scalar tensor (0-d), got {shape}; reduce it to the batch's mean")
    return loss


def evaluate(task: Task, model: nn.Module, loader: Any, device: torch.device,
             dtype: torch.dtype = torch.float32, forward: Callable[..., Any] | None = None,
             share: Callable[[dict[str, float]], dict[str, float]] | None = None,
             grad: bool = False) -> dict[str, float]:
    """The task's metrics over the whole loader under ``torch.no_grad``, each summed per sample
    (per scored token for losses over tokens), so the last, smaller batch counts with its true
    weight. (Not inference mode: tensor-parallel DTensors, and a model's own loss on them,
    do not run under it.)

    ``forward`` stands in for ``model`` and is called as the model is (a pipeline returns None
    on ranks without the last stage, which then only feed it); ``share(metrics)``
    hands the metrics of the rank that computed them to every rank. ``grad=True``
    (``train.eval_grad``) leaves autograd on, as a hand-written loop without ``no_grad`` does:
    each batch's forward records its graph, freed at the next batch; only for measuring that."""
    with torch.set_grad_enabled(grad):
        return _evaluate(task, model, loader, device, dtype, forward, share)


def _evaluate(task: Task, model: nn.Module, loader: Any, device: torch.device, dtype: torch.dtype,
              forward: Callable[..., Any] | None,
              share: Callable[[dict[str, float]], dict[str, float]] | None) -> dict[str, float]:
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}

    def add(name: str, value: torch.Tensor, count: Any) -> None:
        sums[name] = sums.get(name, 0) + value.detach().double()  # (grad=True: no graph kept across batches)
        counts[name] = counts.get(name, 0) + count

    names = task.metric_names()
    fed_only = False  # a pipeline rank without the last stage: it computes no metric
    for batch in loader:
        batch = to_device(batch, device, dtype)
        if task.head is not None:  # the model returns hidden states: loss and accuracy in chunks
            outputs = call_model(forward or model, _without_labels(batch))
            loss, correct, scored = task.head.eval_sums(*_hidden_and_targets(task, outputs, batch, training=False))
            add("loss", loss, scored)
            add("accuracy", correct, scored)
            continue
        outputs = call_model(forward or model, batch, task.pass_targets)
        if outputs is None:
            fed_only = True
            continue
        n = batch_size(batch)
        if task.loss is None:
            loss, logits = split_outputs(outputs)
        else:  # the user's loss; logits, where the outputs show them, still give the accuracy
            loss = task.loss(outputs, batch)
            try:
                logits = split_outputs(outputs)[1]
            except TypeError:
                logits = None
        targets, weight = targets_of(batch, task.kind), n
        if targets is not None:
            if logits is not None:
                logits, targets = _aligned(task, batch, logits, targets)
                logits = upcast(logits.flatten(0, -2))
            else:
                targets = _aligned(task, batch, targets, targets)[1]  # (the first argument is only sliced)
            targets = targets.flatten()
            scored = targets != IGNORE  # mlm and padding: only the scored positions count
            if task.loss is None:
                weight = scored.sum()  # a loss over tokens averages over the scored positions
            if logits is not None:
                if loss is None:
                    add("loss", F.cross_entropy(logits, targets, reduction="sum"), weight)
                if task.metrics is None and not targets.is_floating_point():  # (regression: no accuracy)
                    add("accuracy", ((logits.argmax(-1) == targets) & scored).sum(), scored.sum())
        if loss is not None:  # the model's (or train.loss's) mean, weighted by what it averaged over
            add("loss", loss.detach() * weight, weight)
        for name, fn in (task.metrics or {}).items():
            add(name, torch.as_tensor(fn(outputs, batch), device=device).detach() * n, n)
    model.train(was_training)
    # note: .item() is a device sync; evaluation is rare enough for it not to matter
    metrics = {k: (sums[k] / max(float(counts[k]), 1)).item() for k in sums}
    if fed_only and not metrics:
        return share(metrics) if share is not None else metrics  # the last stage's arrive by share
    if "loss" not in metrics:
        raise ValueError("evaluation found no loss: the validation data gave no batch with targets, "
                         "and the model returned no loss")
    if "perplexity" in names:
        metrics["perplexity"] = math.exp(min(metrics["loss"], 700.0))  # exp overflows a float past ~709
    metrics = {k: metrics[k] for k in names if k in metrics}
    return share(metrics) if share is not None else metrics


def infer_kind(dataset: Any) -> str | None:
    """The task a data set's first sample suggests: one target per sample is classification,
    one per position lm; None when the sample has no targets (or the data cannot be indexed)."""
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001  (an IterableDataset, or a data set that cannot be indexed)
        try:
            sample = next(iter(dataset))
        except Exception:  # noqa: BLE001
            return None
    if isinstance(sample, Mapping):
        target = sample.get("labels")
    elif isinstance(sample, (tuple, list)) and len(sample) > 1:
        target = sample[1]
    else:
        return None
    if target is None:
        return None
    return "classification" if torch.as_tensor(target).ndim == 0 else "lm"
