from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYTHONPATH", str(ROOT))

from tests.scheduling import E2EOnOneWorker  # noqa: E402
from tests.stack import Stack  # noqa: E402
from xdist.remote import Producer  # noqa: E402


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# a test may skip only where it needs CUDA: marked ``gpu``, or a reason that names CUDA / a GPU
# ("needs CUDA", "this machine has CUDA", "... needs two GPUs"); any other skip fails the session
CUDA_REASON = re.compile(r"\bCUDA\b|\bGPUs?\b")
_unexpected_skips: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)  # before xdist's own default
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> E2EOnOneWorker | None:
    """``-n N`` (xdist's default ``--dist load``): the e2e modules one after another on one
    worker, the other modules spread over the rest (tests/scheduling.py)."""
    return E2EOnOneWorker(config, log) if config.getvalue("dist") == "load" else None


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)


def _note_skip(report: pytest.TestReport | pytest.CollectReport, gpu: bool) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not gpu and not CUDA_REASON.search(reason):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report, "gpu" in report.keywords)


def pytest_collectreport(report: pytest.CollectReport) -> None:  # a module-level skip
    _note_skip(report, False)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _unexpected_skips:
        terminalreporter.section("skipped without needing CUDA (this fails the session)", red=True)
        for line in _unexpected_skips:
            terminalreporter.line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Only a test that needs CUDA may skip: a dev dependency that failed to install, or a new
    skip of any other kind, fails the run loudly instead of passing with fewer tests."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller sees every report and decides
    if _unexpected_skips and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# on a failed test that used a stack, the WARNING/ERROR lines of its agents' logs go into the
# report: CI keeps only the printed output, and the logs are what says why a run failed
_LOG_LINES_PER_FILE = 40


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.passed or report.skipped:
        return
    stacks = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, Stack)]
    if not stacks:
        return
    stack = stacks[0]  # fixtures name it stack, engine_stack, proc_stack, ...
    for log in sorted((stack.workdir / "logs").glob("*.log")):
        lines = [ln for ln in log.read_text(errors="replace").splitlines()
                 if " WARNING " in ln or " ERROR " in ln or " CRITICAL " in ln]
        if lines:
            report.sections.append((f"stack log {log.name} (last warnings/errors)",
                                    "\n".join(ln[:400] for ln in lines[-_LOG_LINES_PER_FILE:])))
