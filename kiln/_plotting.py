"""matplotlib for kiln's pictures, imported only when a picture is drawn (it is slow to import).

Figures are made without ``matplotlib.pyplot``, whose backend machinery takes as long to import
again as matplotlib itself: a :class:`~matplotlib.figure.Figure` saves itself to a file through
the Agg canvas, no display needed, and nothing global is left to close.
"""

from __future__ import annotations

from typing import Any


def subplots(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """``(figure, axes)`` as ``pyplot.subplots`` returns them (``figsize`` goes to the figure,
    the rest to :meth:`Figure.subplots`)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=kwargs.pop("figsize", None))
    return fig, fig.subplots(nrows, ncols, **kwargs)
