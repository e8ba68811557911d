"""Hugging Face transformers models in kiln: build one in a config, load a local checkpoint into
any layout, write a run's model back out.

A transformers model needs nothing from kiln to train: its class and config class are plain
callables, so a config builds it with nested LazyCalls (random initialisation, no download)::
    from transformers import GPT2Config, GPT2LMHeadModel
    model = L(GPT2LMHeadModel)(config=L(GPT2Config)(n_layer=2, n_embd=64, n_head=4, vocab_size=256))

Weights from a local directory (``save_pretrained`` output: safetensors, sharded or not)::
    model = L(kiln.hf.from_pretrained)(path="/models/tiny-llama", model_class="AutoModelForCausalLM")

Under ``kiln train`` that model is built from the directory's ``config.json`` with its
parameters on the ``meta`` device (no memory, no initialisation; buffers such as rotary
frequencies are computed for real), laid out over ``dp x tp x pp`` like any other, and only
then filled by :func:`load_weights`: each rank reads from the safetensors files just the part of
each tensor it holds (its FSDP2 shard, its tensor-parallel piece, its pipeline stages' tensors),
through ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``. No rank holds the whole
model unless the layout is one process. Called in plain Python, :func:`from_pretrained` returns
the loaded model, as transformers' own does; ``lazy=True`` returns it unloaded, to be laid out
and then filled with :func:`load_weights`::
    >>> model = kiln.hf.from_pretrained("/models/tiny-llama", lazy=True)      # doctest: +SKIP
    >>> par = kiln.parallel.parallelize(model, layout, zero=3)                 # doctest: +SKIP
    >>> kiln.hf.load_weights(par.model, "/models/tiny-llama")                  # doctest: +SKIP

A kiln checkpoint of a transformers model, in whatever layout the run had, is written back in
the Hugging Face layout, which ``from_pretrained`` loads in one process, by
:func:`export_checkpoint`: ``RUN_DIR/hf/`` at the end of a run, and ``kiln export RUN_DIR --to hf
DIR`` for any of its checkpoints (:func:`kiln.commands.export.export_run`, which finds the checkpoint).

Loading never executes code: safetensors headers and data only (no pickle), and the config is
transformers' JSON ``config.json`` without ``trust_remote_code``.

This module is imported only where it is used: ``import kiln`` never imports transformers.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.errors import ConfigError

__all__ = ["copy_weights", "deferred_weights", "describe", "export_checkpoint", "from_pretrained", "is_hf_model",
           "load_inner_weights", "load_weights", "materialize", "meta_parameters", "weights_source",
           "write_pretrained"]

_INSTALL = "pip install 'kiln[hf]'"
_SOURCE = "_kiln_hf_source"  # set on a model built without its weights: the directory to read them from
_DEFERRED = contextvars.ContextVar("kiln_hf_deferred", default=False)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(f"this needs Hugging Face transformers, which is not installed: {_INSTALL}") from None
    return transformers


# ------------------------------------------------------------------------------------ building


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Inside this context :func:`from_pretrained` reads no weights: it returns the model built
    from ``config.json`` with its parameters on ``meta`` (see ``lazy=True``). ``kiln train``
    builds the model in it, lays it out, then calls :func:`load_weights`."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside this context get their parameters on the ``meta`` device (shapes
    and dtypes only: no memory, and initialisation costs nothing), while their buffers are
    computed for real, on the current device: rotary frequencies, position ids and other
    non-persistent buffers are not in a checkpoint and must not be lost. (``torch.device("meta")``
    would make buffers meta too.) Parameters already on ``meta`` and tied parameters stay as
    they are."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        with _NoInitOnMeta():
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class _NoInitOnMeta(TorchDispatchMode):
    """In-place operators on ``meta`` tensors return them untouched: a meta tensor has no values
    for an initialisation (``normal_``, ``uniform_``, ``mul_``, ...) to write. Run, they would
    cost more than nothing: the meta kernels of torch's random operators are Python references
    wrapped in ``torch._disable_dynamo``, whose first call imports torch's compiler
    (docs/lab/facts.md, 'What an import costs').
    Operators that change a tensor's shape or strides in place run as they are."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (True wraps __torch_dispatch__ in torch._dynamo.disable, importing it)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (func._schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor) and args[0].is_meta
                and torch.Tag.inplace_view not in func.tags and func._overloadpacket not in _RESHAPING):
            return args[0]
        return func(*args, **(kwargs or {}))


