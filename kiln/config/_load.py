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
import difflib
import inspect
import os
import runpy
from pathlib import Path
from typing import Any, Iterable

from kiln.config._lazy import locate
from kiln.config._schema import NAMESPACES
from kiln.config._types import ConfigError, coerce, coerce_dataclass, type_name


def _suggest(word: str, options: Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


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
    try:
        namespace = runpy.run_path(str(path), run_name="__kiln_config__")
    except Exception as exc:  # the user's code: report it as a config problem, with its location
        raise ConfigError(f"error while running config file {path}: {type(exc).__name__}: {exc}") from exc
    tree: dict[str, Any] = {}
    for name, value in namespace.items():
        if name.startswith("_") or not isinstance(value, dict):
            continue  # imports, helper variables and functions are not namespaces
        tree[name] = copy.deepcopy(value)
    return tree


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


def _parse_overrides(overrides: Iterable[str]) -> list[tuple[str, Any]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        if "=" not in text:
            raise ConfigError(f"override {text!r} must look like key=value (for example train.max_steps=100)")
        try:
            override = parser.parse_override(text)
        except HydraException as exc:
            raise ConfigError(f"cannot parse override {text!r}: {exc}") from exc
        parsed.append((override.key_or_group, override.value()))
    return parsed


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


def _check_signature(values: dict[str, Any], fn: Any, where: str, skip: tuple[str, ...] = ()) -> None:
    """Check ``values`` against the keyword arguments of ``fn`` (a callable or a Signature):
    unknown keys are errors, and annotated arguments get their type checked."""
    if isinstance(fn, inspect.Signature):
        sig = fn
    else:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return  # a builtin without a signature: nothing to check
    params = sig.parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = [n for n in params if n not in skip]
    for key, value in values.items():
        if key.startswith("_") or key in skip:
            continue
        if key not in params:
            if open_ended:
                continue
            raise ConfigError(f"unknown key {where}.{key}" + _suggest(key, names, f"{where}.") + f" (valid keys: {', '.join(names)})")
        annotation = params[key].annotation
        if annotation is not inspect.Parameter.empty and not isinstance(annotation, str):
            values[key] = coerce(value, annotation, f"{where}.{key}")


def _validate_model(node: Any) -> dict[str, Any]:
    if not isinstance(node, dict) or not node:
        raise ConfigError(
            "the config has no model: set model.name (one of kiln's registered models, "
            "e.g. model.name=vit) or a model._target_ to build"
        )
    node = dict(node)
    target = node.get("_target_")
    if target is not None and not isinstance(target, str):
        raise ConfigError(f"model._target_ must be a dotted import path string, got {target!r}")
    try:
        fn = None if target is None else locate(target)
    except ImportError as exc:
        raise ConfigError(f"model._target_={target!r} cannot be imported: {exc}") from exc
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
    _check_signature(node, fn, "model")
    return node


def _validate_data(values: dict[str, Any]) -> dict[str, Any]:
    from kiln.data import dataset_signature, list_datasets

    name = values["name"]
    if name not in list_datasets():
        raise ConfigError(f"unknown data set {name!r} in data.name" + _suggest(name, list_datasets(), "") + f" (available: {', '.join(list_datasets())})")
    _check_signature(values["args"], dataset_signature(name), "data.args", skip=("seed",))
    return values


def _validate_optim(values: dict[str, Any]) -> dict[str, Any]:
    """optim.name names one of kiln's optimizers, and every optimizer-specific key set (not
    left at its default) is one that optimizer takes: the classes declare both."""
    from kiln.config._schema import OptimConfig
    from kiln.optim import OPTIMIZERS

    name = values["name"]
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r} in optim.name" + _suggest(name, OPTIMIZERS, "")
                          + f" (kiln's optimizers: {', '.join(OPTIMIZERS)})")
    cls = OPTIMIZERS[name]
    specific = {key for other in OPTIMIZERS.values() for key in other.config_options}
    defaults = {f.name: f.default for f in dataclasses.fields(OptimConfig)}
    for key in sorted(specific - set(cls.config_options)):
        if values[key] != defaults[key]:
            raise ConfigError(f"optim.{key}={values[key]!r} is not an option of {name} (it takes "
                              f"{', '.join(cls.config_options)}); remove it, or choose an optimizer that "
                              f"takes it ({', '.join(n for n, c in OPTIMIZERS.items() if key in c.config_options)})")
    return values


def _validate_cross(cfg: dict[str, Any]) -> None:
    """Checks that need more than one key."""
    train, data = cfg["train"], cfg["data"]
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
        allowed = ("eval_loss", "eval_accuracy")
        if stopping["metric"] not in allowed:
            raise ConfigError(f"train.early_stopping.metric={stopping['metric']!r} is not an eval metric"
                              + _suggest(stopping["metric"], allowed, "") + f" (choose from {', '.join(allowed)})")
        if stopping["patience"] < 1:
            raise ConfigError(f"train.early_stopping.patience={stopping['patience']} must be at least 1")
    if "tensorboard" in train["loggers"]:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("train.loggers includes tensorboard, but the tensorboard package is not installed; "
                              "pip install 'kiln[tensorboard]' or remove it from train.loggers")
    if train["precision"] == "bf16-true" and not cfg["optim"]["contiguous"]:
        raise ConfigError("train.precision=bf16-true keeps its fp32 master weights in kiln's arena; "
                          "set optim.contiguous=true (or use train.precision=bf16-mixed)")
    if train["precision"] == "bf16-true" and cfg["parallel"]["zero"] == 3:
        raise ConfigError("train.precision=bf16-true keeps its fp32 master weights in kiln's flat arena, which "
                          "FSDP2 (parallel.zero=3) replaces by per-parameter shards; use parallel.zero=1 or 2, "
                          "or train.precision=bf16-mixed")
    if cfg["parallel"]["zero"] in (1, 2) and not cfg["optim"]["contiguous"]:
        raise ConfigError(f"parallel.zero={cfg['parallel']['zero']} shards kiln's arena; set optim.contiguous=true")
    if train["keep_checkpoints"] < 1:
        raise ConfigError(f"train.keep_checkpoints={train['keep_checkpoints']} must be at least 1")
    if cfg["optim"]["lr"] <= 0:
        raise ConfigError(f"optim.lr={cfg['optim']['lr']} must be positive")
    dp = cfg["parallel"]["dp"]
    if dp is not None and dp < 1:
        raise ConfigError(f"parallel.dp={dp} must be at least 1")
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
        out[name] = coerce_dataclass(given, cls, name)
    _validate_data(out["data"])
    _validate_optim(out["optim"])
    _validate_cross(out)
    return out


def load_config(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> Any:
    """Read ``path`` (.py or .yaml), apply ``overrides`` and validate: returns a DictConfig.

    Raises ConfigError, whose message names the key, the problem and the fix.
    """
    from omegaconf import OmegaConf

    tree = _read_file(Path(path))
    for key, value in _parse_overrides(overrides):
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
