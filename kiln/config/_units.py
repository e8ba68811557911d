"""Memory sizes as people write them (``8GB``, ``512MiB``): one parser for the config's
``train.memory_budget``, ``kiln plan`` and ``kiln tune --memory-budget``."""

from __future__ import annotations

__all__ = ["parse_size"]

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``8GB``, ``512MiB``, ``1.5G`` or ``1000000`` (units are powers of
    1024, as memory is sold and reported); ValueError naming the forms it takes."""
    import re

    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = found.group(2).upper() if found else None
    if not found or unit not in _UNITS or float(found.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 8GB, 512MB or 1.5GiB")
    return int(float(found.group(1)) * _UNITS[unit])
