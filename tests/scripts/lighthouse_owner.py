"""A lighthouse's owner: starts one, prints its pid and sleeps until it is killed.
``tests/integration/test_dp_cells.py::test_a_lighthouse_ends_with_the_trainer_that_started_it``
SIGKILLs this process (``python -m tests.scripts.lighthouse_owner <log file>``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from gpu_runtime.trainer.dp.lighthouse import Lighthouse


def main(argv: list[str]) -> None:
    lighthouse = Lighthouse(Path(argv[0]))
    lighthouse.start()
    print(lighthouse.pid, flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1:])
