"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) that reshard on load.

:func:`save_sharded` writes a directory that does not depend on the world size or on how the
model was sharded: every tensor is stored under its fully qualified name,

- ``model.<fqn>``: parameters and buffers (``get_model_state_dict``: the local shards of an
  FSDP2 model, the whole tensors of a plain or replicated model);
- ``optim.state.<fqn>.<name>``: optimizer state per parameter in torch.optim's naming
  (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``step``), from the optimizer's own
  torch-layout ``state_dict()`` (for :class:`~kiln.parallel.ZeroOptimizer` the gathered full
  state; for DTensor parameters the DTensor shards);

and ``kiln_meta.json`` (rank 0): parameter groups (hyperparameters and the FQNs of their
parameters), non-tensor state entries, and the caller's ``extra``. Replicated tensors are
written once (DCP de-duplicates them across ranks); each rank writes its own DTensor shards.

:func:`load_sharded` reads into whatever the current run holds (a plain model with an arena
optimizer, a ZeroOptimizer, an FSDP2 model, any world size): DCP reads, for each target
tensor, the part of the saved chunks it covers. Nothing pickled is loaded except DCP's
``.metadata`` file, which is read with an unpickler that admits only DCP's metadata classes
and torch dtypes/sizes; non-tensor values live in the JSON file.

Saving is atomic: every rank writes into ``<dir>.tmp``; after a barrier rank 0 writes the JSON
and renames it to ``<dir>`` (a previous ``<dir>`` is replaced).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.optim import Optimizer

__all__ = ["save_sharded", "load_sharded", "META_FILE"]

META_FILE = "kiln_meta.json"
_MODEL, _STATE = "model.", "optim.state."


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _param_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    return names


def _indexed_params(optimizer: Optimizer) -> list[tuple[int, list[torch.Tensor]]]:
    """torch.optim's numbering: (start index, params) per group (a repeated tensor keeps its first index)."""
    out, start = [], 0
    for g in optimizer.param_groups:
        out.append((start, list(g["params"])))
        start += len(g["params"])
    return out


def _fqn_of_index(model: nn.Module, optimizer: Optimizer) -> dict[int, str]:
    names = _param_names(model)
    out: dict[int, str] = {}
    seen: set[int] = set()
    for start, ps in _indexed_params(optimizer):
        for i, p in enumerate(ps, start):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) not in names:
                raise ValueError("save_sharded: the optimizer holds a parameter that is not in the model")
            out[i] = names[id(p)]
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


@torch.no_grad()
def save_sharded(directory: str | os.PathLike, model: nn.Module, optimizer: Optimizer | None = None,
                 extra: dict[str, Any] | None = None) -> Path:
    """Write a resharding checkpoint of ``model`` and ``optimizer`` (a kiln optimizer, a
    :class:`~kiln.parallel.ZeroOptimizer`, any torch optimizer) to ``directory``. A
    collective: call it on every rank. ``extra``: small JSON-serialisable metadata (step
    count, RNG seeds, scheduler state) written by rank 0. Returns the directory."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    tensors: dict[str, Any] = {_MODEL + k: v for k, v in get_model_state_dict(model).items()}
    meta: dict[str, Any] = {"format": "kiln-dcp-1", "world_size": dist.get_world_size() if _dist() else 1,
                            "extra": extra or {}, "param_groups": [], "state": {}}
    if optimizer is not None:
        osd = optimizer.state_dict()  # ZeroOptimizer: a collective (gathers the shards)
        fqn = _fqn_of_index(model, optimizer)
        for idx, st in osd["state"].items():
            name = fqn[idx]
            entry: dict[str, Any] = {"tensors": [], "other": {}}
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"{_STATE}{name}.{k}"] = v
                    entry["tensors"].append(k)
                else:
                    entry["other"][k] = _jsonable(v)
            meta["state"][name] = entry
        for g in osd["param_groups"]:
            hp = {k: _jsonable(v) for k, v in g.items() if k != "params"}
            meta["param_groups"].append({"hyper": hp, "params": [fqn[i] for i in g["params"] if i in fqn]})
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save(tensors, checkpoint_id=str(tmp), no_dist=not _dist())
    _barrier()
    if _rank() == 0:
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


# -- loading ------------------------------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata dataclasses, torch dtypes/Size and plain containers."""

    _BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str", "bytes",
                 "complex", "slice", "NoneType", "getattr"}

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # DCP's metadata dataclasses and enums, never functions
                return obj
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype,
                                                                                              torch.layout,
                                                                                              torch.memory_format))):
            return super().find_class(module, name)
        if (module, name) in (("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
                              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")):
            return super().find_class(module, name)
        if module == "builtins" and name in self._BUILTINS - {"getattr"}:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"load_sharded: refusing to unpickle {module}.{name} from the DCP metadata")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any):  # noqa: D102
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _restore(v: Any, like: Any) -> Any:
    if isinstance(like, tuple) and isinstance(v, list):
        return tuple(v)
    return v


