"""The errors and warnings kiln raises for what a user can fix, in a leaf module every layer may
import.

``kiln train`` prints either error as one line, ``kiln: error: ...``, and exits with code 2.
Under the ``kiln`` command (:func:`one_line_warnings`) a :class:`KilnWarning` shows as one
line too, ``kiln: warning: ...``; it stays a real warning that filters silence or make an error.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import warnings
from typing import Any, Iterable, Iterator

__all__ = ["CheckpointError", "ConfigError", "KilnWarning", "SHOWN_WARNINGS_ENV", "did_you_mean",
           "one_line_warnings", "shown_warnings"]

# the kiln warnings a launcher showed already, which its ranks do not show again (JSON, a list)
SHOWN_WARNINGS_ENV = "KILN_SHOWN_WARNINGS"


def did_you_mean(word: Any, choices: Iterable[Any], *, prefix: str = "", quote: bool = True) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``word`` (``prefix`` before it, quoted
    with ``quote``), or ``""`` where none is close: the hint every "unknown name" error carries.

    >>> did_you_mean("adamw2", ["adamw", "lamb"]), did_you_mean("lr", ["betas"])
    ("; did you mean 'adamw'?", '')
    """
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    if not close:
        return ""
    return f"; did you mean {prefix}{close[0]!r}?" if quote else f"; did you mean {prefix}{close[0]}?"


class ConfigError(ValueError):
    """A config that cannot be used: the message names the key, the problem and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it and what to do."""


class KilnWarning(UserWarning):
    """Something kiln does that the user may want to change (the message names what and how); a
    UserWarning, so that a filter of those (``-W ignore::UserWarning``) holds for kiln's too."""


_shown: set[str] = set()  # the kiln warnings this process has displayed


def _one_line(message: Any) -> str:
    text = " ".join(str(message).split())
    # A repeat (said at another line of kiln), or any rank but 0 of a torchrun group (every rank
    # builds the same run and would say the same): nothing, which the warnings machinery writes.
    if text in _shown or os.environ.get("RANK", "0") != "0":
        return ""
    _shown.add(text)
    return f"kiln: warning: {text}\n"


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Within it, each :class:`KilnWarning` displays as ``kiln: warning: MESSAGE``: one line,
    without the file, line number and source line of Python's format, each text once per process,
    on rank 0 alone under torchrun. Only the display changes: the warning is issued as ever, so
    ``-W``, ``PYTHONWARNINGS`` and ``warnings.filterwarnings`` still silence it or raise it, and
    ``warnings.catch_warnings(record=True)`` still records it. Other warnings display as before.
    What ``KILN_SHOWN_WARNINGS`` lists (a launcher's :func:`shown_warnings`) counts as shown."""
    _shown.update(json.loads(os.environ.get(SHOWN_WARNINGS_ENV) or "[]"))
    previous = warnings.formatwarning

    def formatwarning(message: Any, category: type[Warning], filename: str, lineno: int,
                      line: str | None = None) -> str:
        if issubclass(category, KilnWarning):
            return _one_line(message)
        return previous(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        warnings.formatwarning = previous


def shown_warnings() -> str:
    """The kiln warnings this process has shown, as ``KILN_SHOWN_WARNINGS`` takes them."""
    return json.dumps(sorted(_shown))
