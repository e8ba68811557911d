"""``LazyCall``: describe a call in a config without making it (the LiBai/detectron2 idea).

    >>> from kiln.config import LazyCall as L
    >>> from kiln.models import create_model
    >>> node = L(create_model)(name="mlp", hidden=[32])
    >>> node["_target_"], node["name"]
    ('kiln.create_model', 'mlp')

The node is a plain dict, so it can be edited, overridden from the command line, saved as YAML
and instantiated later with ``kiln.config.instantiate``.

A target is named in one of two ways:

- a dotted path, ``package.module.function``, for anything importable by name;
- a file path, ``/abs/path/to/file.py:qualname``, for what is not: a function defined in a
  ``.py`` config itself, or in a module beside the config file. ``locate`` imports the file
  (its directory first on ``sys.path``, as when running it as a script), so a saved
  ``config.yaml`` rebuilds the same objects from any working directory.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from kiln.errors import ConfigError

# Modules kiln imports from a file under a name of its own (a .py config, a file target whose
# natural name is taken) start with this; ``target_path`` names their objects by file.
FILE_MODULE_PREFIX = "_kiln_file_"

# Directories kiln put on sys.path for users' code (config directories, file targets'): a
# module found only through one of them, or through the working directory, is named by file,
# since neither is on sys.path when the saved config is loaded elsewhere.
_USER_DIRS: set[str] = set()


class InstantiateError(RuntimeError):
    """A target's call failed while building a config node; the message names the target and
    the key, the original exception is the cause (``__cause__``)."""


def add_user_dir(directory: str | os.PathLike[str]) -> str:
    """Put ``directory`` first on ``sys.path`` (unless it is already there) and remember it
    as a directory of users' code. Returns it as an absolute path."""
    directory = os.path.realpath(directory)
    _USER_DIRS.add(directory)
    if not any(_same_dir(p, directory) for p in sys.path):
        sys.path.insert(0, directory)
    return directory


def _same_dir(entry: str, directory: str) -> bool:
    try:
        return os.path.realpath(entry or os.curdir) == directory
    except (TypeError, ValueError):  # a sys.path entry that is not a path (a zip importer's object)
        return False


def file_module_name(path: str | os.PathLike[str]) -> str:
    """The stable module name kiln gives ``path`` when importing it under a name of its own:
    the same file always gets the same name, two files never share one."""
    path = os.path.realpath(path)
    stem = re.sub(r"\W", "_", Path(path).stem)
    return f"{FILE_MODULE_PREFIX}{stem}_{hashlib.sha1(path.encode()).hexdigest()[:12]}"


# --------------------------------------------------------------------------- naming targets


def target_path(obj: Callable[..., Any]) -> str:
    """The path ``locate`` finds ``obj`` by: dotted (``kiln.create_model``, the shortest
    public one rather than ``kiln.models._registry.create_model``) when its module is
    importable by name; ``/abs/path/file.py:qualname`` when it is defined in a config file or
    a module importable only from the config's directory or the working directory."""
    name = getattr(obj, "__qualname__", None)
    module_name = getattr(obj, "__module__", None)
    if not isinstance(name, str) or not isinstance(module_name, str):
        raise TypeError(f"{obj!r} has no importable name; pass a function or a class to LazyCall")
    if "<" in name:  # <lambda>, <locals>: nothing can import it again
        raise TypeError(f"{module_name}.{name} cannot be imported by name; define the function or class "
                        "at the top level of the config file or of a module")
    module = sys.modules.get(module_name)
    if module is not None and _named_by_file(module):
        return f"{os.path.realpath(module.__file__)}:{name}"
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        try:
            found = importlib.import_module(candidate)
        except ImportError:
            continue
        if _getattr_path(found, name) is obj:
            return f"{candidate}.{name}"
    return f"{module_name}.{name}"


def _named_by_file(module: Any) -> bool:
    """Whether ``module``'s objects need a file target: it was loaded from a file, and its
    name does not find it again without the users' directories and the working directory."""
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return False
    name = module.__name__
    if name == "__main__" or name.startswith(FILE_MODULE_PREFIX):
        return True
    if name.partition(".")[0] == "kiln":  # kiln itself, even run from a checkout it is not installed from
        return False
    top = name.partition(".")[0]
    spec = _find_elsewhere(top)
    if spec is None:
        return True
    top_file = getattr(sys.modules.get(top), "__file__", None)
    if not isinstance(spec.origin, str) or not os.path.isabs(spec.origin) or not isinstance(top_file, str):
        return False  # a namespace package, a frozen or built-in module: found is found
    return os.path.realpath(spec.origin) != os.path.realpath(top_file)  # found, but another one


