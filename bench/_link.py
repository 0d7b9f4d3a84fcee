"""Link measurements run inside one host of the multi-host bed (``bench.bench_multi_host``):

    python -m bench._link serve HOST PORT NBYTES     # send NBYTES to the first client, then exit
    python -m bench._link recv HOST PORT NBYTES      # print the seconds NBYTES took to arrive
    python -m bench._link pull URL RUN VERSION CHECKSUM DST   # one pull_version; print its stats (JSON)

The sender and receiver are ``bench.bench_weight_pull``'s, so the bed's numbers and that
bench's loopback numbers measure the same code.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from bench.bench_weight_pull import measure_pull, measure_raw_tcp, send_to_first_client
from gpu_runtime.proc.auth import engine_token


def serve(host: str, port: int, nbytes: int) -> None:
    srv = socket.create_server((host, port))
    print("listening", flush=True)
    send_to_first_client(srv, nbytes)


def main(argv: list[str]) -> None:
    cmd, *args = argv
    if cmd == "serve":
        serve(args[0], int(args[1]), int(args[2]))
    elif cmd == "recv":
        print(json.dumps({"seconds": measure_raw_tcp(args[0], int(args[2]), port=int(args[1]))}))
    elif cmd == "pull":
        url, run_id, version, checksum, dst = args
        stats = measure_pull(url, run_id, int(version), checksum, Path(dst), token=engine_token())
        print(json.dumps({"bytes": stats.bytes, "seconds": stats.seconds}))
    else:
        raise SystemExit(f"unknown command {cmd!r}: serve, recv or pull")


if __name__ == "__main__":
    main(sys.argv[1:])
