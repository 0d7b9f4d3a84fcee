from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYTHONPATH", str(ROOT))

from tests.stack import Stack  # noqa: E402


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture
def stack_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """Temporal dev server + control worker + one CPU node agent, all real processes."""
    s = Stack(tmp_path)
    try:
        s.start()
        yield s
    finally:
        s.stop()
