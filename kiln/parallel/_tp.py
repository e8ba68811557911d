"""Tensor parallelism (Megatron-style) for kiln's GPT and BERT: :func:`apply_tp`.

Shapes: B batch, T sequence, C model width, F feed-forward width, V vocabulary, tp the
tensor-parallel degree. Local shapes are written ``C/tp`` etc.

:func:`apply_tp` shards a model in place with DTensor's ``parallelize_module`` over a 1-D
tensor-parallel mesh; parameter names do not change (checkpoints key on them)::

    embed.tok           RowwiseParallel: (V/tp, C) rows of the vocabulary; output all-reduced
                        (or reduce-scattered over T under sequence parallelism)
    blocks.i.attn.wq/wk/wv   ColwiseParallel: (C/tp, C), so a rank computes H/tp whole heads
    blocks.i.attn.wo         RowwiseParallel: (C, C/tp), output all-reduced (reduce-scattered)
    blocks.i.mlp.fc1         ColwiseParallel: (F/tp, C)
    blocks.i.mlp.fc2         RowwiseParallel: (C, F/tp)
    head.out            ColwiseParallel: (V/tp, C); logits stay a DTensor sharded on V
                        (``loss_parallel=True``) or are all-gathered to a plain (B, T, V)

Everything else (position embedding, norms, BERT's ``head.dense``) is replicated. With
``sequence_parallel=True`` the residual stream between the sharded matmuls is split over T
(each rank holds (B, T/tp, C)); norms, dropout, the residual adds and BERT's ``head.dense``
run on those sequence shards, their parameters becoming Replicate DTensors whose gradients
are all-reduced over the tp group as they arrive (a gradient hook, see ``_to_layout_of``). Activations outside the attention and MLP are then 1/tp the
size, and each all-reduce becomes a reduce-scatter plus an all-gather (same traffic).

Per step, on every rank of the tp group (all of them get the same batch)::

    check_tp(model.cfg, tp)                        # at config time, before building anything
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = apply_tp(model, mesh["tp"], sequence_parallel=sp)   # then apply_fsdp(model, mesh=mesh["dp"]) for 2-D
    opt = kiln.optim.AdamW(model.parameters(), contiguous=False)
    for step in ...:
        with tp_loss_context(True):                # forward + loss + backward inside it
            logits = model(ids)                    # DTensor (B, T, V) sharded on V
            loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
            loss.backward()
        all_reduce_dp_gradients(model, mesh["dp"]) # only for replicated dp (no FSDP), dp > 1
        clip_grad_norm_(model.parameters(), 1.0)   # optional: global norm over every mesh
        opt.step(); opt.zero_grad()

For evaluation (accuracy), ``gather_logits(model(ids))`` turns the sharded logits into the
plain (B, T, V) tensor; the loss can be computed under ``tp_loss_context`` as in training.

Initial values: :func:`apply_tp` makes a tp group agree with its rank 0 (sharded parameters
are scattered from it, replicated ones broadcast), whatever each rank built; replicas over dp
must still start equal (the same seed, as for FSDP2).

Dropout always runs on plain local tensors, drawing from each process's own torch RNG: without
sequence parallelism, ``embed.dropout`` and each block's ``dropout`` act on *replicated*
(B, T, C) activations, so every rank of a tp group must draw the same mask: seed the torch
RNG by the dp index (``seed + dp_rank``), not by the global rank, or the tp ranks' copies of
the residual stream silently diverge. Attention dropout acts on each rank's own heads, and
under sequence parallelism every dropout acts on the rank's own shard, so there distinct
per-rank seeds are also right (same seeds give correlated, still valid, masks).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

__all__ = ["all_reduce_dp_gradients", "apply_tp", "check_tp", "clip_grad_norm_", "gather_logits",
           "tp_loss_context"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp(model_cfg: Any, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raise ``ValueError`` unless ``tp`` divides the model's heads, width, feed-forward width
    (``round(mlp_ratio * dim)``) and vocabulary (and, with ``sequence_parallel``, ``seq_len``:
    inputs must then have a multiple of tp tokens). A pure config check, no process group."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"parallel.tp={tp!r}: must be a positive integer")
    missing = [k for k in ("heads", "dim", "mlp_ratio", "vocab_size") if not hasattr(model_cfg, k)]
    if missing:
        raise ValueError(f"parallel.tp={tp}: tensor parallelism supports the transformer language models "
                         f"(gpt, bert); {type(model_cfg).__name__} has no {', '.join(missing)}")
    sizes = {"model.heads": model_cfg.heads, "model.dim": model_cfg.dim,
             "the feed-forward width round(model.mlp_ratio*model.dim)": round(model_cfg.mlp_ratio * model_cfg.dim),
             "model.vocab_size": model_cfg.vocab_size}
    if sequence_parallel:
        sizes["model.seq_len"] = model_cfg.seq_len
    choices = ", ".join(map(str, _divisors(math.gcd(*sizes.values()))))
    for name, n in sizes.items():
        if n % tp:
            why = " (parallel.sequence_parallel splits the sequence)" if name == "model.seq_len" else ""
            raise ValueError(f"parallel.tp={tp} does not divide {name}={n}{why}; choose tp in {{{choices}}}")


# The parameters apply_tp splits over the tp ranks (column-parallel weights and biases, row-
# parallel weights, the vocabulary-parallel embedding and output layer); everything else is
# replicated. For planning memory without building anything (kiln plan).
_SHARDED = re.compile(r"blocks\.\d+\.(attn\.w[qkv]\.(weight|bias)|attn\.wo\.weight|mlp\.fc1\.(weight|bias)"
                      r"|mlp\.fc2\.weight)|embed\.tok\.weight|head\.out\.(weight|bias)")


def tp_sharded(fqn: str) -> bool:
    """Whether :func:`apply_tp` splits the parameter named ``fqn`` over the tp ranks."""
    return _SHARDED.fullmatch(fqn) is not None


def _is_identity(m: Any) -> bool:
    return m is None or isinstance(m, nn.Identity)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             loss_parallel: bool = True) -> nn.Module:
    """Shard a kiln GPT or BERT (``head(blocks(embed(ids)))``) in place over the 1-D
    ``tp_mesh`` (Megatron-style, see the module docstring) and return it.

    ``model.embed``, ``model.head`` or any ``model.blocks[i]`` may be ``nn.Identity`` (a
    pipeline stage): those are skipped. ``sequence_parallel``: norms, dropout and residual
    adds run on (B, T/tp, C) sequence shards, and a block's or stage's input and output are
    such shards (T must be a multiple of tp). ``loss_parallel``: the logits are a DTensor
    sharded on the vocabulary, to be consumed under :func:`tp_loss_context` (cross-entropy
    without gathering them); False: plain replicated (B, T, V) logits. Tied embeddings
    (``head.out.weight is embed.tok.weight``) stay tied: both are Shard(0) over V.

    Call after the process group is initialised, before FSDP (``apply_fsdp(model,
    mesh=mesh["dp"])``) and before the optimizer is built.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D tensor-parallel mesh (e.g. mesh['tp']), got {tp_mesh.ndim}-D {tp_mesh}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not hasattr(model, "embed") or not hasattr(model, "head"):
        raise TypeError(f"apply_tp expects a kiln language model (embed, blocks, head), got {type(model).__name__}")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("apply_tp: the model already has DTensor parameters; apply it once, before apply_fsdp")
    tp = tp_mesh.size()
    if getattr(model, "cfg", None) is not None:
        check_tp(model.cfg, tp)
    embed, head = model.embed, model.head
    tied = (not _is_identity(embed) and not _is_identity(head)
            and getattr(getattr(head, "out", None), "weight", None) is embed.tok.weight)
    sp = sequence_parallel
    seq = Shard(1)  # the T dim of (B, T, C)
    plan: dict[str, Any] = {}

    if not _is_identity(embed):
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate())
        if sp:
            # tok gives this rank's (B, T/tp, C) slice, so the (T, C) position table must too:
            # slice its output (no communication forward; all-gather of its gradient backward)
            plan["embed.pos"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
            if not _is_identity(embed.norm):
                plan["embed.norm"] = SequenceParallel(use_local_output=True)
            embed.register_forward_pre_hook(_check_seq_divisible(tp))

    for i, block in enumerate(blocks):
        if _is_identity(block):
            continue
        b = f"blocks.{i}"
        # Rowwise output: all-reduce to replicated (B, T, C), or reduce-scatter to (B, T/tp, C)
        row_out = seq if sp else Replicate()
        plan.update({
            f"{b}.attn.wq": ColwiseParallel(), f"{b}.attn.wk": ColwiseParallel(), f"{b}.attn.wv": ColwiseParallel(),
            f"{b}.attn.wo": RowwiseParallel(output_layouts=row_out),
            f"{b}.mlp.fc1": ColwiseParallel(),
            f"{b}.mlp.fc2": RowwiseParallel(output_layouts=row_out),
        })
        if sp:
            # norm -> DTensor on T shards -> all-gathered to (B, T, C) at the attention / MLP input
            plan.update({
                f"{b}.norm1": SequenceParallel(), f"{b}.norm2": SequenceParallel(),
                f"{b}.attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                f"{b}.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            })

    if not _is_identity(head):
        logits = Shard(-1) if loss_parallel else Replicate()
        plan["head.out"] = ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=logits,
                                           use_local_output=not loss_parallel)
        if sp:
            # GPT: norm; BERT: norm, dense, transform_norm: maps applied position by position, so
            # they run on T shards with replicated weights (whose gradients must then be summed
            # over the ranks: a plain parameter here would silently get only its shard's part).
            # The last one hands head.out a DTensor on T shards.
            for n, m in head.named_children():
                if n != "out" and any(True for _ in m.parameters()):
                    plan[f"head.{n}"] = SequenceParallel()

    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.head.out.weight = model.embed.tok.weight  # both DTensors are Shard(0) over V
    for p in model.parameters():
        if isinstance(p, DTensor):
            p.register_hook(_to_layout_of(p))
    _broadcast_replicated(model, tp_mesh)
    return model