_RESHAPING = {torch.ops.aten.resize_, torch.ops.aten.resize_as_, torch.ops.aten.set_}


def from_pretrained(path: str, model_class: str = "AutoModelForCausalLM", *, lazy: bool | None = None,
                    **kwargs: Any) -> nn.Module:
    """``transformers.<model_class>.from_pretrained(path)`` from a local directory only (kiln
    never downloads at run time); ``kwargs`` go to transformers (e.g. ``dtype``).

    ``lazy=True``: build the model from ``path/config.json`` with its parameters on ``meta``
    and read no weights; :func:`load_weights` reads them once the model is laid out. Default:
    lazy inside :func:`deferred_weights` (``kiln train``) and under ``torch.device("meta")``
    (shapes only: kiln's layout checks, ``kiln plan``), loaded otherwise."""
    transformers = _transformers()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"kiln.hf.from_pretrained: {path} is not a directory; give the local directory "
                                "that save_pretrained wrote (config.json and the weights)")
    cls = getattr(transformers, model_class, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ValueError(f"kiln.hf.from_pretrained: transformers has no model class {model_class!r} "
                         "(e.g. AutoModelForCausalLM, AutoModelForMaskedLM, LlamaForCausalLM)")
    if lazy is None:  # inside kiln train's build, or built for its shapes only (checks, kiln plan)
        lazy = _DEFERRED.get() or torch.get_default_device().type == "meta"
    if not lazy:
        return cls.from_pretrained(path, local_files_only=True, **kwargs)
    _weight_files(Path(path))  # a directory without safetensors is refused before anything is built
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)  # JSON; no remote code
    with meta_parameters():
        # Auto classes pick the class from the config; a concrete class builds itself
        model = cls.from_config(config, **kwargs) if hasattr(cls, "from_config") else cls._from_config(config, **kwargs)
    model.eval()  # as from_pretrained returns it
    setattr(model, _SOURCE, str(Path(path).resolve()))
    return model


def weights_source(model: nn.Module) -> str | None:
    """The directory whose weights a lazily built model (``from_pretrained(lazy=True)``) still
    has to read, or None."""
    return getattr(model, _SOURCE, None)


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers
    when it was never imported: then it cannot be one)."""
    import sys

    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


# ------------------------------------------------------------------------------------- loading


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        also = (f" ({', '.join(pickled)} are pickles, which kiln does not load: they can execute code; rewrite them "
                "with save_pretrained(..., safe_serialization=True))") if pickled else ""
        raise FileNotFoundError(f"kiln.hf: {path} holds no .safetensors weights{also}")
    return files


def _file_tensors(path: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor in the directory's safetensors files: name -> (file, shape). Reads headers only."""
    from safetensors import safe_open

    out: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in out:
                    raise ValueError(f"kiln.hf: {key} is in both {out[key][0].name} and {file.name} in {path}; "
                                     "a checkpoint directory holds each tensor once")
                out[key] = (file, tuple(f.get_slice(key).get_shape()))
    return out


def _held_tensors(model: nn.Module) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """What the model holds and a checkpoint fills: parameters (a tied one once, with all its
    names, first name first) and persistent buffers, keyed by their first name."""
    names: dict[int, list[str]] = {}
    first: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        first.setdefault(id(p), p)
    out = {ns[0]: [(n, first[i]) for n in ns] for i, ns in names.items()}
    for prefix, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                fqn = f"{prefix}.{name}" if prefix else name
                out.setdefault(fqn, [(fqn, b)])
    return out


