"""Moved to `tfpar.offload.master`; this alias keeps the old path."""

from tfpar.offload.master import (  # noqa: F401
    MASTER_PATCHES,
    OPTION,
    ComputeCopy,
    check,
    compute_cast,
    install,
    keeps_compute_copy,
    to_compute_copy,
)
