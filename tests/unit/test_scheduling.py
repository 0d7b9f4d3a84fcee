"""The xdist units of work of ``make test`` (tests/scheduling.py): the fault modules of
tests/e2e stay together on one worker; the modules listed fault-free really are."""

from __future__ import annotations

from pathlib import Path

from tests.scheduling import AGENT_E2E, FAULT_FREE_E2E, OWN_STACK_E2E, VLLM, scope_of

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ("os.kill", "SIGKILL", "SIGSTOP", "MILESTONE_FAULT_", "running_stack(", "module_stack_fixtures", "kill_")


def test_fault_modules_share_one_unit_and_other_modules_are_their_own() -> None:
    assert scope_of("tests/e2e/test_process_faults.py::test_x") == scope_of("tests/e2e/test_fencing.py::test_y[a]")
    assert scope_of("tests/e2e/test_rl_run.py::test_x") == scope_of("tests/e2e/test_fork.py::test_y")
    assert scope_of("tests/e2e/test_rl_run.py::test_x") != scope_of("tests/e2e/test_process_faults.py::test_x")
    assert scope_of("tests/unit/test_ppo.py::test_x") == "tests/unit/test_ppo.py"


def test_the_fault_free_e2e_modules_exist_inject_nothing_and_start_no_stack() -> None:
    for module in sorted(FAULT_FREE_E2E):
        source = (ROOT / module).read_text()
        found = [f for f in FAULTS if f in source]
        assert not found, f"{module} is scheduled as fault-free but uses {found}"


def test_an_own_stack_module_is_a_unit_of_its_own_and_injects_nothing() -> None:
    stack_of_its_own = ("running_stack(", "module_stack_fixtures")
    for module in sorted(OWN_STACK_E2E):
        assert scope_of(f"{module}::test_x") == module
        assert module not in FAULT_FREE_E2E
        source = (ROOT / module).read_text()
        assert any(f in source for f in stack_of_its_own), f"{module} starts no stack of its own"
        found = [f for f in FAULTS if f in source and f not in stack_of_its_own]
        assert not found, f"{module} is scheduled as fault-free but uses {found}"


def test_the_vllm_modules_are_one_unit_and_carry_the_marker() -> None:
    """Their worker waits once for .venv-vllm's background install (tests/vllm_env.py)."""
    assert scope_of("tests/integration/test_engine_vllm.py::test_x") == scope_of("tests/e2e/test_vllm_run.py::test_y")
    assert scope_of("tests/e2e/test_vllm_run.py::test_y") != scope_of("tests/e2e/test_process_faults.py::test_x")
    for module in sorted(VLLM):
        source = (ROOT / module).read_text()
        assert "pytest.mark.vllm" in source and "vllm_interpreter()" in source, module


def test_the_agent_e2e_modules_are_one_unit_off_the_fault_worker() -> None:
    units = {scope_of(f"{m}::test_x") for m in AGENT_E2E}
    assert units == {"tests/e2e (agents)"}
    assert scope_of("tests/e2e/test_openai_agent.py::test_x") != scope_of("tests/e2e/test_process_faults.py::test_x")
    for module in AGENT_E2E:
        assert (Path(__file__).resolve().parents[2] / module).exists(), module
