"""leangrad_bench: leangrad's experiments, apart from the library a user imports — named
benchmark suites (data), their runner, the papers' reproductions, the zoo's PyTorch
recipes, the demo and the report. ``leangrad demo``, ``bench`` and ``report`` run it;
installed from the repository (``pip install -e benchmarks``), not with ``leangrad``."""

from ._demo import run_demo
from ._report import render_report
from ._reproduction import reproduction_markdown
from ._run import run_suite, timing_threads
from ._runner import RECORD_FIELDS, EngineSpec, Record, machine_info, measure_config, new_record
from ._suites import RunSettings, Suite, list_suites, load_suite
from ._workloads import Workload, build
from ._zoo_report import wins_table, zoo_headline

__all__ = [
    "RECORD_FIELDS",
    "EngineSpec",
    "Record",
    "RunSettings",
    "Suite",
    "Workload",
    "build",
    "list_suites",
    "load_suite",
    "machine_info",
    "measure_config",
    "new_record",
    "render_report",
    "reproduction_markdown",
    "run_demo",
    "run_suite",
    "timing_threads",
    "wins_table",
    "zoo_headline",
]
