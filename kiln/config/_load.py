"""Load a config (.py or .yaml), apply ``key=value`` overrides, validate, save.

Everything here runs before a model or a data set is built, so a typo costs a second,
not an hour of compute.

    >>> cfg = load_config("configs/digits_vit.py", ["train.max_steps=50", "optim.lr=1e-3"])
    >>> cfg.train.max_steps
    50
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

from kiln._environment import import_diagnosis
from kiln.config._lazy import add_user_dir, file_module_name, locate, target_path
from kiln.config._schema import DataConfig, EarlyStoppingConfig, NAMESPACES, OptimConfig
from kiln.config._types import ConfigError, coerce, coerce_dataclass, type_name
from kiln.config._units import parse_size
from kiln.errors import did_you_mean


def _suggest(word: str, options: Iterable[str], prefix: str = "") -> str:
    return did_you_mean(word, options, prefix=prefix, quote=False)


# --------------------------------------------------------------------------- reading files


def _read_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file not found: {path} (check the path; bundled configs are in configs/)")
    if path.is_dir():
        raise ConfigError(
            f"{path} is a directory; pass a config file (.py or .yaml), or use --resume to continue a run"
        )
    suffix = path.suffix.lower()
    if suffix == ".py":
        return _read_python(path)
    if suffix in (".yaml", ".yml"):
        return _read_yaml(path)
    raise ConfigError(f"config file {path} must end in .py, .yaml or .yml")


def _read_python(path: Path) -> dict[str, Any]:
    """Run the config file as a module of its own (``file_module_name``), so that functions
    and classes defined in it have a module ``target_path`` can name; its directory goes
    first on sys.path and stays there (the run builds the model later, in this process), so
    that modules beside it import as they would for a script."""
    path = path.resolve()
    add_user_dir(path.parent)
    name = file_module_name(path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module  # before it runs: a dataclass defined in it looks its module up
    try:
        # compiled from the text, not through the import system: no __pycache__ beside the
        # config, and no stale bytecode when a file is rewritten within the same second;
        # dont_inherit: this module's `from __future__ import annotations` is not the config's
        exec(compile(path.read_bytes(), str(path), "exec", dont_inherit=True), module.__dict__)
    except Exception as exc:  # the user's code: report it as a config problem, with its location
        sys.modules.pop(name, None)
        found = import_diagnosis(exc)  # an import in it failed for a reason outside kiln: name it
        why = found if found is not None else f"{type(exc).__name__}: {_first_line(exc)}"
        raise ConfigError(f"error while running config file {path}: {why}") from exc
    tree: dict[str, Any] = {}
    for key, value in vars(module).items():
        if key.startswith("_") or not isinstance(value, dict):
            continue  # imports, helper variables and functions are not namespaces
        tree[key] = copy.deepcopy(value)
    return tree


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from exc
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path} must hold a mapping of namespaces (model, data, ...), not a {type(tree).__name__}")
    return tree


# --------------------------------------------------------------------------- overrides


def parse_overrides(overrides: Iterable[str]) -> list[tuple[str, Any]]:
    """``key=value`` overrides as (dotted key, value) pairs, values parsed as the command line's
    (Hydra's grammar: numbers, lists, mappings, quoted strings); ConfigError for one it cannot read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        if "=" not in text:
            raise ConfigError(f"override {text!r} must look like key=value (for example train.max_steps=100)")
        # Hydra's grammar takes only ASCII: each run of other characters goes through it as an
        # ASCII word and comes back in the parsed key and value (train.output_dir=/tmp/out_é).
        runs = {run: f"kilnnonascii{i}x" for i, run in enumerate(dict.fromkeys(re.findall(r"[^\x00-\x7f]+", text)))}
        ascii_text = text
        for run, word in runs.items():
            ascii_text = ascii_text.replace(run, word)
        try:
            override = parser.parse_override(ascii_text)
        except HydraException as exc:
            raise ConfigError(f"cannot parse override {text!r}: {exc}") from exc
        back = {word: run for run, word in runs.items()}
        parsed.append((_restore(override.key_or_group, back), _restore(override.value(), back)))
    return parsed


def _restore(value: Any, words: dict[str, str]) -> Any:
    """``value`` with each word of ``words`` in its strings replaced by what it stands for."""
    if not words:
        return value
    if isinstance(value, str):
        return re.sub("|".join(words), lambda m: words[m.group(0)], value)
    if isinstance(value, dict):
        return {_restore(k, words): _restore(v, words) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v, words) for v in value]
    return value


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if parts[0] not in NAMESPACES:
        raise ConfigError(f"unknown namespace {parts[0]!r} in override {key}={value!r}" + _suggest(parts[0], NAMESPACES) + f" (namespaces: {', '.join(NAMESPACES)})")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key}: {'.'.join(parts[: i + 1])} is a value, not a group")
        node = child
    node[parts[-1]] = value