def _find_elsewhere(top: str) -> Any:
    """The spec ``import top`` finds with the users' directories and the working directory
    taken off sys.path (None: not found)."""
    hidden = _USER_DIRS | {os.path.realpath(os.getcwd())}
    path = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.curdir) not in hidden]
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(top, path) if finder is importlib.machinery.PathFinder else find(top, None)
        except Exception:  # noqa: BLE001  (a third-party finder failing is "not found" by it)
            spec = None
        if spec is not None:
            return spec
    return None


# --------------------------------------------------------------------------- finding targets


_HINT = ("name an importable 'package.module.function', or define the function in the config file or a "
         "module beside it")


def locate(path: str) -> Any:
    """The object at ``path``: dotted ``package.module.attr``, or ``/path/to/file.py:qualname``
    (the file is imported with its directory first on sys.path, reusing the module already
    imported from that file if there is one). Raises ImportError saying what is missing."""
    if not isinstance(path, str):
        raise ImportError(f"{path!r} is not an import path: {_HINT}")
    file, sep, qualname = path.rpartition(":")
    if sep and file.endswith(".py"):
        return _getattr_or_raise(_import_file(file), qualname, file)
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ImportError(f"{path!r} is not an import path: {_HINT}")
    error: ImportError | None = None
    for i in range(len(parts) - 1, 0, -1):  # the longest importable module, then attributes
        module_name = ".".join(parts[:i])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise ImportError(f"importing {module_name} failed: {exc}") from exc  # its own import
            error = error or exc
            continue
        except Exception as exc:  # the module raised while running: say which
            raise ImportError(f"importing {module_name} failed: {type(exc).__name__}: {exc}") from exc
        return _getattr_or_raise(module, ".".join(parts[i:]), module_name)
    raise ImportError(f"{error}; {_HINT}") from None


