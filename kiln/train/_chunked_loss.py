"""The language-model head and its cross-entropy in chunks of rows, so that whole logits never
exist (``train.chunked_lm_loss``).

Shapes: N rows (the scored batch's positions, B x T flattened), C width, V vocabulary, Vl the
vocabulary this rank holds (V, or V/tp under tensor parallelism), r the rows of one chunk.

At GPT-2 small's vocabulary (50304) the fp32 logits of one 8 x 1024 micro-batch are 1.65 GB,
and their gradient as much again: the largest tensors of the step. Here the head's matmul and
the loss are one pass over chunks of rows (Liger's fused linear cross-entropy, in plain torch):
for each chunk the logits ``h_r @ W^T (+ b)``, their log-softmax in fp32, the loss, and at once
the gradient of the logits ``softmax - onehot``, multiplied into the gradients of the hidden
state (``g_r @ W``, rows of its own) and of the weight (``g_r^T @ h_r``, summed over chunks);
the chunk is then freed. Backward only scales the stored gradients by the incoming one.

How the model is made to stop before its head: :func:`apply_chunked_head` replaces the output
projection's ``forward`` on the instance (as ``kiln.memory.apply_ac`` replaces a block's) by
one that returns its input, so the model returns its hidden states (B, T, C) where it returned
logits; parameter names and tied weights do not change. Which module is the projection, with
nothing applied to its output before the model returns it, is declared beside the family:
``ParallelPlan.output`` (kiln's GPT: ``head.out``; Hugging Face Llama-like and GPT-2 families:
``lm_head``); other Hugging Face causal LMs are recognised by ``get_output_embeddings()``
unless their config transforms the logits after the head (:data:`_AFTER_HEAD`).

Tensor parallelism: the projection's weight is split over the vocabulary (the plan's
``vocab_head``, with no layouts on its input and output when the loss is chunked), the hidden
state is whole on every rank; each rank computes its shard's logits per chunk, and the row
maximum, the sum of exponentials and the target's logit are all-reduced over the tp group (two
all-reduces per chunk), the hidden state's gradient (partial sums over the shards) once at the
end. The loss is then the same on every rank.

Precision: under autocast the matmuls run in the autocast dtype, as ``F.linear`` would; the
softmax and the loss in float32 (float64 stays float64), as ``kiln.train._tasks.upcast``
does for whole logits. The gradient of the logits enters the matmuls unscaled (entries in
[-1, 1]) and is accumulated in float32, so fp16 with loss scaling loses nothing to underflow.

Chunk size (:func:`chunk_rows`): rows such that a chunk's fp32 logits take about
:data:`CHUNK_BYTES`, and at least :data:`MIN_ROWS` rows, below which the matrix products slow
down (measured: see the constants). On a GPU chunks are larger (:data:`CUDA_CHUNK_BYTES`, made
even) and each chunk's softmax, loss and gradient are one compiled function
(:func:`_softmax_grad`: inductor reads the chunk's logits once for the row sums and once for the
gradient, where the eager path makes ten passes in fp32). ``train.chunked_lm_loss=auto`` computes whole logits, from
the same hidden states and as the projection would (so small models train bitwise as before),
for a batch whose logits would take less than :data:`AUTO_MIN_BYTES` (not under tensor
parallelism), where the chunked path's fixed cost is not repaid. Evaluation (loss and accuracy,
no gradient) follows the same rule, batch by batch: eval batches are large
(``data.eval_batch_size`` x T x V floats would be 105 GB at GPT-2 small's defaults), so there
too whole logits are made only where they are small.

Layouts: data parallel and ZeRO-1/2 change nothing; under FSDP2 (ZeRO-3) the root module's
parameters, the projection's among them, stay gathered from its forward to its backward
(``kiln.parallel`` applies it so), for the loss reads the weight after the forward; a pipeline
(pp > 1) hands whole logits to its schedule's loss and is not supported (``auto``: off).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kiln.errors import ConfigError
from kiln.models import find_plan
from kiln.train._tasks import IGNORE, loss_from_logits, model_kind, upcast


__all__ = ["AUTO_MIN_BYTES", "CHUNK_BYTES", "CUDA_CHUNK_BYTES", "ChunkedHead", "apply_chunked_head", "check_chunked_lm_loss", "chunk_rows",
           "chunked_cross_entropy", "chunked_eval_sums", "chunked_head_path", "head_path"]

# A chunk's fp32 logits take r x Vl x 4 bytes: about CHUNK_BYTES, and at least MIN_ROWS rows.
# Fewer rows starve the matrix products (each chunk re-reads the whole (Vl, C) weight for a thin
# product, and adds into the whole weight gradient); both sizes timed on GPT-2 small's head
# (docs/lab/facts.md, 'The chunked LM loss: chunk size and where it pays').
CHUNK_BYTES = 128 * 2**20
MIN_ROWS = 512


# train.chunked_lm_loss=auto makes whole logits where a batch's would take less: below it the
# chunks save a few milliseconds and tens of MB a step, so small models (kiln's tiny configs:
# 2 MiB a micro-batch) keep the arithmetic they had, bit for bit
# (docs/lab/facts.md, 'The chunked LM loss: chunk size and where it pays').
AUTO_MIN_BYTES = 16 * 2**20


# On a GPU a chunk is larger, and its softmax and gradient one compiled kernel (FUSED_DEVICES):
# each chunk adds a (Vl, C) product into the weight's fp32 gradient, a pass over 150 MB at
# GPT-2 small's head, and the eager softmax's ten passes over the chunk cost as much as the head's
# matmuls. With 26 chunks of 640 rows and the eager softmax the loss took 22.8 ms of a 64 ms step
# of GPT-2 small (16 x 1024) on an H200, whole logits 12 ms (docs/lab/gpu.md).
CUDA_CHUNK_BYTES = 2**30
FUSED_DEVICES = {"cuda"}


def chunk_rows(vocab: int, rows: int | None = None, device: str = "cpu") -> int:
    """Rows of a chunk over ``vocab`` columns: fp32 logits of about :data:`CHUNK_BYTES`
    (:data:`CUDA_CHUNK_BYTES` on a GPU), a multiple of 64 rows, at least :data:`MIN_ROWS` (640
    rows, 123 MiB at GPT-2's 50304). On a GPU, given the ``rows`` to cover, the chunks are made
    as even as that allows (16 x 1024 rows at GPT-2's vocabulary: 4 chunks of 4096)."""
    if device != "cuda":
        return max(MIN_ROWS, CHUNK_BYTES // (4 * vocab) // 64 * 64)
    most = max(MIN_ROWS, CUDA_CHUNK_BYTES // (4 * vocab) // 64 * 64)
    if rows is None or rows <= most:
        return most if rows is None else max(rows, 1)
    per = -(-rows // -(-rows // most))  # rows over the fewest chunks of at most `most`
    return -(-per // 64) * 64


def _dtypes(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(the matmuls' dtype, the softmax's and the accumulators'): autocast's dtype where autocast
    would cast (floating, not float64), else the inputs' own; and at least float32."""
    mm = torch.promote_types(h.dtype, w.dtype)
    device = h.device.type
    if torch.is_autocast_enabled(device) and mm != torch.float64:
        mm = torch.get_autocast_dtype(device)
    return mm, torch.promote_types(mm, torch.float32)


def _shard_targets(targets: torch.Tensor, start: int, vocab_local: int, split: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each row's target in this shard; True where the target is in it). Whole
    (``split`` False), an id past the vocabulary fails in ``gather`` as in ``cross_entropy``;
    split over tp ranks, each takes the ids in its own range (clamped columns elsewhere)."""
    if not split:
        scored = targets != IGNORE
        return torch.where(scored, targets, 0), scored
    local = targets - start
    inside = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), inside


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(r, Vl) logits of (r, C) rows, as ``F.linear`` makes them."""
    return torch.addmm(b, h, w.t()) if b is not None else h @ w.t()


def _chunk_softmax(logits: torch.Tensor, col: torch.Tensor, inside: torch.Tensor,
                   group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of one chunk's (r, Vl) logits (acc dtype), over the whole vocabulary (combined over the
    tp ``group``): each row's maximum, sum of ``exp(logit - max)`` and target's logit (r,);
    ``logits`` becomes ``exp(logit - max)`` in place. (In place, not ``torch.logsumexp``, whose
    kernel makes a temporary as large as the chunk.)"""
    target = logits.gather(1, col[:, None]).squeeze(1) * inside  # 0 where the target is in no shard here
    top = logits.amax(1)
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    logits.sub_(top[:, None]).exp_()
    sums = torch.stack([logits.sum(1), target])  # (2, r): one all-reduce for both
    if group is not None:
        dist.all_reduce(sums, group=group)
    return top, sums[0], sums[1]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ w^T + b`` against ``targets`` over the rows whose target is
    not -100, in chunks of rows; the gradients are made in the forward (see the module)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor,
                start: int, group: Any) -> torch.Tensor:
        mm, acc = _dtypes(h, w)
        scored = targets != IGNORE  # (N,)
        col, inside = _shard_targets(targets, start, w.shape[0], group is not None)
        inside = inside & scored
        with torch.autocast(h.device.type, enabled=False):  # (the dtypes are chosen above)
            h_mm, w_mm, b_mm = h.to(mm), w.to(mm), b.to(mm) if b is not None else None
            grads = [torch.empty(h.shape, dtype=acc, device=h.device), None, None]  # h, w, b
            loss = torch.zeros((), dtype=acc, device=h.device)
            step = chunk_rows(w.shape[0], h.shape[0], h.device.type)
            fused = _fused_softmax_grad(h, group)
            for s in range(0, h.shape[0], step):
                rows = slice(s, min(s + step, h.shape[0]))
                loss += _chunk_forward_backward(h_mm[rows], w_mm, b_mm, col[rows], inside[rows], scored[rows],
                                                grads, rows, acc, group, fused)
            if group is not None:
                dist.all_reduce(grads[0], group=group)  # each shard's part of every row's gradient
            if grads[1] is None:  # (no rows)
                grads[1] = torch.zeros(w.shape, dtype=acc, device=w.device)
                grads[2] = torch.zeros(b.shape, dtype=acc, device=b.device) if b is not None else None
        n = scored.sum().to(acc)
        ctx.save_for_backward(*grads, n)
        ctx.dtypes = (h.dtype, w.dtype, b.dtype if b is not None else None)
        ctx.spent = False
        return loss / n

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        if ctx.spent:
            raise RuntimeError("the chunked LM loss keeps one gradient and scales it in place: its backward runs "
                               "once (no retain_graph=True); set train.chunked_lm_loss=false to backward twice")
        ctx.spent = True
        grad_h, grad_w, grad_b, n = ctx.saved_tensors
        factor = grad_out.to(n.dtype) / n  # d(loss)/d(logit) = factor * (softmax - onehot)
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        out_h = grad_h.mul_(factor).to(h_dtype) if ctx.needs_input_grad[0] else None
        out_w = grad_w.mul_(factor).to(w_dtype) if ctx.needs_input_grad[1] else None
        out_b = grad_b.mul_(factor).to(b_dtype) if grad_b is not None and ctx.needs_input_grad[2] else None
        return out_h, out_w, out_b, None, None, None


def _softmax_grad(logits: torch.Tensor, col: torch.Tensor, inside: torch.Tensor,
                  scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's (r, V) logits, whole over the vocabulary (no tp): (its summed loss, in fp32 or
    wider; its logits' gradient, unscaled, in the logits' dtype). The eager path's arithmetic
    written for inductor, which makes it a reduction and a pointwise pass over the chunk."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    top = x.amax(1)
    e = torch.exp(x - top[:, None])
    sums = e.sum(1)
    target = x.gather(1, col[:, None]).squeeze(1) * inside
    loss = torch.where(scored, top + sums.log() - target, 0).sum()
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == col[:, None]
    g = e * torch.where(scored, 1 / sums, 0)[:, None] - (onehot & inside[:, None]).to(x.dtype)
    return loss, g.to(logits.dtype)


_COMPILED: list[Any] = []


def _fused_softmax_grad(h: torch.Tensor, group: Any) -> Any:
    """:func:`_softmax_grad` compiled (once a process, shapes dynamic), where it runs: on the
    :data:`FUSED_DEVICES`, whole over the vocabulary, and outside a dispatch mode (the FLOP count,
    kiln plan's trace: dynamo meeting one compiles the mode's handler instead); else None, and
    the chunk takes the eager path."""
    if h.device.type not in FUSED_DEVICES or group is not None or _get_current_dispatch_mode() is not None:
        return None
    if not _COMPILED:
        _COMPILED.append(torch.compile(_softmax_grad, dynamic=True))
    return _COMPILED[0]


def _chunk_forward_backward(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, col: torch.Tensor,
                            inside: torch.Tensor, scored: torch.Tensor, grads: list[Any], rows: slice,
                            acc: torch.dtype, group: Any, fused: Any = None) -> torch.Tensor:
    """One chunk of (r, C) rows ``h``: its summed loss; its logits' gradient (unscaled: softmax -
    onehot, 0 on rows not scored) multiplied into ``grads`` (the hidden state's rows ``rows``,
    added to the weight's and the bias's). ``fused``: :func:`_fused_softmax_grad`'s kernel."""
    if fused is not None:
        loss, g = fused(_logits(h, w, b), col, inside, scored)
    else:
        logits = _logits(h, w, b).to(acc)  # (r, Vl)
        top, sums, target = _chunk_softmax(logits, col, inside, group)
        loss = torch.where(scored, top + sums.log() - target, 0).sum()  # (no boolean index: no host sync)
        logits.mul_(torch.where(scored, 1 / sums, 0)[:, None])  # the softmax; 0 on rows not scored
        logits.scatter_add_(1, col[:, None], -inside[:, None].to(acc))
        g = logits.to(w.dtype)
        del logits
    if g.dtype == acc:
        torch.mm(g, w, out=grads[0][rows])
    else:
        grads[0][rows] = g @ w
    if grads[1] is None:
        grads[1] = (g.t() @ h).to(acc)  # (Vl, C)
    elif g.dtype == acc:
        grads[1].addmm_(g.t(), h)
    else:  # a bf16/fp16 product, as autocast makes it, summed over the chunks in fp32
        grads[1] += g.t() @ h
    if b is not None:
        part = g.sum(0, dtype=acc)
        grads[2] = part if grads[2] is None else grads[2].add_(part)
    return loss


def _is_dtensor(t: Any) -> bool:
    # a DTensor exists only once torch.distributed.tensor is imported: no import here for the others
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _local_head(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, int, Any]:
    """(this rank's weight rows, its bias, the first vocabulary id it holds, the tp group): a
    weight split over the vocabulary is a DTensor Shard(0) on a 1-D mesh; plain tensors are whole."""
    if not _is_dtensor(weight):
        return weight, bias, 0, None
    from torch.distributed.tensor import Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"the chunked LM loss takes a head weight split over the vocabulary on one mesh "
                         f"dimension (Shard(0)), got {tuple(weight.placements)} on a {mesh.ndim}-D mesh")
    local = weight.to_local()  # (its backward makes the gradient a Shard(0) DTensor again)
    start = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())
    return local, bias.to_local() if bias is not None else None, start, mesh.get_group()


def _whole_rows(hidden: torch.Tensor) -> torch.Tensor:
    """The hidden state as plain (N, C) rows, whole on every rank (sequence shards gathered)."""
    if _is_dtensor(hidden):
        from torch.distributed.tensor import Replicate

        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    return hidden.reshape(-1, hidden.shape[-1])


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), targets)`` (mean over the targets that are
    not -100, in fp32 or wider) without whole logits: hidden (..., C), weight (V, C) (a DTensor
    split over V under tensor parallelism), targets (...).

    >>> h, w, y = torch.randn(6, 4), torch.randn(10, 4), torch.tensor([1, 2, -100, 3, 4, 5])
    >>> plain = torch.nn.functional.cross_entropy(h @ w.t(), y)
    >>> torch.allclose(chunked_cross_entropy(h, w, None, y), plain)
    True
    """
    w, b, start, group = _local_head(weight, bias)
    return _ChunkedCrossEntropy.apply(_whole_rows(hidden), w, b, targets.reshape(-1), start, group)


@torch.no_grad()
def chunked_eval_sums(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, correct argmax predictions, scored positions) over the targets that
    are not -100, in chunks of rows, as evaluation reports them; ties go to the lowest id, as
    ``argmax`` gives them."""
    w, b, start, group = _local_head(weight, bias)
    h, targets = _whole_rows(hidden), targets.reshape(-1)
    mm, acc = _dtypes(h, w)
    scored = targets != IGNORE
    col, inside = _shard_targets(targets, start, w.shape[0], group is not None)
    loss = torch.zeros((), dtype=acc, device=h.device)
    correct = torch.zeros((), dtype=torch.long, device=h.device)
    h_mm, w_mm, b_mm = h.to(mm), w.to(mm), b.to(mm) if b is not None else None
    step = chunk_rows(w.shape[0], h.shape[0], h.device.type)
    for s in range(0, h.shape[0], step):
        e = min(s + step, h.shape[0])
        with torch.autocast(h.device.type, enabled=False):  # (the dtypes are chosen above)
            logits = _logits(h_mm[s:e], w_mm, b_mm).to(acc)
        local_top, guess = logits.max(1)
        top, sums, target = _chunk_softmax(logits, col[s:e], inside[s:e] & scored[s:e], group)
        guess += start
        if group is not None:  # the lowest id holding the largest logit over the shards
            guess = torch.where(local_top == top, guess, torch.iinfo(guess.dtype).max)
            dist.all_reduce(guess, op=dist.ReduceOp.MIN, group=group)
        loss += torch.where(scored[s:e], top + sums.log() - target, 0).sum()
        correct += ((guess == targets[s:e]) & scored[s:e]).sum()
    return loss, correct, scored.sum()


# --------------------------------------------------------------------------- the model's head

class _ReturnsInput:
    """Stands in for the output projection's ``forward``: the hidden state passes through. A
    small class rather than a closure so the model still pickles and deep-copies (as
    ``kiln.memory``'s checkpointed forward); ``last`` is what it returned in the last eager call."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.last: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # (a compiled graph returns new tensor objects)
            self.last = hidden
        return hidden


class ChunkedHead:
    """A model's output projection after :func:`apply_chunked_head`: the model returns the
    hidden states that went into it, and these compute the loss and the eval sums from them
    with the projection's weight and bias as they are at the call (FSDP2 swaps them)."""

    def __init__(self, module: nn.Module, path: str, min_bytes: int = 0) -> None:
        self.module, self.path, self.min_bytes = module, path, min_bytes

    def check(self, hidden: torch.Tensor, returned_as_is: bool) -> None:
        """That what the model returned as its logits, ``hidden``, is what entered the
        projection: the very tensor its stand-in returned (``returned_as_is``: in training, where
        nothing stands between the model and the loss; in an eager forward), and of the
        projection's input width. Call it on the model's output before slicing it."""
        stand_in = self.module.__dict__["forward"]
        last, stand_in.last = stand_in.last, None
        if returned_as_is and last is not None and hidden is not last:
            raise ValueError(f"train.chunked_lm_loss: {type(self.module).__name__} {self.path}'s output is changed "
                             "before the model returns it as its logits (a scale or soft-capping, say), which the "
                             "chunked loss does not apply; set train.chunked_lm_loss=false")
        if hidden.shape[-1] != self.module.weight.shape[1]:
            raise ValueError(f"train.chunked_lm_loss: the model returned logits of width {hidden.shape[-1]}, not the "
                             f"hidden state of width {self.module.weight.shape[1]} that {self.path} takes: its output "
                             "projection was not skipped; set train.chunked_lm_loss=false")

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the logits ``hidden`` would give, over targets not -100."""
        weight, bias = self.module.weight, self.module.bias
        if self._whole(targets, weight):  # as the projection would have made them (autocast included)
            return loss_from_logits(F.linear(hidden, weight, bias), targets)
        return chunked_cross_entropy(hidden, weight, bias, targets)

    @torch.no_grad()
    def eval_sums(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(summed cross-entropy, correct predictions, scored positions): see :func:`chunked_eval_sums`."""
        weight, bias = self.module.weight, self.module.bias
        if not self._whole(targets, weight):
            return chunked_eval_sums(hidden, weight, bias, targets)
        logits, targets = upcast(F.linear(hidden, weight, bias)).flatten(0, -2), targets.flatten()
        scored = targets != IGNORE  # (as kiln.train._tasks.evaluate scores whole logits)
        return F.cross_entropy(logits, targets, reduction="sum"), ((logits.argmax(-1) == targets) & scored).sum(), \
            scored.sum()

    def _whole(self, targets: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether these targets' logits are small enough to make whole (``min_bytes``); never
        under tensor parallelism, whose model no longer makes vocabulary-parallel logits."""
        return targets.numel() * weight.shape[0] * 4 < self.min_bytes and not _is_dtensor(weight)

    def remove(self) -> None:
        """The projection's own forward again: the model returns logits."""
        self.module.__dict__.pop("forward", None)


def apply_chunked_head(model: nn.Module, path: str, min_bytes: int = 0) -> ChunkedHead:
    """Make ``model`` return the hidden state that enters its output projection at ``path`` (an
    ``nn.Linear`` (V, C)) in place of the logits, and return the :class:`ChunkedHead` that turns
    it into the loss. Parameters, their names and tied weights are unchanged. ``min_bytes``: a
    micro-batch whose fp32 logits would take fewer bytes gets whole logits (not under tensor
    parallelism); evaluation is always chunked.

    >>> from kiln.models import create_model
    >>> model = create_model("gpt", depth=1)
    >>> head = apply_chunked_head(model, "head.out")
    >>> hidden = model(torch.zeros(2, 8, dtype=torch.long))
    >>> hidden.shape, head.loss(hidden, torch.ones(2, 8, dtype=torch.long)).shape
    (torch.Size([2, 8, 64]), torch.Size([]))
    """
    module = model.get_submodule(path)
    if not isinstance(module, nn.Linear):
        raise TypeError(f"apply_chunked_head: {type(model).__name__}.{path} is a {type(module).__name__}, not the "
                        "nn.Linear output projection")
    module.forward = _ReturnsInput(module)  # nn.Module.__call__ looks up self.forward: hooks still run
    return ChunkedHead(module, path, min_bytes)


# --------------------------------------------------------------------------- where it applies

# Config attributes of Hugging Face causal LMs that transform the logits after the head
# (Gemma's soft-capping, Cohere's logit_scale, Granite's logits_scaling, ...): not recognised.
_AFTER_HEAD = ("final_logit_softcapping", "logit_softcapping", "logit_softcap", "logit_scale", "logits_scaling",
               "output_multiplier")


def head_path(model: nn.Module, *, recognise: bool = True) -> str | None:
    """The path of ``model``'s output projection for the chunked loss: the one its family declares
    (``ParallelPlan.output``), else, with ``recognise``, a Hugging Face causal LM's
    ``get_output_embeddings()`` when it is an ``nn.Linear`` and the config transforms no logit
    after it; None when there is none."""

    plan = find_plan(model)
    if plan is not None and plan.output is not None:
        try:
            declared = model.get_submodule(plan.output)
        except AttributeError:
            return None
        return plan.output if isinstance(declared, nn.Linear) else None
    if not recognise or model_kind(model) != "lm" or not callable(getattr(model, "get_output_embeddings", None)):
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, key, None) is not None for key in _AFTER_HEAD):
        return None
    out = model.get_output_embeddings()
    if not isinstance(out, nn.Linear):
        return None
    return next((name for name, m in model.named_modules() if m is out), None)


def _refusal(cfg: Any, model: nn.Module, kind: str | None, pp: int, recognise: bool) -> tuple[str | None, str | None]:
    """(why the chunked loss cannot apply to this run, or None; the output projection's path)."""
    tc = cfg.train
    if tc.loss is not None:
        return "train.loss is set (the loss is the user's function of the logits)", None
    if tc.metrics is not None:
        return "train.metrics is set (the user's metrics read the logits)", None
    if tc.pass_targets:
        return "train.pass_targets=true (the model computes its own loss)", None
    if pp > 1:
        return (f"parallel.pp={pp}: a pipeline's last stage hands whole logits to the schedule's loss "
                "(the chunked loss is not supported there yet)"), None
    if kind != "lm":
        return (f"the task is {kind}, not a causal LM (lm)" if kind is not None else
                "the task is not known to be a causal LM (set data.task=lm)"), None
    path = head_path(model, recognise=recognise)
    if path is None:
        return (f"{type(model).__name__} declares no output projection (ParallelPlan.output) and is not a "
                "recognised Hugging Face causal LM whose get_output_embeddings() is an nn.Linear with nothing "
                "applied to its logits"), None
    return None, path


def chunked_head_path(cfg: Any, model: nn.Module, kind: str | None, pp: int = 1) -> str | None:
    """The output projection's path where this run computes its loss in chunks
    (``train.chunked_lm_loss``), None where it does not. ``true`` where it cannot apply raises
    ConfigError naming why; ``auto`` applies it to a declared head only (kiln's GPT, the Hugging
    Face families of ``kiln.models.hf_plans``), and computes whole logits for micro-batches whose
    logits would take less than :data:`AUTO_MIN_BYTES`; ``true`` also to a recognised Hugging
    Face causal LM, at every size."""
    setting = cfg.train.chunked_lm_loss
    if setting is False:
        return None
    why, path = _refusal(cfg, model, kind, pp, recognise=setting is True)
    if why is not None and setting is True:
        raise ConfigError(f"train.chunked_lm_loss=true cannot apply: {why}; set train.chunked_lm_loss=auto or false")
    return path


def check_chunked_lm_loss(cfg: Any, model: nn.Module) -> None:
    """``train.chunked_lm_loss=true`` where it cannot apply, as a ConfigError, from the config and
    the model alone (on ``meta``), before anything is built: the task's kind counts where the
    config or the model's class says it (the data's own is checked once the data is built)."""
    if cfg.train.chunked_lm_loss is True:
        kind = cfg.data.get("task") or model_kind(model)
        chunked_head_path(cfg, model, kind or "lm", cfg.parallel.pp)
