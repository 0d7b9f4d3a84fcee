"""``python -m gpu_runtime.engine.keyed_launch MODULE ARGS``: run ``python -m MODULE ARGS
--api-key $MILESTONE_ENGINE_TOKEN`` without the key on the command line.

sglang-router and SGLang take their API key only as ``--api-key KEY``; on a command
line it is readable by every local user (``ps``, ``/proc/<pid>/cmdline``). This entry
point appends it to ``sys.argv`` inside the process, which ``/proc`` does not show, and
runs the module as ``__main__``. Without a token it runs the module unchanged.
"""

from __future__ import annotations

import runpy
import sys

from gpu_runtime.engine.auth import engine_token


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m gpu_runtime.engine.keyed_launch MODULE [ARGS...]")
    module, args = sys.argv[1], sys.argv[2:]
    token = engine_token()
    sys.argv = [module, *args, *(["--api-key", token] if token else [])]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