@torch.no_grad()
def load_sharded(directory: str | os.PathLike, model: nn.Module, optimizer: Optimizer | None = None,
                 *, strict: bool = True) -> dict[str, Any]:
    """Load a :func:`save_sharded` checkpoint into ``model`` (plain or FSDP2) and ``optimizer``
    (kiln arena optimizer, ZeroOptimizer, kiln ``contiguous=False`` over DTensors, torch
    optimizers), whatever the world size and sharding it was saved with. A collective: call it
    on every rank, after building the model (and ``apply_fsdp``) and the optimizer. Returns the
    ``extra`` dict given at save time."""
    path = Path(directory)
    meta = json.loads((path / META_FILE).read_text())
    reader = _SafeReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    msd = get_model_state_dict(model)
    targets: dict[str, Any] = {_MODEL + k: v for k, v in msd.items()}
    missing = [k for k in targets if k not in saved]
    if missing and strict:
        raise KeyError(f"load_sharded: {path} has no entries for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for k in missing:
        targets.pop(k)
    opt_targets: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        names = _param_names(model)
        for _, ps in _indexed_params(optimizer):
            for p in ps:
                fqn = names.get(id(p))
                entry = meta["state"].get(fqn) if fqn is not None else None
                if entry is None or fqn in opt_targets:
                    continue
                st: dict[str, Any] = {}
                for k in entry["tensors"]:
                    md = saved[f"{_STATE}{fqn}.{k}"]
                    size, dtype = tuple(md.size), md.properties.dtype
                    if size == tuple(p.shape):
                        t = torch.zeros_like(p.detach(), dtype=dtype)  # a DTensor shard for a DTensor p
                    else:
                        t = torch.zeros(size, dtype=dtype)  # 'step' and other small entries
                    st[k] = t
                    targets[f"{_STATE}{fqn}.{k}"] = t
                opt_targets[fqn] = st
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.load(targets, checkpoint_id=str(path), storage_reader=reader, no_dist=not _dist())
    set_model_state_dict(model, {k[len(_MODEL):]: v for k, v in targets.items() if k.startswith(_MODEL)},
                         options=StateDictOptions(strict=strict))
    if optimizer is not None:
        _load_optimizer(optimizer, model, meta, opt_targets)
    return meta["extra"]


def _load_optimizer(optimizer: Optimizer, model: nn.Module, meta: dict[str, Any],
                    opt_targets: dict[str, dict[str, Any]]) -> None:
    names = _param_names(model)
    group_of_fqn = {}
    for sg in meta["param_groups"]:
        for fqn in sg["params"]:
            group_of_fqn.setdefault(fqn, sg["hyper"])
    state: dict[int, dict[str, Any]] = {}
    groups = []
    seen: set[int] = set()
    for start, ps in _indexed_params(optimizer):
        g = optimizer.param_groups[len(groups)]
        hyper = next((group_of_fqn[names[id(p)]] for p in ps if names.get(id(p)) in group_of_fqn), {})
        groups.append({**{k: _restore(hyper.get(k, v), v) for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + len(ps)))})
        for i, p in enumerate(ps, start):
            if id(p) in seen:
                continue
            seen.add(id(p))
            fqn = names.get(id(p))
            if fqn in opt_targets:
                st = dict(opt_targets[fqn])
                st.update(meta["state"][fqn]["other"])
                state[i] = st
    optimizer.load_state_dict({"state": state, "param_groups": groups})
