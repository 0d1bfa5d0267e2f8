"""Moved to `tfpar.reports.visualize`; this alias keeps the old path."""

from tfpar.reports.visualize import (  # noqa: F401
    SummaryRows,
    layout_grid,
    summary,
    visualize_layout,
)