# --------------------------------------------------------------------------- validation


# Keys of Hydra's instantiate that kiln's does not read (it always builds nested nodes first and
# returns plain dicts and lists).
_HYDRA_KEYS = ("_args_", "_partial_", "_recursive_", "_convert_")


def _is_node(value: Any) -> bool:
    return isinstance(value, dict) and "_target_" in value


def _has_node(value: Any) -> bool:
    if _is_node(value):
        return True
    if isinstance(value, dict):
        return any(_has_node(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_node(v) for v in value)
    return False


def _signature(fn: Any) -> inspect.Signature | None:
    """What ``fn`` accepts: the signature of the function it wraps (for names and types), open
    to any keyword where the wrapper itself takes ``**kwargs``. transformers 5 configs wrap a
    dataclass ``__init__`` so that it also takes ``num_labels=``, ``decoder_start_token_id=``,
    ...: the wrapped signature alone would refuse them."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: nothing to check
    var_kw = inspect.Parameter.VAR_KEYWORD
    if any(p.kind is var_kw for p in sig.parameters.values()):
        return sig
    try:
        outer = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return sig
    if any(p.kind is var_kw for p in outer.parameters.values()):
        sig = sig.replace(parameters=[*sig.parameters.values(), inspect.Parameter("kwargs", var_kw)])
    return sig


def _check_signature(values: dict[str, Any], fn: Any, where: str, skip: tuple[str, ...] = (),
                     also: tuple[str, ...] = ()) -> None:
    """Check ``values`` against the keyword arguments of ``fn`` (a callable or a Signature):
    unknown keys are errors, annotated arguments get their type checked, and a value holding
    ``_target_`` nodes has each node checked against its own target instead (a node is never
    coerced by the annotation: it is built before the call). ``also``: other valid keys of
    ``where``, named in suggestions."""
    sig = fn if isinstance(fn, inspect.Signature) else _signature(fn)
    if sig is None:
        for key, value in values.items():
            values[key] = _validate_nodes(value, f"{where}.{key}")
        return
    params = sig.parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [n for n, p in params.items() if p.kind in keyword and n not in skip]
    for key, value in values.items():
        if key == "_target_" or key in skip:
            continue
        if key not in names:
            if open_ended:  # **kwargs takes it
                values[key] = _validate_nodes(value, f"{where}.{key}")
                continue
            valid = [*names, *also]
            raise ConfigError(f"unknown key {where}.{key}" + _suggest(key, valid, f"{where}.")
                              + f" (valid keys: {', '.join(valid)})")
        if _has_node(value):
            values[key] = _validate_nodes(value, f"{where}.{key}")
            continue
        annotation = params[key].annotation
        if annotation is not inspect.Parameter.empty and not isinstance(annotation, str):
            values[key] = coerce(value, annotation, f"{where}.{key}")


def _validate_nodes(value: Any, where: str) -> Any:
    """``value`` with every ``_target_`` node in it checked (dicts and lists around them kept)."""
    if _is_node(value):
        return _validate_node(value, where)
    if isinstance(value, dict):
        return {k: _validate_nodes(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_validate_nodes(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _locate_target(target: Any, label: str) -> tuple[str, Any]:
    """``(path, object)`` of a target; ``label`` names it in errors (``model._target_``)."""
    if callable(target) and not isinstance(target, str):  # a Python config may give the object itself
        target = target_path(target)
    if not isinstance(target, str):
        raise ConfigError(f"{label}={target!r} must be an import path: 'package.module.function', or "
                          "L(function)(...) for a function defined in the config file or a module beside it")
    try:
        fn = locate(target)
    except ImportError as exc:
        found = import_diagnosis(exc)
        raise ConfigError(f"{label}={target!r} cannot be imported: {found or _first_line(exc)}") from exc
    if not callable(fn):
        raise ConfigError(f"{label}={target!r} is a {type(fn).__name__}, not a function or a class")
    return target, fn


def _validate_node(node: dict[str, Any], where: str, positional: tuple[str, ...] = (),
                   skip: tuple[str, ...] = (), also: tuple[str, ...] = (), label: str | None = None) -> dict[str, Any]:
    """A ``{"_target_": path, **kwargs}`` node, checked: the target imports, and its kwargs
    (nested nodes recursively) fit its signature, required arguments included. A function
    target is called later as ``fn(*positional, **kwargs)``, so its first parameters are kiln's;
    a class target's kwargs are its constructor's. ``skip``: arguments kiln passes itself."""
    target, fn = _locate_target(node["_target_"], label or f"{where}._target_")
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    for key in kwargs:
        if key in _HYDRA_KEYS:
            raise ConfigError(f"{where}.{key} is a Hydra instantiate option that kiln does not read (nested nodes "
                              f"are always built first, into plain dicts and lists); remove {where}.{key}")
    sig = _signature(fn)
    if sig is not None and positional and inspect.isclass(fn):
        if not any("__call__" in vars(k) for k in fn.__mro__ if k is not object):
            raise ConfigError(f"{where}: instances of {target} are not callable; kiln calls {where} as "
                              f"fn({', '.join(positional)}): give a function, or a class with __call__")
    elif sig is not None and positional:
        params = list(sig.parameters.values())
        takes = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        if len(takes) < len(positional) and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            raise ConfigError(f"{where}: {target} takes {len(takes)} positional argument(s), but kiln calls it as "
                              f"fn({', '.join(positional)}, **kwargs); give it those parameters first")
        consumed = [p.name for p in takes[: len(positional)]]
        for key in kwargs:
            if key in consumed:
                raise ConfigError(f"{where}.{key}: kiln passes {target}'s first argument(s) "
                                  f"({', '.join(positional)}) when it calls it; remove {where}.{key}")
        sig = sig.replace(parameters=[p for p in params if p.name not in consumed])
    if sig is None:
        kwargs = {k: _validate_nodes(v, f"{where}.{k}") for k, v in kwargs.items()}
    else:
        _check_signature(kwargs, sig, where, skip=skip, also=also)
        missing = [n for n, p in sig.parameters.items() if p.default is p.empty and n not in kwargs and n not in skip
                   and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        if missing:
            raise ConfigError(f"{where}.{missing[0]} is missing: {target} requires {', '.join(missing)}; "
                              f"set {where}.{missing[0]}=...")
    return {"_target_": target, **kwargs}


def _validate_callable(value: Any, where: str, positional: tuple[str, ...]) -> Any:
    """A key whose value kiln calls later as ``fn(*positional, **kwargs)`` (``build_callable``):
    None, an import path, or a node; a function or class object (a Python config) becomes its path."""
    if value is None:
        return None
    if callable(value) and not isinstance(value, (str, dict)):
        value = target_path(value)
    if isinstance(value, str):
        _validate_node({"_target_": value}, where, positional, label=where)
        return value
    if _is_node(value):
        return _validate_node(value, where, positional)
    raise ConfigError(f"{where}={value!r} must be an import path ('package.module.function'), L(function)(...) "
                      f"or null; kiln calls it as fn({', '.join(positional)}, **kwargs)")


def _validate_model(node: Any) -> dict[str, Any]:
    if not isinstance(node, dict) or not node:
        raise ConfigError(
            "the config has no model: set model.name (one of kiln's registered models, "
            "e.g. model.name=vit) or a model._target_ to build"
        )
    node = dict(node)
    target = node.get("_target_")
    fn = None
    if target is not None:
        target, fn = _locate_target(target, "model._target_")
        node["_target_"] = target
    from kiln.models import create_model

    if fn is None or fn is create_model:
        from kiln.models import list_models, model_config_class

        name = node.get("name")
        if not isinstance(name, str):
            raise ConfigError(f"model.name must name a registered model ({', '.join(list_models())})")
        if name not in list_models():
            raise ConfigError(f"unknown model {name!r} in model.name" + _suggest(name, list_models(), "") + f" (registered: {', '.join(list_models())})")
        options = {k: v for k, v in node.items() if k not in ("_target_", "name")}
        cls = model_config_class(name)
        checked = {k: v for k, v in coerce_dataclass(options, cls, "model").items() if k in options}
        # Build the model's config now, so its own checks (e.g. dim divisible by heads) run early.
        try:
            resolved = cls(**checked)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model {name!r}: {exc}") from exc
        # Every option written out, so config.yaml shows the whole model, defaults included.
        head = {"_target_": target} if target is not None else {}
        return {**head, "name": name, **{f.name: getattr(resolved, f.name) for f in dataclasses.fields(cls)}}
    return _validate_node(node, "model")


_FILE_KEYS = ("path", "val_path")  # data's keys naming the files of a data set that reads them


def _validate_data(values: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """A registered data set (data.name), its arguments and files, checked against the builder's
    signature and by the data set's own check (kiln.data.check_dataset), which may fill
    arguments in from the model (``model``: the validated model node)."""
    from kiln.data import check_dataset, dataset_signature, list_datasets

    name = values["name"]
    if name not in list_datasets():
        raise ConfigError(f"unknown data set {name!r} in data.name" + _suggest(name, list_datasets(), "") + f" (available: {', '.join(list_datasets())})")
    if "seed" in values["args"]:
        raise ConfigError("data.args.seed is passed by kiln (it is train.seed); remove data.args.seed and set "
                          "train.seed")
    params = dataset_signature(name).parameters
    for key in _FILE_KEYS:
        if key in values["args"]:
            raise ConfigError(f"data.args.{key}: a file is named by data.{key}, a key of data itself; "
                              f"set data.{key}={values['args'][key]} instead")
        if values[key] is not None and key not in params:
            readers = [n for n in list_datasets() if key in dataset_signature(n).parameters]
            raise ConfigError(f"data.{key}={values[key]} names a file, and data.name={name} reads none (data sets "
                              f"that do: {', '.join(readers)}); remove data.{key}, or set data.name to one of them")
        if values[key] is not None:
            # absolute, so that config.yaml reruns and resumes from any working directory
            values[key] = os.path.abspath(os.path.expanduser(values[key]))
    _check_signature(values["args"], dataset_signature(name), "data.args", skip=("seed", *_FILE_KEYS))
    # what a kiln model declares of its sizes, for data sets that follow the model (tokens)
    sizes = {k: model[k] for k in ("vocab_size", "seq_len") if "name" in model and k in model}
    values["args"] = check_dataset(name, values["args"], path=values["path"], val_path=values["val_path"],
                                   model=sizes)
    return values


def _validate_data_target(given: dict[str, Any]) -> dict[str, Any]:
    """``data`` with a ``_target_``: the keys that are ``DataConfig``'s go to the loader (typed,
    defaults filled), every other key is an argument of the target. Returns
    ``{"_target_", **target kwargs, **loader keys}`` (no name, no args)."""

    loader_keys = DataConfig.loader_keys()
    for key in ("name", "args"):
        if key in given:
            raise ConfigError(f"data.{key} is set together with data._target_: a data._target_ replaces "
                              f"data.name/data.args (its arguments are data's other keys); remove data.{key}")
    if "seed" in given:
        raise ConfigError("data.seed is passed by kiln to a data._target_ that takes it (it is train.seed); "
                          "remove data.seed and set train.seed")
    loader = coerce_dataclass({k: v for k, v in given.items() if k in loader_keys}, DataConfig, "data")
    node = _validate_node({k: v for k, v in given.items() if k not in loader_keys}, "data", skip=("seed",),
                          also=loader_keys)
    return {**node, **{k: loader[k] for k in loader_keys}}


def _validate_metrics(metrics: Any) -> dict[str, Any] | None:
    if metrics is None:
        return None
    if _is_node(metrics) or not isinstance(metrics, dict):
        raise ConfigError(f"train.metrics={metrics!r} must map names to metrics, e.g. train.metrics = "
                          "{'f1': L(f1_score)(average='macro')}, or be null for the task's own")
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"train.metrics name {name!r} must be an identifier (letters, digits, _): it "
                              "is reported as eval_<name>; rename it")
        if name == "loss":
            raise ConfigError("train.metrics.loss: the eval loss is always reported (train.loss sets how it is "
                              "computed); give the metric another name")
        out[name] = _validate_callable(value, f"train.metrics.{name}", ("outputs", "batch"))
    return out


def _validate_optim(values: dict[str, Any]) -> dict[str, Any]:
    """optim.name names one of kiln's optimizers, and every optimizer-specific key set (not
    left at its default) is one that optimizer takes: the classes declare both."""
    from kiln.optim import OPTIMIZERS, TORCH_OPTIMIZERS

    name = values["name"]
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r} in optim.name" + _suggest(name, OPTIMIZERS, "")
                          + f" (kiln's optimizers: {', '.join(OPTIMIZERS)})")
    cls = OPTIMIZERS[name]
    if values["impl"] != "kiln" and name not in TORCH_OPTIMIZERS:
        raise ConfigError(f"optim.impl={values['impl']} builds torch.optim's class, and torch has no {name}; "
                          f"use optim.impl=kiln, or optim.name={'|'.join(TORCH_OPTIMIZERS)}")
    specific = {key for other in OPTIMIZERS.values() for key in other.config_options}
    defaults = {f.name: f.default for f in dataclasses.fields(OptimConfig)}
    for key in sorted(specific - set(cls.config_options)):
        if values[key] != defaults[key]:
            raise ConfigError(f"optim.{key}={values[key]!r} is not an option of {name} (it takes "
                              f"{', '.join(cls.config_options)}); remove it, or choose an optimizer that "
                              f"takes it ({', '.join(n for n, c in OPTIMIZERS.items() if key in c.config_options)})")
    return values


def _non_finite(cfg: dict[str, Any]) -> tuple[str, float] | None:
    """The first key of kiln's own namespaces holding nan or inf (``optim.lr=nan`` would train
    to "completed" on a NaN loss) and its value; None if every float is finite."""

    def walk(value: Any, key: str) -> tuple[str, float] | None:
        if isinstance(value, float) and not math.isfinite(value):
            return key, value
        if isinstance(value, (list, tuple)):
            return next((bad for i, v in enumerate(value) if (bad := walk(v, f"{key}[{i}]"))), None)
        return None

    for name, cls in NAMESPACES.items():
        if cls is None:
            continue
        for field in dataclasses.fields(cls):  # declared keys only: a _target_'s arguments are the user's
            if (bad := walk(cfg[name].get(field.name), f"{name}.{field.name}")) is not None:
                return bad
    stopping = cfg["train"]["early_stopping"]
    if stopping is not None:
        for field in dataclasses.fields(EarlyStoppingConfig):
            if (bad := walk(stopping[field.name], f"train.early_stopping.{field.name}")) is not None:
                return bad
    return None


def _validate_ranges(cfg: dict[str, Any]) -> None:
    """Values of one key that type checks let through but that would crash or mislead later."""
    train, data, optim = cfg["train"], cfg["data"], cfg["optim"]
    bad = _non_finite(cfg)
    if bad is not None:
        key, value = bad
        raise ConfigError(f"{key}={value} is not a finite number; set {key} to a finite value")
    output_dir = Path(train["output_dir"]).expanduser()
    for path in (output_dir, *output_dir.parents):
        if path.exists():  # the nearest existing ancestor: it must be a directory to create runs in
            if not path.is_dir():
                what = "is a file" if path == output_dir else f"is under {path}, which is a file"
                raise ConfigError(f"train.output_dir={train['output_dir']} {what}, not a directory; set "
                                  "train.output_dir to a directory (it is created if missing)")
            break
    if train["memory_budget"] is not None:
        try:
            parse_size(train["memory_budget"])
        except ValueError as exc:
            raise ConfigError(f"train.memory_budget: {exc}") from None
    if train["threads"] is not None and train["threads"] < 1:
        raise ConfigError(f"train.threads={train['threads']} must be positive, or null for torch's default")
    if isinstance(data["workers"], int) and data["workers"] < 0:
        raise ConfigError(f"data.workers={data['workers']} must be 0 (load in the training process), positive, "
                          "or 'auto'")
    if optim["betas"] is not None:
        for i, beta in enumerate(optim["betas"]):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"optim.betas[{i}]={beta} must be in [0, 1), e.g. optim.betas=[0.9,0.999]")
    if optim["warmup_steps"] < 0:
        raise ConfigError(f"optim.warmup_steps={optim['warmup_steps']} must be 0 (no warm-up) or positive")
    if not 0.0 <= optim["min_lr_ratio"] <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={optim['min_lr_ratio']} must be in [0, 1] (the final lr as a "
                          "fraction of optim.lr)")
    if optim["eps"] is not None and optim["eps"] <= 0:
        raise ConfigError(f"optim.eps={optim['eps']} must be positive, e.g. 1e-8, or null for the optimizer's default")
    if optim["weight_decay"] is not None and optim["weight_decay"] < 0:
        raise ConfigError(f"optim.weight_decay={optim['weight_decay']} must be 0 or positive, or null for the "
                          "optimizer's default")
    if optim["momentum"] is not None and not 0.0 <= optim["momentum"] < 1.0:
        raise ConfigError(f"optim.momentum={optim['momentum']} must be in [0, 1), e.g. 0.9, or null for the "
                          "optimizer's default")


def _check_arena(cfg: dict[str, Any]) -> None:
    """The features that need kiln's arena (bf16-true, ZeRO-1/2) against the settings that leave
    it out, from kiln.optim's one table of them (the runtime reads the same)."""
    from kiln.optim import ARENA_FEATURES, NO_ARENA, arena_conflicts  # (torch; _validate_optim imported it)

    keys = {need.key for need in ARENA_FEATURES.values()} | {no.key for no in NO_ARENA}
    for reason in arena_conflicts({key: cfg[ns][name] for key in keys for ns, name in [key.split(".")]}):
        raise ConfigError(reason)


