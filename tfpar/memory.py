"""Moved to `tfpar.reports.memory`; its rows and buffer accounting to `tfpar.reports.buffers`."""

from tfpar.reports.buffers import (  # noqa: F401
    KINDS,
    MemoryReport,
    batch_bytes,
    buffer_interval,
    device_memory,
    host_update_memory,
    layer_scope,
    live_bytes,
    readers_of,
    run_order,
    saved_gathered,
)
from tfpar.reports.memory import memory_report  # noqa: F401
from tfpar.reports.program import output_size  # noqa: F401
