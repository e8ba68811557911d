"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) that reshard on load.

:func:`save_sharded` writes a directory that does not depend on the world size or on how the
model was sharded: every tensor is stored under its fully qualified name (FQN),

- ``model.<fqn>``: parameters and buffers (``get_model_state_dict``: the local shards of an
  FSDP2 or tensor-parallel model, the whole tensors of a plain or replicated model);
- ``optim.state.<fqn>.<name>``: optimizer state per parameter in torch.optim's naming
  (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``step``). A plain or DTensor optimizer
  gives it through its torch-layout ``state_dict()``; a :class:`~kiln.parallel.ZeroOptimizer`
  (stages 1, 2) writes the part of each tensor in its arena shard, where the shard cuts it,
  without gathering anything;
- ``master.<fqn>``: the tensors the optimizer steps when they are not the model's own
  (``masters=``: bf16-true keeps fp32 master weights outside the bf16 model);

plus ``kiln_meta.json``: parameter groups (hyperparameters and the FQNs of their parameters),
non-tensor optimizer state, and the caller's ``extra``, merged from every rank's view; and
per-rank ``files`` (small objects, ``torch.save``). Each rank writes what it holds: its
DTensor shards, its ZeRO shard, its pipeline stage's parameters (a rank may hold only some of
the model: whatever FQNs it has are saved, and on load it reads only those). Tensors that
several ranks hold alike are written once (DCP de-duplicates them).

:func:`load_sharded` reads into whatever the current run holds (a plain model with an arena
optimizer, a ZeroOptimizer, an FSDP2 or tensor-parallel model, a pipeline stage, any world
size): DCP reads, for each target tensor, the part of the saved chunks it covers. Nothing
pickled is loaded except DCP's ``.metadata`` file, read with an unpickler that admits only
DCP's metadata classes and torch dtypes/sizes (and a checkpoint whose metadata lists pickled
objects is refused); tensor data is read with ``weights_only=True``; non-tensor values live in
the JSON file. :func:`read_sharded` reads a whole checkpoint into one process, and
:func:`check_sharded` tells a complete directory from a damaged one without loading it.

Saving is atomic: every rank writes into ``<dir>.tmp``; after a barrier rank 0 writes the JSON
last and renames the directory to ``<dir>`` (a previous ``<dir>`` is replaced), so a directory
named ``<dir>`` is always complete.

    >>> save_sharded("ckpt/step-10", model, opt, extra={"step": 10})   # doctest: +SKIP
    >>> load_sharded("ckpt/step-10", model, opt)                       # doctest: +SKIP
    {'step': 10}
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import pickle
import shutil
import sys
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim import Optimizer
from torch.utils._pytree import tree_leaves

from kiln.models import find_plan
from kiln.optim import KilnOptimizer

__all__ = ["save_sharded", "AsyncSaver", "load_sharded", "read_sharded", "check_sharded", "META_FILE"]

META_FILE = "kiln_meta.json"
FORMAT = "kiln-dcp-1"
_MODEL, _STATE, _MASTER = "model.", "optim.state.", "master."
Modules = nn.Module | Sequence[nn.Module]  # a model, or the pipeline stages a rank holds


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _wait_parameters(optimizer: Optimizer | None) -> None:
    """A ZeroOptimizer whose parameter exchange runs into the next forward
    (``overlap_param_gather``): every parameter current before it is read or written."""
    if isinstance(optimizer, KilnOptimizer):
        optimizer.wait_parameters()


def _modules(model: Modules) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _param_names(model: Modules, masters: dict[str, torch.Tensor] | None = None) -> dict[int, str]:
    """id(tensor) -> FQN for the parameters this rank holds (and the masters standing in for them)."""
    names: dict[int, str] = {}
    for m in _modules(model):
        for n, p in m.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
    for n, t in (masters or {}).items():
        names[id(t)] = n
    return names


def _model_state(model: Modules) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in _modules(model):
        out.update(_state_dict(m))
    return out