def _in_file(names: list[str], found: dict[str, Any], prefix: str) -> str | None:
    """The file's name for a tensor the model holds under ``names``: the same name, else with
    the base model's prefix taken off or put on (a ``LlamaModel`` checkpoint in a
    ``LlamaForCausalLM``, and the other way round)."""
    for name in names:
        tries = [name]
        if prefix:
            tries += [name[len(prefix) + 1:]] if name.startswith(prefix + ".") else [f"{prefix}.{name}"]
        for candidate in tries:
            if candidate in found:
                return candidate
    return None


def materialize(model: nn.Module, device: torch.device | str | None) -> None:
    """Give every parameter still on ``meta`` uninitialised memory on ``device`` (FSDP2 and
    tensor-parallel DTensors get their local shard only), keeping tied parameters tied."""
    if not any(t.is_meta for t in model.parameters()):
        return
    if device is None:
        device = next((t.device for t in model.buffers() if not t.is_meta), torch.device("cpu"))
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():  # every module once; a tied parameter under several modules
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, name))
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    for places in holders.values():  # _apply replaced each holder's copy on its own: tie them again
        module, name = places[0]
        for other, other_name in places[1:]:
            other._parameters[other_name] = module._parameters[name]


def _local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank writes into (a DTensor's local shard) and where it lies in the whole."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _split_reads(held: tuple[int, ...], stored: tuple[int, ...],
                 box: tuple[slice, ...]) -> list[tuple[tuple[slice, ...], tuple]] | None:
    """Where the box ``box`` of a tensor held as ``held`` lies in the file's ``stored`` shape,
    when ``held`` splits each stored dimension into consecutive ones (GPT-2's (C, 3C) held as
    (C, 3, C)): ``[(file slices, index into the local box)]``, one contiguous run per entry (a
    tensor-parallel shard of (C, 3, C) is 3 runs of (C, C/tp)); None when ``held`` is no such
    split, or the runs would be too many to read one by one."""
    groups, i = [], 0
    for size in stored:
        group, product = [], 1
        while i < len(held) and (product < size or not group):
            product *= held[i]
            group.append(i)
            i += 1
        if product != size:
            return None
        groups.append(group)
    if i != len(held):
        return None
    per_dim = []  # per stored dimension: (file slice, index of the local box's held dimensions)
    for group in groups:
        *outer, last = group
        strides = [math.prod(held[j + 1:last + 1]) for j in outer]
        runs = []
        for index in itertools.product(*(range(box[j].start, box[j].stop) for j in outer)):
            start = sum(x * s for x, s in zip(index, strides)) + box[last].start
            runs.append((slice(start, start + box[last].stop - box[last].start),
                         tuple(x - box[j].start for x, j in zip(index, outer)) + (slice(None),)))
        per_dim.append(runs)
    if math.prod(len(runs) for runs in per_dim) > 4096:
        return None
    return [(tuple(r[0] for r in combo), sum((r[1] for r in combo), ())) for combo in itertools.product(*per_dim)]