def _compile_pays(device: str, parallel: dict[str, Any]) -> bool:
    """``train.compile=auto``: true on a GPU, where an eager step is bound by its kernels'
    launches and unfused elementwise passes (GPT-2 small on an H200: kiln compiled 1.07x nanoGPT's
    compiled loop, eager 0.91x; docs/lab/gpu.md); false on a CPU, where inductor's C++ build
    takes 15-35 s and pays only on long runs, under a pipeline (its stages run their own forward:
    not supported) and under parallel.auto (whose choice may be a pipeline)."""
    if parallel["pp"] > 1 or parallel["auto"]:
        return False
    if device == "cuda":
        return True
    if device != "auto":
        return False
    import torch  # (the one place the config reads the machine: where auto's device is)

    return torch.cuda.is_available()


def _validate_cross(cfg: dict[str, Any]) -> None:
    """Checks that need more than one key."""
    train, data = cfg["train"], cfg["data"]
    if train["compile"] == "auto":
        train["compile"] = _compile_pays(train["device"], cfg["parallel"])
    if train["max_steps"] is None and train["epochs"] is None:
        raise ConfigError("set train.max_steps or train.epochs (how long to train)")
    for key in ("max_steps", "epochs"):
        if train[key] is not None and train[key] <= 0:
            raise ConfigError(f"train.{key}={train[key]} must be positive")
    for key in ("batch_size", "eval_batch_size"):
        if data[key] <= 0:
            raise ConfigError(f"data.{key}={data[key]} must be positive")
    if train["clip_grad_norm"] is not None and train["clip_grad_norm"] <= 0:
        raise ConfigError(f"train.clip_grad_norm={train['clip_grad_norm']} must be positive (or null for no clipping)")
    for key in ("accumulate", "log_every", "ac_every"):
        if train[key] < 1:
            raise ConfigError(f"train.{key}={train[key]} must be at least 1")
    for key in ("eval_every", "checkpoint_every"):
        if train[key] < 0:
            raise ConfigError(f"train.{key}={train[key]} must be 0 (off) or positive")
    if data["batch_size"] % train["accumulate"]:
        raise ConfigError(
            f"data.batch_size={data['batch_size']} is not divisible by train.accumulate={train['accumulate']}; "
            "choose a batch size that is a multiple of the accumulation steps"
        )
    stopping = train["early_stopping"]
    if stopping is not None:
        if not train["eval_every"]:
            raise ConfigError("train.early_stopping needs evaluations: set train.eval_every=N (steps between them)")
        # the metrics evaluation reports: train.metrics replace the task's accuracy
        metrics = train["metrics"]
        allowed = ("eval_loss", *(f"eval_{m}" for m in (metrics if metrics is not None else ["accuracy"])))
        if stopping["metric"] not in allowed:
            raise ConfigError(f"train.early_stopping.metric={stopping['metric']!r} is not an eval metric"
                              + _suggest(stopping["metric"], allowed, "") + f" (choose from {', '.join(allowed)})")
        if stopping["patience"] < 1:
            raise ConfigError(f"train.early_stopping.patience={stopping['patience']} must be at least 1")
    for logger in dict.fromkeys(train["loggers"]):
        if logger != "csv" and importlib.util.find_spec(logger) is None:  # (looked up, not imported)
            raise ConfigError(f"train.loggers includes {logger}, but the {logger} package is not installed; "
                              f"pip install 'kiln[{logger}]' or remove it from train.loggers")
    if train["precision"] == "auto":
        from kiln.hardware import check_bf16_override

        check_bf16_override()  # KILN_BF16 set to something it does not know: said now, not in every worker
    if train["precision"] == "fp8":
        import torch

        from kiln.hardware import fp8_problem

        # the device the run trains on here (train.device=cuda without a GPU here: kiln plan's fake
        # one, or the run's own refusal when it starts)
        device = "cuda" if train["device"] == "cuda" or (train["device"] == "auto" and torch.cuda.is_available()) \
            else "cpu"
        problem = fp8_problem(device)
        if problem is not None:
            raise ConfigError(problem)
    _check_arena(cfg)
    if train["keep_checkpoints"] < 1:
        raise ConfigError(f"train.keep_checkpoints={train['keep_checkpoints']} must be at least 1")
    if cfg["optim"]["lr"] <= 0:
        raise ConfigError(f"optim.lr={cfg['optim']['lr']} must be positive")
    dp = cfg["parallel"]["dp"]
    if dp is not None and dp < 1:
        raise ConfigError(f"parallel.dp={dp} must be at least 1")
    replicate, zero = cfg["parallel"]["replicate"], cfg["parallel"]["zero"]
    if replicate < 1:
        raise ConfigError(f"parallel.replicate={replicate} must be at least 1")
    if replicate > 1 and zero in (1, 2):
        # the arena's shards would need a second collective (across replicas) after the reduce-scatter,
        # in the overlapped reducer, the clip and the checkpoints: not built
        raise ConfigError(f"parallel.replicate={replicate} (HSDP) with parallel.zero={zero} is not supported: HSDP "
                          "shards with FSDP2; use parallel.zero=3, or parallel.replicate=1")
    if replicate > 1 and zero == 0:
        raise ConfigError(f"parallel.replicate={replicate} (HSDP) shards within each replica group with FSDP2; set "
                          "parallel.zero=3 (or parallel.replicate=1 for plain data parallel)")
    if cfg["parallel"]["timeout_s"] <= 0:
        raise ConfigError(f"parallel.timeout_s={cfg['parallel']['timeout_s']} must be positive")