def _state_dict(module: nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(module)``: by FQN, the local shards of FSDP2 and tensor-parallel
    DTensors, a compiled module's names without ``_orig_mod``. A module of plain tensors that
    was not compiled has nothing of that to map, and DCP's mapping imports torch's compiler
    (``torch._dynamo``) to ask whether the module is a compiled one, a cost of seconds
    (docs/lab/facts.md, 'What an import costs'): its own ``state_dict()`` is the same dictionary,
    without that cost, in every run that checkpoints."""
    compiled = "torch._dynamo" in sys.modules  # (nothing was compiled before dynamo was imported)
    if compiled or any(isinstance(t, DTensor) for t in itertools.chain(module.parameters(), module.buffers())):
        return get_model_state_dict(module)
    return module.state_dict()


def _held_shape(model: Modules) -> Any:
    """``held(fqn, shape) -> shape``: the shape under which every layout checkpoints a tensor
    (the family plan's ``held_shape``: GPT-2's fused q/k/v weight as (C, 3, C), which tensor
    parallelism holds so); the identity for families without one."""

    for m in _modules(model):
        plan = find_plan(m) or getattr(m, "parallel_plan", None)
        if plan is not None and plan.held_shape is not None:
            return plan.held_shape
    return lambda fqn, shape: tuple(shape)


def _as_held(held: Any, fqn: str, t: Any, target: bool = False) -> Any:
    """``t`` in its held shape: a view (the same storage: loading into the view fills ``t``),
    or, for a DTensor whose shards are not boxes of that shape (FSDP2's Shard(0) of GPT-2's
    (3C,) q/k/v bias seen as (3, C)), the whole tensor: gathered to be saved (a collective;
    small tensors only: a held shape regroups one fused projection), or, as a ``target`` to
    load into, an empty one of the whole shape (nothing to gather: the read fills it).
    :func:`_back_to` puts a loaded one back."""
    if not torch.is_tensor(t):
        return t
    shape = held(fqn, tuple(t.shape))
    if shape == tuple(t.shape):
        return t
    if isinstance(t, DTensor) and not _shards_are_boxes(t, shape):
        if target:
            return torch.empty(shape, dtype=t.dtype, device=t.to_local().device)
        return t.full_tensor().view(shape)
    return t.view(shape)


def _shards_are_boxes(t: DTensor, shape: tuple[int, ...]) -> bool:
    """Whether each shard of ``t`` viewed as ``shape`` is a box: every sharded dimension and
    those before it keep their sizes."""
    return all(tuple(shape[:p.dim + 1]) == tuple(t.shape[:p.dim + 1])
               for p in t.placements if isinstance(p, Shard))


def _back_to(loaded: torch.Tensor, like: Any) -> Any:
    """``loaded`` (read into what :func:`_as_held` gave for ``like``) in ``like``'s shape and
    layout: a gathered whole cut back into this rank's shard."""
    if isinstance(like, DTensor) and not isinstance(loaded, DTensor):
        cut = distribute_tensor(loaded.reshape(like.shape), like.device_mesh, like.placements, src_data_rank=None)
        like.to_local().copy_(cut.to_local())
        return like
    return loaded.view(like.shape)


def _indexed_params(optimizer: Optimizer) -> list[tuple[int, list[torch.Tensor]]]:
    """torch.optim's numbering: (start index, params) per group (a repeated tensor keeps its first index)."""
    out, start = [], 0
    for g in optimizer.param_groups:
        out.append((start, list(g["params"])))
        start += len(g["params"])
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else v.tolist()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def _sharded(optimizer: Optimizer | None) -> bool:
    """The optimizer steps only this rank's shard of its arenas (ZeRO-1/2): its state is this
    rank's pieces of each tensor, cut where ``shard_pieces()`` says."""
    return isinstance(optimizer, KilnOptimizer) and bool(optimizer.shards)


def _state_views(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` whose tensors are the optimizer's own, not copies: a kiln
    optimizer copies its state in ``state_dict()`` (torch.optim's, like this, does not; a
    ZeroOptimizer gathers it), and a checkpoint writes from the arena itself (sharded: this
    rank's pieces, and ``"pieces"``)."""
    return optimizer.state_dict(copy=False) if isinstance(optimizer, KilnOptimizer) else optimizer.state_dict()


def _boxes(shape: Sequence[int], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat range [a, b) of a row-major tensor of ``shape`` as (offsets, sizes) boxes, in
    order; each box is itself a contiguous run of the flat range (a partial first row, whole
    rows, a partial last row, recursively), so DCP can store it as a chunk.

    >>> _boxes((3, 4), 2, 11)
    [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(a, inner), divmod(b, inner)

    def row(r: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((r, *o), (1, *s)) for o, s in _boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return row(r0, c0, c1)
    out = row(r0, c0, inner) if c0 else []
    first = r0 + 1 if c0 else r0
    if r1 > first:
        out.append(((first, *[0] * (len(shape) - 1)), (r1 - first, *shape[1:])))
    return out + (row(r1, 0, c1) if c1 else [])


def _piece_boxes(shape: Sequence[int], piece: tuple[int, int] | None,
                 flat: torch.Tensor) -> list[tuple[Any, Any, torch.Tensor]]:
    """A shard's piece of a parameter's state (elements [start, stop) of the flattened tensor,
    held in the 1-D ``flat``) as DCP chunks over views of ``flat``: a shard cuts parameters
    anywhere, so up to 2 * ndim + 1 boxes; none where this rank holds no piece."""
    out, at = [], 0
    for offsets, sizes in _boxes(tuple(shape), *piece) if piece else ():
        size = math.prod(sizes)
        out.append((offsets, sizes, flat[at:at + size].view(sizes)))
        at += size
    return out


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner plus tensors given as chunks of a larger tensor (ZeRO shard pieces)."""

    def __init__(self, chunks: dict[str, tuple[torch.Size, list[tuple[Any, Any, torch.Tensor]]]]):
        super().__init__()
        self.chunks = chunks
        self.by_index = {(fqn, torch.Size(o)): t for fqn, (_, boxes) in chunks.items() for o, _, t in boxes}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)),
                               properties=TensorProperties.create_from_tensor(t), size=size))
                 for fqn, (size, boxes) in self.chunks.items() for o, s, t in boxes]
        mappings = {**(plan.planner_data or {}), **{fqn: (fqn,) for fqn in self.chunks}}
        self.plan = dataclasses.replace(plan, items=plan.items + items, planner_data=mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        key = (write_item.index.fqn, write_item.index.offset)
        data = self.by_index[key] if key in self.by_index else super().resolve_data(write_item)
        return _own_storage(data) if torch.is_tensor(data) else data


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a contiguous CPU tensor) as a tensor whose storage is exactly its own bytes,
    sharing them: a slice of the storage it views, no copy. DCP's writer clones every tensor
    whose storage is larger than itself (``torch.save`` would write the whole storage) and
    keeps each clone until the rank's file is written: for kiln's arena, whose parameters and
    optimizer state are all views of a few flat buffers, that was a second copy of the whole
    state in memory during every save."""
    st = t.untyped_storage()
    if t.device.type != "cpu" or not t.is_contiguous() or st.nbytes() == t.nbytes:
        return t  # (a GPU tensor is copied to the host by DCP anyway, one at a time)
    start = t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(st[start:start + t.nbytes], 0, t.shape, t.stride())


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner plus targets given as chunks of a larger tensor (ZeRO shard pieces)."""

    def __init__(self, chunks: dict[str, list[tuple[Any, Any, torch.Tensor]]]):
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        for fqn, boxes in self.chunks.items():
            local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in boxes]
            plan.items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], local)
        return plan

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        boxes = self.chunks.get(read_item.dest_index.fqn)
        if boxes is None:
            return super().resolve_tensor(read_item)
        target = boxes[read_item.dest_index.index][2]
        return narrow_tensor_by_index(target, read_item.dest_offsets, read_item.lengths)


def _merge_meta(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One parameter-group list and one state table from every rank's (a pipeline stage knows
    only its own parameters): groups are merged by position when every rank has as many, else
    by equal hyperparameters; FQNs keep rank order, so a pipeline's stages give the model's order."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    same_count = len({len(p["param_groups"]) for p in parts}) == 1
    for part in parts:
        state.update(part["state"])
        for j, g in enumerate(part["param_groups"]):
            target = (groups[j] if same_count and j < len(groups)
                      else next((m for m in groups if m["hyper"] == g["hyper"]), None))
            if target is None:
                groups.append({"hyper": g["hyper"], "params": list(g["params"])})
            else:
                have = set(target["params"])  # data-parallel replicas repeat the same names
                target["params"] += [f for f in g["params"] if f not in have]
    return {"state": state, "param_groups": groups}


def _writer(path: Path, tensors: dict[str, Any]) -> FileSystemWriter:
    """DCP's writer for a save of ``tensors``. State on a GPU is written one file per tensor,
    each copied to host memory as it is written: DCP's default (one file per rank) keeps every
    tensor of a file in host memory until the file is closed, the rank's whole state, staged in
    pinned memory that torch's host allocator then keeps (GPT-2 small's 1.5 GB state on an H200:
    RSS +2.8 GB; docs/lab/gpu.md). On the CPU the tensors are their own host copies (aliases:
    :class:`_SavePlanner`), so one file per rank costs nothing."""
    on_device = any(torch.is_tensor(t) and t.device.type != "cpu" for t in tensors.values())
    if on_device:
        return FileSystemWriter(path, single_file_per_rank=False, per_thread_copy_ahead=0)
    return FileSystemWriter(path)


@contextlib.contextmanager
def _dcp_call() -> Iterator[None]:
    """Around a ``dcp.save`` or ``dcp.load``: without its warning that one process is "assuming
    the intent is to save in a single process", and with its call logger (which records every
    call, one per tensor written, at DEBUG, to a handler that drops them) above DEBUG: records
    nobody reads, a few percent of a small model's save (docs/lab/facts.md, 'Host time')."""
    import logging

    from torch.distributed.checkpoint.logger import _dcp_logger

    level = _dcp_logger.level
    _dcp_logger.setLevel(max(level, logging.INFO))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process")
            yield
    finally:
        _dcp_logger.setLevel(level)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass
class _Save:
    """One save, built in the caller's thread: the tensors DCP writes (and the ZeRO shard
    pieces, as chunks), and what completes the directory after them: this rank's files, its
    view of the optimizer's groups and non-tensor state, rank 0's ``extra``."""

    final: Path
    tmp: Path
    tensors: dict[str, Any]
    chunks: dict[str, tuple[torch.Size, list]]
    local: dict[str, Any]
    files: dict[str, bytes]
    extra: dict[str, Any]

    def cleanup(self) -> None:
        if _rank() == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)  # never leave a half-written directory behind


def _begin(directory: str | os.PathLike, model: Modules, optimizer: Optimizer | None,
           extra: dict[str, Any] | None, masters: dict[str, torch.Tensor] | None,
           files: dict[str, Any] | None) -> _Save:
    """The start of a save on every rank: the debris of one that died cleared, and what this
    rank writes gathered by name (views of its own tensors, nothing copied)."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    _wait_parameters(optimizer)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that died
    _barrier()
    held = _held_shape(model)
    tensors: dict[str, Any] = {_MODEL + k: _as_held(held, k, v) for k, v in _model_state(model).items()}
    tensors.update({_MASTER + k: v for k, v in (masters or {}).items()})
    names = _param_names(model, masters)
    local: dict[str, Any] = {"state": {}, "param_groups": []}
    chunks: dict[str, tuple[torch.Size, list]] = {}
    if optimizer is not None:
        indexed = [(i, p) for start, ps in _indexed_params(optimizer) for i, p in enumerate(ps, start)]
        if any(id(p) not in names for _, p in indexed):
            raise ValueError("save_sharded: the optimizer holds a parameter that is not in the model "
                             "(pass masters= for tensors it steps in the model's place)")
        fqn = {i: names[id(p)] for i, p in indexed}
        shape = {i: torch.Size(held(names[id(p)], tuple(p.shape))) for i, p in indexed}
        sharded = _sharded(optimizer)
        # a shard's own state dict: this rank's pieces, and where they lie (no gather)
        osd = _state_views(optimizer)
        pieces = osd.pop("pieces", {})
        for idx, st in osd["state"].items():
            entry = {"tensors": [], "other": {}}
            for k, v in st.items():
                if not torch.is_tensor(v):
                    entry["other"][k] = _jsonable(v)
                    continue
                if sharded and k != "step":
                    chunks[f"{_STATE}{fqn[idx]}.{k}"] = (shape[idx], _piece_boxes(shape[idx], pieces.get(idx), v))
                else:
                    tensors[f"{_STATE}{fqn[idx]}.{k}"] = _as_held(held, fqn[idx], v)
                entry["tensors"].append(k)
            local["state"][fqn[idx]] = entry
        for g in osd["param_groups"]:
            hyper = {k: _jsonable(v) for k, v in g.items() if k != "params"}
            local["param_groups"].append({"hyper": hyper, "params": [fqn[i] for i in g["params"] if i in fqn]})
    blobs = {}
    for name, obj in (files or {}).items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        blobs[name] = buffer.getvalue()
    # raises now on anything that is not JSON; and a copy that the steps after the call cannot change
    extra = json.loads(json.dumps(extra or {}))
    return _Save(final, tmp, tensors, chunks, local, blobs, extra)


def _complete(save: _Save, group: dist.ProcessGroup | None = None) -> Path:
    """The end of a save, once every rank's tensors are written: each rank's files, then rank
    0's JSON (last: a directory without it is incomplete) and the rename into place. A
    collective over ``group``."""
    rank, world = _rank(), dist.get_world_size() if _dist() else 1
    for name, blob in save.files.items():
        with open(save.tmp / name, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
    parts = [None] * world
    if world > 1:
        dist.all_gather_object(parts, save.local, group=group)  # also the barrier: every rank's files are written
    else:
        parts = [save.local]
    if rank == 0:
        meta = {"format": FORMAT, "world_size": world, "extra": save.extra, **_merge_meta(parts)}
        with open(save.tmp / META_FILE, "w") as f:
            f.write(json.dumps(meta, indent=1))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(save.tmp)
        final = save.final
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(save.tmp, final)
        _fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    if world > 1:
        dist.barrier(group=group)
    return save.final


@torch.no_grad()
def save_sharded(directory: str | os.PathLike, model: Modules, optimizer: Optimizer | None = None,
                 extra: dict[str, Any] | None = None, *, masters: dict[str, torch.Tensor] | None = None,
                 files: dict[str, Any] | None = None) -> Path:
    """Write a resharding checkpoint of ``model`` and ``optimizer`` to ``directory``. A
    collective: call it on every rank, each with what it holds.

    Args:
        model: the model, or a list of the modules this rank holds (pipeline stages whose
            parameter names are those of the whole model).
        optimizer: a kiln optimizer, a :class:`~kiln.parallel.ZeroOptimizer`, any torch optimizer.
        extra: small JSON-serialisable metadata (step count, scheduler state), rank 0's.
        masters: FQN -> the tensor the optimizer steps for that parameter, where it is not the
            model's own (bf16-true: the fp32 master weights); saved as ``master.<fqn>``.
        files: this rank's own small objects, ``{file name: object}``, written with
            ``torch.save`` into the directory (names must differ between ranks); read them
            back with ``torch.load(..., weights_only=True)``.

    Returns the directory. :class:`AsyncSaver` writes the same directory in the background."""
    save = _begin(directory, model, optimizer, extra, masters, files)
    try:
        with _dcp_call():
            dcp.save(save.tensors, storage_writer=_writer(save.tmp, save.tensors), planner=_SavePlanner(save.chunks),
                     no_dist=not _dist())
        return _complete(save)
    except BaseException:
        save.cleanup()
        raise


class _Staged:
    """DCP's stager for a state dict that is already a host copy: :class:`AsyncSaver` stages
    the ZeRO shard pieces with it, which DCP's own stager would not see (they reach DCP
    through the planner, not the state dict)."""

    should_synchronize_after_execute = False  # (there is nothing to wait for)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class AsyncSaver:
    """:func:`save_sharded` in the background, one save at a time: :meth:`save` copies what
    this rank holds into host memory (the next steps may change the originals at once), and
    DCP's ``async_save`` writes the copy in a thread of its own, which then completes the
    directory as :func:`save_sharded` does (files, ``kiln_meta.json`` last, the rename): a
    directory named ``<dir>`` is complete whenever it appears, and a kill before leaves only
    ``<dir>.tmp``. The host copy is kept and reused save after save (its allocation costs as
    much as the copy). A collective like :func:`save_sharded`: every rank calls :meth:`save`,
    and :meth:`wait` before ending.

        >>> saver = AsyncSaver()                                               # doctest: +SKIP
        >>> saver.save("ckpt/step-10", model, opt, extra={"step": 10})         # doctest: +SKIP
        >>> ...                                                                # the next steps
        >>> saver.wait()                                                       # doctest: +SKIP
        PosixPath('ckpt/step-10')
    """

    def __init__(self) -> None:
        self._pending: Future | None = None
        self._copy: Any = None  # the host copy of the last save's tensors
        self._group: dist.ProcessGroup | None = None

    @torch.no_grad()
    def save(self, directory: str | os.PathLike, model: Modules, optimizer: Optimizer | None = None,
             extra: dict[str, Any] | None = None, *, masters: dict[str, torch.Tensor] | None = None,
             files: dict[str, Any] | None = None) -> None:
        """Start writing ``directory`` (the arguments of :func:`save_sharded`), after the save
        in flight is complete (its error raised here). Returns once the state is copied."""
        self.wait()
        if _dist() and self._group is None:
            # the background's own group: its collectives run beside the steps' on the default group
            self._group = dist.new_group(backend="gloo")
        save = _begin(directory, model, optimizer, extra, masters, files)
        try:
            pieces = [t for _, boxes in save.chunks.values() for _, _, t in boxes]
            staged = self._stage({"tensors": save.tensors, "pieces": pieces})
            left = iter(staged["pieces"])
            chunks = {k: (size, [(o, s, next(left)) for o, s, _ in boxes]) for k, (size, boxes) in save.chunks.items()}
            _quiet_background_saves()
            with _dcp_call():
                upload = dcp.async_save(staged["tensors"], storage_writer=FileSystemWriter(save.tmp),
                                        planner=_SavePlanner(chunks), process_group=self._group,
                                        async_stager=_Staged(), no_dist=not _dist())
        except BaseException:
            save.cleanup()
            raise
        done: Future = Future()

        def complete(upload: Future) -> None:  # in DCP's writing thread, once this rank's tensors are written
            try:
                upload.result()
                done.set_result(_complete(save, self._group))
            except BaseException as exc:
                save.cleanup()
                done.set_exception(exc)

        self._pending = done
        upload.add_done_callback(complete)

    def _stage(self, tensors: dict[str, Any]) -> Any:
        """A host copy of ``tensors`` (DTensors keep their placements, with local shards on the
        host), into the last save's copy where it has the same tensors."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = [(type(t), tuple(t.shape), t.dtype) for t in tree_leaves(tensors) if torch.is_tensor(t)]
        if self._copy is None or self._copy[0] != layout:
            on_gpu = any(torch.is_tensor(t) and t.device.type == "cuda" for t in tree_leaves(tensors))
            # pinned: the copy from a GPU runs at the bus's speed (allocated once: the copy is reused)
            self._copy = (layout, _create_cpu_state_dict(tensors, pin_memory=on_gpu))
        return _copy_state_dict(tensors, self._copy[1])

    def done(self) -> bool:
        """Whether the save in flight has ended (written, or failed: :meth:`wait` says which)."""
        return self._pending is not None and self._pending.done()

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def wait(self) -> Path | None:
        """Wait for the save in flight and return its directory (None if there was none); its
        error, if it failed, is raised here, once."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()


def _quiet_background_saves() -> None:
    """DCP's warning that one process is "assuming the intent is to save in a single process",
    silenced for its writing thread too (:func:`_dcp_call` silences it only around a call in
    this thread; warnings filters are the process's). Set at every save: a caller that restores
    its filters (pytest, ``warnings.catch_warnings``) drops it."""
    warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")


# -- reading ------------------------------------------------------------------------------------
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "ChunkStorageMetadata",
                                              "TensorProperties", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "builtins": {"dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str", "bytes",
                 "complex", "slice", "NoneType"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata dataclasses, torch dtypes/Size and plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype,
                                                                                              torch.layout,
                                                                                              torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"load_sharded: refusing to unpickle {module}.{name} from the DCP metadata")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any):  # noqa: D102
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        # DCP unpickles byte entries with weights_only=False: kiln writes none, and reads none
        odd = [k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
        if odd:
            raise pickle.UnpicklingError(f"load_sharded: entries {odd[:3]} are pickled objects, not tensors")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_sharded(directory: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata of a complete :func:`save_sharded` directory; ValueError saying what is
    missing or cut short otherwise. Reads no tensor data: it checks that the metadata files load
    and that every data file is as long as the metadata says."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"no readable {META_FILE} ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{META_FILE} is not kiln's ({FORMAT})")
    try:
        storage = _SafeReader(str(path)).read_metadata().storage_data
    except Exception as exc:  # missing, truncated, or holding what the unpickler refuses
        raise ValueError(f"DCP metadata unreadable ({type(exc).__name__}: {exc})") from None
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have is None or have < size:
            raise ValueError(f"data file {name} is {'missing' if have is None else f'{have} of {size} bytes'}")
    return meta


def read_sharded(directory: str | os.PathLike, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of a :func:`save_sharded` checkpoint whose key starts with ``prefix``
    (default: all), whole, in this process (no process group needed), and its JSON metadata:
    ``({"model.<fqn>": ..., "optim.state.<fqn>.<name>": ..., "master.<fqn>": ...}, meta)``. Only
    those tensors are allocated and read (``prefix="model."``: the weights without the
    optimizer state, about a third of an AdamW checkpoint)."""
    path = Path(directory)
    meta = json.loads((path / META_FILE).read_text())
    reader = _SafeReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    tensors = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in saved.items() if k.startswith(prefix)}
    with _dcp_call():
        dcp.load(tensors, checkpoint_id=str(path), storage_reader=reader, no_dist=True)
    return tensors, meta


@torch.no_grad()
def load_sharded(directory: str | os.PathLike, model: Modules, optimizer: Optimizer | None = None,
                 *, strict: bool = True, masters: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Load a :func:`save_sharded` checkpoint into ``model`` (plain, FSDP2, tensor parallel, or
    the list of pipeline stages this rank holds), ``optimizer`` (kiln arena optimizer,
    ZeroOptimizer, kiln ``contiguous=False`` over DTensors, torch optimizers) and ``masters``
    (as given to :func:`save_sharded`, loaded in place), whatever the world size and sharding it
    was saved with. A collective: call it on every rank, after building the model (and
    ``apply_fsdp``) and the optimizer. Each rank reads only the FQNs it holds. Returns the
    ``extra`` dict given at save time."""
    path = Path(directory)
    meta = json.loads((path / META_FILE).read_text())
    _wait_parameters(optimizer)  # nothing may still be written into what is loaded
    reader = _SafeReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    states = [_state_dict(m) for m in _modules(model)]
    held = _held_shape(model)
    targets: dict[str, Any] = {_MODEL + k: _as_held(held, k, v, target=True) for sd in states for k, v in sd.items()}
    targets.update({_MASTER + k: v for k, v in (masters or {}).items()})
    missing = [k for k in targets if k not in saved]
    if missing and strict:
        raise KeyError(f"load_sharded: {path} has no entries for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for k in missing:
        targets.pop(k)
    names = _param_names(model, masters)
    opt_targets: dict[str, dict[str, Any]] = {}
    chunks: dict[str, list] = {}
    sharded = _sharded(optimizer)
    pieces = optimizer.shard_pieces() if sharded else {}  # where this rank's shards cut
    put_back: list[tuple[dict[str, Any], str, str]] = []  # state entries read through a held shape
    for start, ps in _indexed_params(optimizer) if optimizer is not None else ():
        for idx, p in enumerate(ps, start):
            fqn = names.get(id(p))
            entry = meta["state"].get(fqn) if fqn is not None else None
            if entry is None or fqn in opt_targets:
                continue
            st: dict[str, Any] = {}
            for k in entry["tensors"]:
                key = f"{_STATE}{fqn}.{k}"
                size, dtype = tuple(saved[key].size), saved[key].properties.dtype
                held_p = held(fqn, tuple(p.shape))
                if sharded and k != "step":  # this rank's piece only, read as chunks
                    a, b = pieces.get(idx, (0, 0))
                    st[k] = torch.zeros(b - a, dtype=dtype, device=p.device)
                    chunks[key] = _piece_boxes(held_p, pieces.get(idx), st[k])
                    continue
                if size == held_p:
                    st[k] = torch.zeros_like(p.detach(), dtype=dtype)  # a DTensor shard for a DTensor p
                    targets[key] = _as_held(held, fqn, st[k], target=True)
                    put_back.append((st, k, key))
                    continue
                st[k] = torch.zeros(size, dtype=dtype)  # 'step' and other small entries
                targets[key] = st[k]
            opt_targets[fqn] = st
    with _dcp_call():
        dcp.load(targets, checkpoint_id=str(path), storage_reader=reader, planner=_LoadPlanner(chunks),
                 no_dist=not _dist())
    for st, k, key in put_back:
        st[k] = _back_to(targets[key], st[k])
    for m, sd in zip(_modules(model), states):
        set_model_state_dict(m, {k: _back_to(targets[_MODEL + k], sd[k]) for k in sd if _MODEL + k in targets},
                             options=StateDictOptions(strict=strict))
    if optimizer is None:
        return meta["extra"]
    hyper_of = _hyper_of(optimizer, names, meta)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    seen: set[int] = set()
    for (start, ps), hyper in zip(_indexed_params(optimizer), hyper_of):
        groups.append({**hyper, "params": list(range(start, start + len(ps)))})
        for i, p in enumerate(ps, start):
            if id(p) in seen:
                continue
            seen.add(id(p))
            fqn = names.get(id(p))
            if fqn in opt_targets:
                state[i] = {**opt_targets[fqn], **meta["state"][fqn]["other"]}
    optimizer.load_state_dict({"state": state, "param_groups": groups,  # a shard's: its pieces, and where
                               **({"pieces": pieces} if sharded else {})})
    return meta["extra"]


def _restore(v: Any, like: Any) -> Any:
    if isinstance(like, tuple) and isinstance(v, list):
        return tuple(v)
    return v


def _hyper_of(optimizer: Optimizer, names: dict[int, str], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Each current group's hyperparameters: the saved ones of the group its parameters were in
    (the current values where nothing was saved), JSON lists back to tuples where torch has tuples."""
    group_of_fqn: dict[str, dict[str, Any]] = {}
    for sg in meta["param_groups"]:
        for fqn in sg["params"]:
            group_of_fqn.setdefault(fqn, sg["hyper"])
    out = []
    for g in optimizer.param_groups:
        hyper = next((group_of_fqn[names[id(p)]] for p in g["params"] if names.get(id(p)) in group_of_fqn), {})
        out.append({k: _restore(hyper.get(k, v), v) for k, v in g.items() if k != "params"})
    return out
