"""matplotlib for kiln's pictures, imported only when a picture is drawn (it is slow to import).

Figures are made without ``matplotlib.pyplot``, whose backend machinery takes as long to import
again as matplotlib itself: a :class:`~matplotlib.figure.Figure` saves itself to a file through
the Agg canvas, no display needed, and nothing global is left to close. A log axis labels its
ticks in plain text (:func:`log_scale`): matplotlib's default writes them as TeX, whose parser
costs a large part of each picture (docs/lab/facts.md, 'Host time').
"""

from __future__ import annotations

from typing import Any


def subplots(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """``(figure, axes)`` as ``pyplot.subplots`` returns them (``figsize`` goes to the figure,
    the rest to :meth:`Figure.subplots`)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=kwargs.pop("figsize", None))
    return fig, fig.subplots(nrows, ncols, **kwargs)


def log_scale(axis: Any) -> None:
    """A log scale on ``axis`` (``ax.xaxis`` or ``ax.yaxis``), its ticks labelled as plain numbers
    (0.01, 2.5), the minor ticks too where the axis spans less than a couple of decades."""
    from matplotlib.ticker import LogFormatter

    getattr(axis.axes, f"set_{axis.axis_name}scale")("log")
    axis.set_major_formatter(LogFormatter())
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
