"""Session fixtures of the e2e modules (which one xdist worker runs, one module at a time).

``plain_stack``: one stack for the whole session (Temporal dev server with its web UI,
control worker, one CPU node agent, no fault-injection env). Every module that injects no
process fault and needs no special agent env runs on it (as ``stack``), so it is started
once instead of once per module; their run ids differ, and each keeps its own store or
run-id prefix. Modules that kill or stop processes, or need fault-injection delays or
extra nodes, start their own.

``baselines``: the fault-free reference runs, one per distinct config, on the plain stack.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.faults import Baselines
from tests.stack import Stack, running_stack


@pytest.fixture(scope="session")
def plain_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("plain"), ui=True) as s:
        yield s


@pytest.fixture(scope="session")
def stack(plain_stack: Stack) -> Stack:
    """The plain stack, for modules that take a ``stack`` and define none of their own."""
    return plain_stack


@pytest.fixture(scope="session")
def baselines(plain_stack: Stack) -> Baselines:
    return Baselines(plain_stack)
