"""A small on-disk cache of what kiln measured about this machine (a matmul's peak FLOP/s,
train.precision=auto's timings of a model), so that a second run does not measure again.

One JSON file per kind under ``$KILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln``, else
``~/.cache/kiln``. Entries are keyed by the caller (the key names the machine and what was
measured); a file that cannot be read or written is no error: the caller measures again.

    >>> put("example", "key", {"value": 1.0}); get("example", "key")
    {'value': 1.0}
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

CACHE_ENV = "KILN_CACHE_DIR"


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"


def _file(kind: str) -> Path:
    return cache_dir() / f"{kind}.json"


def _read(kind: str) -> dict[str, Any]:
    try:
        data = json.loads(_file(kind).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def get(kind: str, key: str) -> Any:
    """The entry stored under ``key`` in the ``kind`` cache, or None."""
    return _read(kind).get(key)


def put(kind: str, key: str, value: Any) -> None:
    """Store ``value`` (JSON) under ``key``; written whole to a temporary file and renamed, so
    that two processes writing at once leave one of their files, never a torn one."""
    path = _file(kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(kind)
        data[key] = value
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{kind}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the next run measures again