@torch.no_grad()
def _targets(model: nn.Module, found: dict[str, Any], path: Path) -> tuple[dict[str, torch.Tensor],
                                                                          list[tuple[str, torch.Tensor]]]:
    """load_weights' targets: {file name: tensor held in the file's shape} (read box by box
    through DCP) and [(file name, tensor)] held in another shape with as many elements; a
    ValueError naming what the files lack or hold in other shapes."""
    prefix = getattr(model, "base_model_prefix", "")
    exact: dict[str, torch.Tensor] = {}
    reshaped: list[tuple[str, torch.Tensor]] = []
    missing, wrong = [], []
    for fqn, named in _held_tensors(model).items():
        t = named[0][1]
        key = _in_file([n for n, _ in named], found, prefix)
        if key is None:
            if isinstance(t, nn.Parameter):
                missing.append(fqn)
            continue
        shape = found[key][1]
        if tuple(t.shape) == shape:
            exact[key] = t.detach()
        elif math.prod(shape) == t.numel():
            reshaped.append((key, t.detach()))
        else:
            wrong.append(f"{fqn} {tuple(t.shape)} (file: {shape})")
    if missing or wrong:
        what = (f"lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else "") + \
            ("; " if missing and wrong else "") + (f"has other shapes for {', '.join(wrong[:4])}" if wrong else "")
        raise ValueError(f"kiln.hf.load_weights: {path} {what} ({len(missing) + len(wrong)} tensors); "
                         "is it a checkpoint of this model and config?")
    return exact, reshaped


def load_weights(model: nn.Module, path: str | Path | None = None, *, device: torch.device | str | None = None) -> int:
    """Fill ``model`` from the safetensors files of local Hugging Face directory ``path``
    (default: where :func:`from_pretrained` with ``lazy=True`` built it from); return how many
    elements this rank read.

    ``model`` may be laid out in any way (FSDP2, tensor parallel, this rank's pipeline stages
    under the whole model's names, ``Parallel.model``): each rank reads only the part of each
    tensor it holds, straight from the files (DCP's ``HuggingFaceStorageReader`` reads each
    target's box with safetensors' ``get_slice``). A collective when a process group is up:
    every rank calls it. Parameters still on ``meta`` get memory on ``device`` first (default:
    where the buffers are). A tensor held in another shape with as many elements as in the file
    (GPT-2's fused ``c_attn`` held as ``(C, 3, C)``) is read as the few contiguous runs its box
    makes in the file's shape (whole, when the held shape is not the file's split further). A
    file tensor the model does not hold is ignored; a held parameter that the files lack is an
    error (persistent buffers keep their computed values)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    path = Path(path if path is not None else weights_source(model) or "")
    if not str(path) or not path.is_dir():
        raise FileNotFoundError(f"kiln.hf.load_weights: {str(path) or 'no path given'} is not a directory; give the "
                                "local directory that save_pretrained wrote")
    found = _file_tensors(path)
    materialize(model, device)
    exact, reshaped = _targets(model, found, path)
    read = 0

    class Counting(DefaultLoadPlanner):  # each read item is one box of one file tensor
        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            nonlocal read
            read += math.prod(read_item.lengths)
            return super().resolve_tensor(read_item)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.load(exact, storage_reader=HuggingFaceStorageReader(str(path)), planner=Counting(),
                 no_dist=not (dist.is_available() and dist.is_initialized()))
    for key, t in reshaped:  # a few runs of each (its box in the file's shape), or the whole tensor
        file, shape = found[key]
        local, box = _local_box(t)
        runs = _split_reads(tuple(t.shape), shape, box)
        with safe_open(str(file), framework="pt") as f:
            if runs is None:
                whole = f.get_tensor(key).reshape(t.shape)
                local.copy_(whole[box])
                read += whole.numel()
                continue
            part = f.get_slice(key)
            for where, into in runs:
                piece = part[where]
                local[into].copy_(piece)
                read += piece.numel()
    if hasattr(model, _SOURCE):
        delattr(model, _SOURCE)
    return read


def load_inner_weights(model: nn.Module) -> None:
    """Read now, whole, the weights of each module inside ``model`` that :func:`from_pretrained`
    built lazily (a user's module around a Hugging Face backbone): kiln reads a model's weights
    after the layout only when the model itself comes from :func:`from_pretrained`."""
    for module in model.modules():
        if module is not model and weights_source(module) is not None:
            load_weights(module)


@torch.no_grad()
def copy_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Fill ``model`` (plain, parameters possibly on ``meta``) from whole tensors keyed by its
    parameter and buffer names, as a kiln checkpoint holds them; a tensor kept in another shape
    with as many elements is reshaped to the model's. Every parameter must be given (a tied one
    under any of its names)."""
    materialize(model, None)
    missing = []
    for fqn, named in _held_tensors(model).items():
        t = named[0][1]
        source = next((tensors[n] for n, _ in named if n in tensors), None)
        if source is None:
            if isinstance(t, nn.Parameter):
                missing.append(fqn)
            continue
        if source.numel() != t.numel():
            raise ValueError(f"{fqn}: the checkpoint holds {tuple(source.shape)}, the model {tuple(t.shape)}")
        t.copy_(source.reshape(t.shape))
    if missing:
        raise ValueError(f"the checkpoint lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                         f"({len(missing)} parameters)")


# ------------------------------------------------------------------------------------- writing


def _save_pretrained(model: nn.Module, directory: Path) -> None:
    logging = _transformers().utils.logging
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # kiln's own progress says where the run is
    try:
        model.save_pretrained(directory, safe_serialization=True)
    finally:
        if shown:
            logging.enable_progress_bar()


def write_pretrained(model: nn.Module, directory: Path | str) -> Path:
    """``save_pretrained`` of a plain model that holds its own tensors (no arena), atomically:
    written beside ``directory`` and renamed into place, so a directory named ``directory`` is
    always complete. An existing ``directory`` is replaced."""
    import shutil
    import tempfile

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    # a fresh name beside it (same file system: the rename is atomic), never one a user may own
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".tmp", dir=directory.parent))
    try:
        _save_pretrained(model, tmp)
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def describe(directory: Path | str) -> str:
    """``N tensors, X MB in K files`` of a safetensors directory (headers only)."""
    found = _file_tensors(Path(directory))
    files = _weight_files(Path(directory))
    size = sum(f.stat().st_size for f in files)
    return f"{len(found)} tensors, {size / 2**20:.1f} MB in {len(files)} file{'s' if len(files) > 1 else ''}"


def export_checkpoint(build: Callable[[], nn.Module], checkpoint: Path | str, to: Path | str) -> Path:
    """Write the transformers model that ``build()`` makes, filled from the kiln checkpoint
    directory ``checkpoint``, to ``to`` with :func:`write_pretrained` (``to`` is replaced if it
    exists); ``RUN_DIR/hf/`` at the end of a run and ``kiln export`` are this.

    ``build`` runs with parameters on ``meta`` (shapes only: the checkpoint gives every value).
    Whatever layout saved the checkpoint (processes, ZeRO, FSDP2, tensor and pipeline parallel),
    it holds each tensor whole under its parameter's name; only the model's tensors are read
    into this process, not the optimizer state, with DCP's metadata unpickler that admits only
    its own classes: nothing in a checkpoint executes. ConfigError: the model cannot be built
    (a from_pretrained directory since removed), or is not a transformers one."""
    from kiln.parallel import read_sharded

    try:
        with deferred_weights(), meta_parameters():
            model = build()
    except Exception as exc:  # noqa: BLE001  (a from_pretrained directory since removed: its config.json is needed)
        cause = exc if isinstance(exc, FileNotFoundError) else exc.__cause__  # (instantiate wraps it)
        if not isinstance(cause, FileNotFoundError):
            raise
        raise ConfigError(f"the run's model cannot be built to export it: {cause}") from None
    if not is_hf_model(model):
        kind = f"{type(model).__module__}.{type(model).__qualname__}"
        raise ConfigError(f"the run's model is {kind}, not a transformers model: only Hugging Face models "
                          "export to hf (read a checkpoint's weights with kiln.train.load_checkpoint)")
    tensors, _ = read_sharded(checkpoint, prefix="model.")
    weights = {k[len("model."):]: v for k, v in tensors.items()}
    del tensors
    dtypes = {v.dtype for v in weights.values() if v.is_floating_point()}
    if len(dtypes) == 1:  # the dtype the run held (its config.json may say bfloat16, kiln trained fp32)
        model.to(dtype=dtypes.pop())
    # kiln may hold a tensor in another shape (GPT-2's fused c_attn as (C, 3, C)): reshaped to the model's
    copy_weights(model, weights)
    return write_pretrained(model, to)
