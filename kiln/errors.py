"""The errors kiln raises for what a user can fix, in a leaf module every layer may import.

``kiln train`` prints either as one line, ``kiln: error: ...``, and exits with code 2.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError"]


class ConfigError(ValueError):
    """A config that cannot be used: the message names the key, the problem and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it and what to do."""
