"""What an import failure says about the environment, in one line: the problem and the fix.

A broken environment surfaces far from its cause. With ``timm`` installed beside a CPU torch,
the only torchvision wheel the index had for torch 2.13 was a CUDA build; importing it fails
with "operator torchvision::nms does not exist", and transformers, which imports torchvision
when it is installed, then reports only "Could not import module 'GPT2LMHeadModel'". The cause
is in the exception's chain (``__cause__``/``__context__``); :func:`import_diagnosis` reads
it. ``kiln doctor`` and ``kiln train`` (a model's import, in kiln.config and kiln.train) both
say the same line through it.

    >>> try:
    ...     try:
    ...         raise RuntimeError("operator torchvision::nms does not exist")
    ...     except RuntimeError as e:
    ...         raise ModuleNotFoundError("Could not import module 'GPT2LMHeadModel'") from e
    ... except ImportError as exc:
    ...     print(import_diagnosis(exc).problem.startswith("torchvision does not match torch"))
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["EXTRAS", "Diagnosis", "import_diagnosis", "package_version"]

# the optional packages kiln uses, and what installs each
EXTRAS = {"transformers": "kiln[hf]", "safetensors": "kiln[hf]", "datasets": "datasets",
          "tensorboard": "kiln[tensorboard]", "wandb": "kiln[wandb]", "mlflow": "kiln[mlflow]",
          "accelerate": "kiln[bench]", "torchao": "kiln[fp8]"}

_MISSING_OPERATOR = re.compile(r"operator (\w+)::(\w+) does not exist")
_UNDEFINED_SYMBOL = re.compile(r"site-packages/(\w+)/\S*\.so\S*: undefined symbol")
_TRANSFORMERS_OBJECT = re.compile(r"Could not import module '(\w+)'")


@dataclass(frozen=True)
class Diagnosis:
    """What is wrong (``problem``) and what to do about it (``fix``)."""

    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.problem}; fix: {self.fix}"


def package_version(name: str) -> str | None:
    """The installed distribution's version, or None where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _torch() -> str:
    import torch

    return torch.__version__


def import_diagnosis(exc: BaseException) -> Diagnosis | None:
    """The environment problem behind ``exc`` (an import that failed, as raised or wrapped),
    or None where its chain names none that kiln knows:

    - a package whose compiled operators do not match torch (``operator torchvision::nms does
      not exist``, an ``undefined symbol`` in a package's extension);
    - one of kiln's optional packages not installed (``No module named 'transformers'``);
    - transformers unable to import a model class, with the underlying error named.
    """
    chain = _chain(exc)
    for err in reversed(chain):  # the innermost first: its message is the error itself, unwrapped
        text = str(err)
        found = _MISSING_OPERATOR.search(text) or _UNDEFINED_SYMBOL.search(text)
        if found:
            return _mismatched(found.group(1), text)
    for err in chain:
        missing = getattr(err, "name", None) if isinstance(err, ModuleNotFoundError) else None
        top = (missing or "").partition(".")[0]
        if top in EXTRAS:
            return Diagnosis(f"{top} is not installed", f"pip install '{EXTRAS[top]}'")
    objects = [m.group(1) for m in map(_TRANSFORMERS_OBJECT.search, map(str, chain)) if m]
    if objects:
        root = chain[-1]
        cause = f"{type(root).__name__}: {str(root).strip().splitlines()[0]}" if root is not chain[0] else \
            "transformers hides the original error"
        return Diagnosis(
            f"transformers {package_version('transformers')} cannot import {objects[0]} ({cause})",
            "python -c 'import transformers.utils.logging as l; l.set_verbosity_debug(); from transformers import "
            f"{objects[0]}' shows the original error; reinstall what it names for torch {_torch()}")
    return None


def _mismatched(package: str, text: str) -> Diagnosis:
    """``package``'s compiled part was built for another torch than the one installed."""
    first = text.strip().splitlines()[0]
    version = package_version(package)
    named = f"{package} {version}" if version else package
    return Diagnosis(
        f"{named} does not match torch {_torch()}: importing it fails with \"{first}\"",
        f"pip uninstall {package} (kiln does not need it; transformers imports it whenever it is installed), or "
        f"install the {package} release built for torch {_torch()} (its paired version, the same CPU or CUDA build)")