def _to_layout_of(p: DTensor):
    """A gradient hook giving ``p``'s gradient ``p``'s placements. In torch 2.13 DTensor leaves
    two gradients in another layout: a Replicate parameter used on sequence shards
    (SequenceParallel norms, BERT's head.dense) gets a Partial(sum) gradient, each rank holding
    its shard's contribution (torch.optim only works because its DTensor arithmetic reduces it
    lazily; kiln.optim steps local tensors), and the vocab-parallel embedding gets its full
    (V, C) gradient as Replicate instead of Shard(0). Here the first is all-reduced and the
    second sliced (no communication), as each gradient arrives. FSDP2 does the same in its
    reduce-scatter and replaces these parameters, so the hooks only act without it."""
    placements = tuple(p.placements)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
            grad = grad.redistribute(placements=placements)
        return grad

    return hook


def _check_seq_divisible(tp: int):
    def hook(module: nn.Module, args: tuple) -> None:
        T = args[0].shape[-1]
        if T % tp:
            raise ValueError(f"sequence parallelism splits the {T} tokens of the input over parallel.tp={tp} "
                             f"ranks; use inputs whose length is a multiple of {tp}")
    return hook


@torch.no_grad()
def _broadcast_replicated(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make the replicated parameters and buffers equal to tp rank 0's (the sharded ones were
    scattered from it): plain tensors and Replicate DTensors, whose values are not checked
    by DTensor (SequenceParallel wraps each rank's own values)."""
    group = tp_mesh.get_group()
    for t in list(model.parameters()) + list(model.buffers()):
        if isinstance(t, DTensor):
            if any(not p.is_replicate() for p in t.placements):
                continue
            t = t._local_tensor
        if t.device.type != "meta":
            dist.broadcast(t.data, group=group, group_src=0)


def tp_loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap forward, loss and backward: ``loss_parallel()`` when the model was parallelized
    with ``loss_parallel=True`` (cross-entropy on vocabulary-sharded DTensor logits, never
    gathered; the backward must run inside it too), else a ``nullcontext``.

    Inside it compute the loss as in one process, ``F.cross_entropy(logits.flatten(0, -2),
    targets.flatten())`` with plain targets (ignore_index=-100 works); the loss is a
    replicated scalar DTensor (``.item()``, ``.backward()`` and ``/ accumulate`` as usual).
    """
    return loss_parallel() if enabled else contextlib.nullcontext()


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    """The full plain (B, T, V) tensor of tensor-parallel logits (all-gathered over V when they
    are a sharded DTensor; returned as is otherwise): for accuracy, argmax, sampling."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def _local_and_dims(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(local tensor, (mesh, mesh dims it is split over) or None): what must be summed over
    ranks to get a statistic of the full tensor. _StridedShard (FSDP2 over a TP shard) is not
    ``is_shard()`` in torch 2.13, so everything but Replicate counts as split."""
    if not isinstance(t, DTensor):
        return t, None
    if any(p.is_partial() for p in t.placements):
        raise ValueError(f"gradient with Partial placements {t.placements}: reduce it before clipping")
    dims = tuple(d for d, p in enumerate(t.placements) if not p.is_replicate())
    return t._local_tensor, ((t.device_mesh, dims) if dims else None)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, extra_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a mix of plain, tensor-parallel and FSDP2 (also
    2-D) gradients on any meshes: the norm of the full gradients, one all-reduce per distinct
    (mesh, split dims) group and mesh dim; returns it as a plain tensor, the same on every
    rank. (torch's own stacks the per-tensor norms and fails on DTensors of different meshes
    or on DTensors mixed with plain tensors, which TP models have.) ``extra_group``: the ranks
    holding the model's other parameters (pipeline stages), whose gradients count too."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not grads and extra_group is None:
        return torch.tensor(0.0)
    inf = math.isinf(norm_type)
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        local, key = _local_and_dims(g)
        groups.setdefault(key, []).append(local)
    total: torch.Tensor | None = None
    for key, ts in groups.items():
        # at least fp32, and fp64 gradients keep fp64 (numerical checks compare to 1e-9)
        norms = torch.stack([n.to(torch.promote_types(n.dtype, torch.float32))
                             for n in torch._foreach_norm(ts, norm_type)])
        part = norms.max() if inf else norms.pow(norm_type).sum()
        if key is not None:
            mesh, dims = key
            for d in dims:
                dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group(d))
        total = part if total is None else (torch.maximum(total, part) if inf else total + part)
    if total is None:  # no gradient here, but the other stages wait for this rank's part
        total = torch.zeros((), dtype=torch.float32)
    if extra_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=extra_group)
    total = total if inf else total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so they cannot be clipped")
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for ts in groups.values():
        torch._foreach_mul_(ts, coef.to(ts[0].device))
    return total


@torch.no_grad()
def all_reduce_dp_gradients(model_or_params: nn.Module | Iterable[torch.Tensor],
                            dp_mesh: DeviceMesh | dist.ProcessGroup) -> None:
    """Average every parameter's local gradient over the data-parallel group (replicated dp,
    no FSDP): for a TP model the local shards of its DTensor gradients, which have the same
    layout on every dp rank. One all-reduce per dtype over a flat copy of the gradients.
    A parameter without a gradient counts as zero (every rank must send the same buffer).
    Call once per optimizer step, after the last micro-batch's backward, before clipping."""
    group = dp_mesh.get_group() if isinstance(dp_mesh, DeviceMesh) else dp_mesh
    world = dist.get_world_size(group)
    if world == 1:
        return
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for p in params:
        if not p.requires_grad or id(p) in seen:  # a tied parameter is listed once
            continue
        seen.add(id(p))
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for g, v in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(v.view_as(g))

