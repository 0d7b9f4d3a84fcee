"""How ``pytest -n N`` (``make test``) spreads the tests over its xdist workers.

Every e2e module goes to one worker, as one unit of work, so the e2e modules run one after
another in collection order (a fault test times a kill against a phase of a run; two runs
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


class E2EOnOneWorker(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return "tests/e2e" if nodeid.startswith(E2E_PREFIX) else nodeid.split("::", 1)[0]
