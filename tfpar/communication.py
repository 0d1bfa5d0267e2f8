"""Moved to `tfpar.reports.communication`; the program reader to `tfpar.reports.program`."""

from tfpar.reports.communication import (  # noqa: F401
    CommunicationReport,
    capture,
    communication_report,
    megatron_tp_bytes,
    report_for_traced,
)
from tfpar.reports.program import (  # noqa: F401
    Collective,
    keras_program,
    keras_programs,
    program_for_traced,
    programs_for_traced,
)
