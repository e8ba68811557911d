"""matplotlib for kiln's pictures, imported only when a picture is drawn (it is slow to import)."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: files only, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
