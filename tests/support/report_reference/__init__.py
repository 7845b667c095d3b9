"""The report as it was before issue 16, frozen: the oracle the new streaming path is compared with.

`tests/test_report_engine.py` checks that the new path's JSON equals this one's (to the nanosecond:
the new path computes seconds from integer nanoseconds, this one summed floats), and
`benchmarks/report.py` times both in one run. Not maintained beyond that: never import it from
`llmspans`.
"""

from tests.support.report_reference.analysis import Report, analyse
from tests.support.report_reference.input import Loaded, read_files

__all__ = ["Loaded", "Report", "analyse", "read_files"]
