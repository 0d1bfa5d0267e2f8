"""Text and PNG (Gantt chart) renderings of a simulated pipeline timeline.

A timeline is a list of `(stage, kind, microbatch, start, end[, chunk])`
records, as returned by `Schedule.simulate` (`TimelineEntry` named tuples);
plain tuples or any object with those attributes work too. An interleaved
schedule's chunk c > 0 is labelled "F3.c" (micro-batch 3, chunk c).

Example:

>>> from tfpar.pipeline import gpipe
>>> print(format_timeline(gpipe(2, 2).simulate(1, 1)))
stage 0 |F0 F1 ......B0 B1
stage 1 |...F0 F1 B0 B1 ...
(one column block = 1 time unit; F = forward, B = backward, . = idle; bubble 33.3%)
"""

from tfpar.pipeline.schedules import TimelineEntry, _as_tuple, bubble_fraction

__all__ = ["format_timeline", "plot_schedule"]

FORWARD_COLOR = "#4C72B0"   # blue
BACKWARD_COLOR = "#DD8452"  # orange
WEIGHT_COLOR = "#55A868"    # green: the W of a split backward


def _entries(timeline):
    return [TimelineEntry(*_as_tuple(e)) for e in timeline]


def _label(entry):
    """"3" for micro-batch 3; "3.1" for its pass through chunk 1."""
    return f"{entry.microbatch}.{entry.chunk}" if entry.chunk else str(
        entry.microbatch)


def format_timeline(timeline):
    """Renders a timeline as text, one row per stage (stage 0 on top).

    Time is cut into blocks of the shortest action's duration; each block is
    as wide as the longest label ("F12", "B3"), so a forward of one time unit
    shows as "F0 " and a backward twice as long as "B0    ". Idle time is
    drawn with dots. Durations that are not multiples of the shortest one are
    rounded to whole columns.

    Args:
        timeline: `(stage, kind, microbatch, start, end)` records.

    Returns:
        The rendering, ending with a legend line that gives the bubble.

    Example:

    >>> print(format_timeline([(0, "F", 0, 0, 1), (0, "B", 0, 1, 3)]))
    stage 0 |F0 B0
    (one column block = 1 time unit; F = forward, B = backward, . = idle; bubble 0.0%)
    """
    entries = _entries(timeline)
    if not entries:
        return "(empty timeline)"
    p = 1 + max(e.stage for e in entries)
    t0 = min(e.start for e in entries)
    unit = min((e.end - e.start for e in entries if e.end > e.start),
               default=1)
    # Block width: longest label plus one space of separation.
    block = 1 + max(len(e.kind + _label(e)) for e in entries)

    def column(t):
        return int(round((t - t0) / unit * block))

    width = max(column(e.end) for e in entries)
    rows = [["."] * width for _ in range(p)]
    for e in entries:
        c0, c1 = column(e.start), column(e.end)
        text = (e.kind + _label(e)).ljust(c1 - c0)[: max(c1 - c0, 0)]
        rows[e.stage][c0:c1] = list(text)
    label = len(str(p - 1))
    lines = [(f"stage {s:>{label}} |" + "".join(row)).rstrip()
             for s, row in enumerate(rows)]
    lines.append(
        f"(one column block = {unit:g} time unit"
        f"{'' if unit == 1 else 's'}; F = forward, B = backward, "
        + ("W = weight gradient, " if any(e.kind == "W" for e in entries)
           else "") + ". = idle; "
        f"bubble {100 * bubble_fraction(entries):.1f}%)")
    return "\n".join(lines)


def plot_schedule(timeline, path, title=None):
    """Saves a timeline as a PNG Gantt chart.

    One row per stage, stage 0 on top; forwards in blue, backwards in orange,
    each box labelled with its micro-batch number. Uses matplotlib's
    object-oriented API (no pyplot global state), so it is safe in scripts
    and tests.

    Args:
        timeline: `(stage, kind, microbatch, start, end)` records, e.g. from
            `Schedule.simulate`.
        path: File path (or binary file object) to write the PNG to.
        title: Chart title; defaults to one giving the bubble fraction.

    Returns:
        `path`.

    Raises:
        ImportError: If matplotlib is not installed.

    Example:

    >>> from tfpar.pipeline import one_f_one_b
    >>> import tempfile, os
    >>> png = os.path.join(tempfile.mkdtemp(), "1f1b.png")
    >>> plot_schedule(one_f_one_b(4, 8).simulate(), png) == png
    True
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError(
            "plot_schedule() draws the PNG with matplotlib, which is not "
            "installed: pip install matplotlib (or pip install "
            f"'tfpar[viz]'). Received: path={path!r}") from None

    entries = _entries(timeline)
    p = 1 + max((e.stage for e in entries), default=0)
    t0 = min((e.start for e in entries), default=0)
    t1 = max((e.end for e in entries), default=1)
    span = max(t1 - t0, 1e-12)
    fig_width = min(24.0, max(6.0, 0.35 * len(entries) / p + 3))
    figure = Figure(figsize=(fig_width, 1.0 + 0.6 * p))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    colors = {"F": FORWARD_COLOR, "B": BACKWARD_COLOR, "W": WEIGHT_COLOR}
    for e in entries:
        y = p - 1 - e.stage            # stage 0 is the top row
        axes.broken_barh([(e.start, e.end - e.start)], (y - 0.4, 0.8),
                         facecolors=colors.get(e.kind, "grey"),
                         edgecolor="black", linewidth=0.6)
        # Fit the label in the box: box width in points is its share of the
        # (about 75% of figure width) plot area times 72 points per inch; a
        # digit is about 0.6 font sizes wide.
        box_points = (e.end - e.start) / span * 0.75 * fig_width * 72
        size = max(4.0, min(10.0, box_points / (0.6 * len(_label(e)) + 0.6)))
        axes.text((e.start + e.end) / 2, y, _label(e),
                  ha="center", va="center", fontsize=size, color="white")
    axes.set_yticks(range(p))
    axes.set_yticklabels([f"stage {p - 1 - y}" for y in range(p)])
    axes.set_ylim(-0.6, p - 0.4)
    axes.set_xlim(t0, t1)
    axes.set_xlabel("time")
    if title is None:
        title = f"pipeline timeline, bubble {100 * bubble_fraction(entries):.1f}%"
    axes.set_title(title)
    handles = [Patch(facecolor=FORWARD_COLOR, label="forward"),
               Patch(facecolor=BACKWARD_COLOR, label="backward")]
    if any(e.kind == "W" for e in entries):
        handles.append(Patch(facecolor=WEIGHT_COLOR, label="weight grad"))
    axes.legend(handles=handles,
                loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes.grid(axis="x", linestyle=":", linewidth=0.5)
    axes.set_axisbelow(True)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    return path

