"""Imports ``spec`` in a fresh process and fails when that loaded torch or another package
of the project (workflow code imports ``spec`` in the sandbox):
``tests/unit/test_spec.py::test_spec_loads_without_torch_or_the_other_packages``
(``python -m tests.scripts.spec_alone``)."""

from __future__ import annotations

import sys

OTHERS = ("torch", "gpu_runtime", "workflows", "activities", "workers", "milestone_cli")


def main() -> None:
    import spec.run  # noqa: F401
    import spec.status  # noqa: F401
    import spec.trainer_rpc  # noqa: F401

    bad = sorted(m for m in sys.modules if m.split(".")[0] in OTHERS)
    assert not bad, bad


if __name__ == "__main__":
    main()
