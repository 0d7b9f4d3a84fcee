"""``python -m gpu_runtime.proc.watched --parent-pid P -- CMD ...``: run CMD, and end it when
process P is gone. For binaries that cannot watch their parent themselves (torchft's
lighthouse, a Rust binary) when PR_SET_PDEATHSIG does not fit: that signal fires when the
*thread* that started the child exits, and a trainer starts children from short-lived RPC
threads. Exits with CMD's code; SIGTERM is passed on to CMD."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

from gpu_runtime.proc.processes import pid_alive


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--poll-s", type=float, default=0.5)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command after --")
    child = subprocess.Popen(cmd)
    signal.signal(signal.SIGTERM, lambda s, f: child.terminate())
    while child.poll() is None:
        if not pid_alive(args.parent_pid):
            child.kill()
            child.wait()
            return 3
        time.sleep(args.poll_s)
    return int(child.returncode)


if __name__ == "__main__":
    sys.exit(main())