def validate(tree: dict[str, Any]) -> dict[str, Any]:
    """Return a complete, typed config tree (defaults filled in) or raise ConfigError."""
    for name in tree:
        if name not in NAMESPACES:
            raise ConfigError(f"unknown namespace {name!r}" + _suggest(name, NAMESPACES) + f" (namespaces: {', '.join(NAMESPACES)})")
    out: dict[str, Any] = {"model": _validate_model(tree.get("model"))}
    for name, cls in NAMESPACES.items():
        if cls is None:
            continue
        given = tree.get(name) or {}
        if not isinstance(given, dict):
            raise ConfigError(f"namespace {name!r} must be a mapping of keys, got {given!r}")
        if name == "data" and "_target_" in given:
            out[name] = _validate_data_target(given)
        else:
            out[name] = coerce_dataclass(given, cls, name)
    if "_target_" not in out["data"]:
        _validate_data(out["data"], out["model"])
    out["data"]["collate_fn"] = _validate_callable(out["data"]["collate_fn"], "data.collate_fn", ("samples",))
    out["train"]["loss"] = _validate_callable(out["train"]["loss"], "train.loss", ("outputs", "batch"))
    out["train"]["metrics"] = _validate_metrics(out["train"]["metrics"])
    _validate_optim(out["optim"])
    _validate_ranges(out)
    _validate_cross(out)
    return out


def load_config(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> Any:
    """Read ``path`` (.py or .yaml), apply ``overrides`` and validate: returns a DictConfig.

    Raises ConfigError, whose message names the key, the problem and the fix.
    """
    from omegaconf import OmegaConf

    tree = _read_file(Path(path))
    for key, value in parse_overrides(overrides):
        _set_dotted(tree, key, value)
    checked = validate(tree)
    return OmegaConf.create(_to_plain(checked))


def _to_plain(value: Any) -> Any:
    # OmegaConf stores lists, not tuples; convert once so saved YAML reads back identically.
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def save_config(cfg: Any, path: str | os.PathLike[str]) -> None:
    """Write ``cfg`` as YAML that ``kiln train PATH`` reruns."""
    from omegaconf import OmegaConf

    Path(path).write_text(OmegaConf.to_yaml(cfg, sort_keys=False))


__all__ = ["ConfigError", "load_config", "save_config", "validate", "type_name"]