def _getattr_path(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _getattr_or_raise(module: Any, qualname: str, where: str) -> Any:
    obj = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{where} has no attribute {qualname!r}") from None
    return obj


# the module imported from each file (by real path): a config names its file's functions several
# times a run, and a scan of sys.modules (thousands) each time is slow (docs/lab/facts.md, 'Host time')
_FILE_MODULES: dict[str, Any] = {}


def _import_file(file: str) -> Any:
    """The module of ``file``: the one already imported from it, else imported now under its
    natural name where that is free (so the file's own neighbours, which import it by that
    name, share the module), else under ``file_module_name(file)``."""
    path = os.path.realpath(os.path.abspath(file))
    if not os.path.isfile(path):
        raise ImportError(f"the file {path} does not exist (moved or deleted?); restore it, or point the "
                          "target at where the code is now")
    known = _FILE_MODULES.get(path)
    if known is None or sys.modules.get(known.__name__) is not known:
        known = _FILE_MODULES[path] = _find_or_import(path)
    return known


def _find_or_import(path: str) -> Any:
    """:func:`_import_file`'s work for the real path ``path``, without its memo."""
    for module in list(sys.modules.values()):
        try:
            found = module.__file__
        except Exception:  # noqa: BLE001  (no file, or a lazy module that cannot say)
            continue
        # the basename first: realpath costs system calls, and sys.modules holds thousands
        if isinstance(found, str) and os.path.basename(found) == os.path.basename(path) \
                and os.path.realpath(found) == path:
            return module
    directory, root, dotted = _natural_name(path)
    add_user_dir(directory)
    if root != directory:
        add_user_dir(root)
    try:
        if dotted is not None:
            top = dotted.partition(".")[0]
            if top not in sys.modules:
                spec = importlib.machinery.PathFinder.find_spec(top, [root])
                if spec is not None:
                    _exec_new(top, spec)
            loaded = getattr(sys.modules.get(top), "__file__", None)
            if isinstance(loaded, str) and os.path.realpath(loaded) in (
                    os.path.join(root, top + ".py"), os.path.join(root, top, "__init__.py")):
                module = importlib.import_module(dotted)  # the package's own, or the file itself
                if os.path.realpath(getattr(module, "__file__", None) or "") == path:
                    return module
        name = file_module_name(path)
        return _exec_new(name, importlib.util.spec_from_file_location(name, path))
    except ImportError:
        raise
    except Exception as exc:  # the file raised while running: name it
        raise ImportError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc


def _natural_name(path: str) -> tuple[str, str, str | None]:
    """``(directory, root, dotted)``: the file's directory, the directory its package tree
    starts in (the same for a file outside a package), and the dotted name it is imported by
    from there (None when a part is no identifier)."""
    directory = os.path.dirname(path)
    parts = [Path(path).stem] if Path(path).stem != "__init__" else []
    root = directory
    while os.path.isfile(os.path.join(root, "__init__.py")):
        parts.insert(0, os.path.basename(root))
        root = os.path.dirname(root)
    if not parts or not all(p.isidentifier() for p in parts):
        return directory, root, None
    return directory, root, ".".join(parts)


def _exec_new(name: str, spec: Any) -> Any:
    """Create the module of ``spec`` as ``sys.modules[name]`` and run it (registered first, so
    dataclasses and pickling find it while it runs); removed again if it raises."""
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


# --------------------------------------------------------------------------- building


class LazyCall:
    """``LazyCall(f)(**kwargs)`` returns ``{"_target_": target_path(f), **kwargs}``."""

    def __init__(self, target: Callable[..., Any]):
        if not callable(target):
            raise TypeError(f"LazyCall needs a callable, got {target!r}")
        self._path = target_path(target)  # now, so a lambda fails at the line that passes it

    def __call__(self, **kwargs: Any) -> dict[str, Any]:
        return {"_target_": self._path, **kwargs}


def _plain(value: Any) -> Any:
    """omegaconf containers as dicts and lists (omegaconf is only imported if in use)."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is not None and isinstance(value, omegaconf.Container):
        return omegaconf.OmegaConf.to_container(value, resolve=True)
    return value


def instantiate(node: Any) -> Any:
    """Build what ``node`` describes, inside out: a dict with ``_target_`` is the call
    ``target(**kwargs)`` of its other keys, each built first; other dicts, lists and tuples
    are built item by item; anything else is returned as it is. ``node`` may be an omegaconf
    DictConfig or ListConfig. A call that raises becomes an InstantiateError naming the target
    (kiln's ConfigError passes through as it is).

        >>> instantiate({"_target_": "fractions.Fraction", "numerator": 3, "denominator": 6})
        Fraction(1, 2)
    """
    return _build(node, "")


def _build(value: Any, where: str) -> Any:
    value = _plain(value)
    if isinstance(value, dict):
        if "_target_" in value:
            return _call(value, where)
        return {k: _build(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_build(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def _kwargs(node: dict[str, Any], where: str) -> dict[str, Any]:
    return {k: _build(v, f"{where}.{k}" if where else k) for k, v in node.items() if k != "_target_"}


def _call(node: dict[str, Any], where: str) -> Any:
    target = node["_target_"]
    fn = locate(target)
    kwargs = _kwargs(node, where)
    try:
        return fn(**kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        at = f" (at {where})" if where else ""
        raise InstantiateError(f"building {target}{at} failed: {type(exc).__name__}: {exc}") from exc


def build_callable(node: Any) -> Any:
    """The callable a config key such as ``train.loss``, ``train.metrics.NAME`` or
    ``data.collate_fn`` names, to be called later with runtime arguments
    (``fn(outputs, batch)``, ``fn(samples)``):
    - None: None;
    - a callable: itself;
    - an import path (dotted or file) or a node ``{"_target_": path, **kwargs}``: a function
      target gives ``functools.partial(fn, **kwargs)`` (the function itself when there are no
      kwargs); a class target gives its instance, ``cls(**kwargs)``.

    kwargs are built with ``instantiate`` first.

        >>> close = build_callable({"_target_": "math.isclose", "abs_tol": 0.5})
        >>> close(1.0, 1.25), close(1.0, 2.0)
        (True, False)
    """
    node = _plain(node)
    if node is None:
        return None
    if isinstance(node, str):
        node = {"_target_": node}
    elif callable(node):
        return node
    if not isinstance(node, dict) or "_target_" not in node:
        raise TypeError(f"expected None, an import path or a {{'_target_': ...}} node, got {node!r}")
    fn = locate(node["_target_"])
    if inspect.isclass(fn):
        return _call(node, "")
    kwargs = _kwargs(node, "")
    return functools.partial(fn, **kwargs) if kwargs else fn


__all__ = ["InstantiateError", "LazyCall", "build_callable", "instantiate", "locate", "target_path"]
