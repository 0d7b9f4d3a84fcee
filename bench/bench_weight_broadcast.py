"""A policy version broadcast to rollout nodes' engines (``engines.weight_sync: distributed`` across
hosts) against the pull path and raw TCP on the same link.

Each row is the time until the version's tensors are in the receiving process's memory, on this
machine's loopback (or ``--host``), taking turns so the machine's drift falls on every row:

- ``raw TCP``: the version's byte count over one TCP stream (``bench_weight_pull.measure_raw_tcp``);
- ``broadcast to N``: the real cross-host protocol (``measure_broadcast``): a hosted rendezvous
  store (``group_rendezvous.HostedGroup``), N long-lived member processes (as engines are) that
  register, read the roster and join the gloo group at their ranks, and the trainer (rank 0, this process, a client of the
  store) sending its in-memory state in 4 MiB buckets (``DEFAULT_BUCKET_BYTES``); wall time from
  the store's opening to the last member holding every tensor. ``+ checksum``: plus the engine's
  ``weights_checksum`` of what it received (its gate before it loads);
- ``pull``: ``pull_version`` of the version folder from a ``WeightServer`` (manifest cached),
  written to disk and verified per tensor; ``pull + load``: then read back into memory as an
  engine's disk load does (``safetensors.load_file``); ``+ checksum``: plus the engine's hash of
  what it loaded (a torch engine reports the checksum of the weights it serves, however they came).

``--shape demo`` (examples/demo.yaml's model) or ``0.36b`` (Qwen2-0.5B's trunk). Medians over
``--repeats``. gloo's broadcast from one root sends every member its own copy, so ``broadcast
to 2`` moves twice the bytes of ``broadcast to 1``; the pull's per-node cost does not grow
with the engines of a node (they load one pulled folder). Not a test.

    .venv/bin/python -m bench.bench_weight_broadcast [--shape demo|0.36b] [--repeats 3] [--members 1,2] \
        [--host 127.0.0.1] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import load_file  # noqa: E402

from bench.bench_weight_pull import SHAPES, measure_pull, measure_raw_tcp, write_version_folder  # noqa: E402
from gpu_runtime.models.model_folder import WEIGHTS_FILE, weights_checksum  # noqa: E402
from gpu_runtime.weight_sync.distributed import (  # noqa: E402
    DEFAULT_BUCKET_BYTES,
    GroupSpec,
    WeightGroup,
    folder_manifest,
    manifest_from_request,
)
from gpu_runtime.weight_sync.group_rendezvous import HostedGroup, Rendezvous  # noqa: E402
from gpu_runtime.weight_sync.group_roster import Registration, plan_roster  # noqa: E402
from gpu_runtime.weight_sync.http_server import WeightServer  # noqa: E402

RUN_ID = "bench-broadcast"
TIMEOUT_S = 120.0


def _member(inbox: Any, out: Any) -> None:
    """A rollout node's engine, a long-lived process (as engines are): for each push from ``inbox``,
    register, join at its seat, receive, checksum; ``None`` ends it."""
    torch.set_num_threads(1)
    while (job := inbox.get()) is not None:
        host, port, name, node = job
        roster = Rendezvous(host, port, name, TIMEOUT_S).register(Registration(node=node, engines=1, devices=("cpu",)))
        rank = roster.seat(node)
        assert rank is not None, roster.why
        manifest = manifest_from_request({**roster.manifest, "bucket_bytes": roster.bucket_bytes})
        group = WeightGroup(GroupSpec(host, port, roster.world_size, name, roster.backend), rank, TIMEOUT_S)
        try:
            got = group.receive(manifest)
        finally:
            group.close()
        received = time.time()
        checksum = weights_checksum(got)
        out.put((node, received, time.time(), checksum))
        del got


class Members:
    """``n`` member processes, started once."""

    def __init__(self, n: int, ctx: mp.context.SpawnContext) -> None:
        self.out = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=_member, args=(q, self.out), daemon=True) for q in self.inboxes]
        for p in self.procs:
            p.start()

    def stop(self) -> None:
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)


def measure_broadcast(host: str, state: dict[str, torch.Tensor], folder: Path, members: Members,
                      n: int) -> tuple[float, float, str]:
    """One cross-host push of ``state`` (the version at ``folder``) to the first ``n`` of ``members``:
    (seconds from the store's opening until the last member holds every tensor, until it also
    checksummed them, its checksum)."""
    name = f"{RUN_ID}/v1/{time.monotonic_ns()}"
    manifest = folder_manifest(folder).with_buckets(DEFAULT_BUCKET_BYTES)
    t0 = time.time()
    group = HostedGroup(name, TIMEOUT_S)
    try:
        for i in range(n):
            members.inboxes[i].put((host, group.port, name, i))
        regs = group.registrations(n, TIMEOUT_S)
        roster = plan_roster(regs.values(), trainer_device="cpu", trainer_machine="bench",
                             manifest=manifest.as_request(), bucket_bytes=manifest.bucket_bytes)
        group.publish(roster)
        sender = WeightGroup(GroupSpec(host, group.port, roster.world_size, name, roster.backend), 0, TIMEOUT_S,
                             store_hosted=True)
        try:
            sender.send(state, manifest)
        finally:
            sender.close()
        done = [members.out.get(timeout=TIMEOUT_S) for _ in range(n)]
    finally:
        group.close()
    assert len({c for *_, c in done}) == 1
    return max(r for _, r, _, _ in done) - t0, max(c for _, _, c, _ in done) - t0, done[0][3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--members", default="1,2", help="comma-separated member counts to broadcast to")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    counts = [int(x) for x in a.members.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-broadcast-"))
    src, pulled = root / "served" / "v000001", root / "pulled"
    pulled.mkdir(parents=True)
    checksum = write_version_folder(src, a.shape, None)
    state = load_file(str(src / WEIGHTS_FILE))  # the trainer's state in memory (what it broadcasts)
    assert weights_checksum(state) == checksum
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    os.sync()
    members = Members(max(counts), mp.get_context("spawn"))
    server = WeightServer(a.host, resolve=lambda run, version, c: src).start()
    rows: dict[str, list[float]] = {"raw TCP": [], "pull": [], "pull + load": [], "pull + load + checksum": []}
    for n in counts:
        rows[f"broadcast to {n}"], rows[f"broadcast to {n} + checksum"] = [], []
    try:
        measure_pull(server.url, RUN_ID, 1, checksum, pulled / "v000001")  # the server's manifest, once
        measure_broadcast(a.host, state, src, members, max(counts))  # warm-up: the members' first group
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            measure_raw_tcp(a.host, nbytes)
            rows["raw TCP"].append(time.perf_counter() - t0)
            for n in counts:
                got, checked, c = measure_broadcast(a.host, state, src, members, n)
                assert c == checksum
                rows[f"broadcast to {n}"].append(got)
                rows[f"broadcast to {n} + checksum"].append(checked)
            t0 = time.perf_counter()
            measure_pull(server.url, RUN_ID, 1, checksum, pulled / "v000001")
            rows["pull"].append(time.perf_counter() - t0)
            loaded = load_file(str(pulled / "v000001" / WEIGHTS_FILE))
            rows["pull + load"].append(time.perf_counter() - t0)
            assert weights_checksum(loaded) == checksum
            rows["pull + load + checksum"].append(time.perf_counter() - t0)
            del loaded
    finally:
        server.stop()
        members.stop()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    gb = nbytes / 1e9
    print(f"\n{a.shape}: {gb:.3f} GB ({len(state)} tensors), {a.host}, {os.cpu_count()} CPUs, median of {a.repeats}")
    print(f"{'':<28} {'seconds':>8} {'GB/s':>7} {'pull + load + checksum / row':>29}")
    for k, s in med.items():
        print(f"{k:<28} {s:>8.3f} {gb / s:>7.2f} {med['pull + load + checksum'] / s:>28.2f}x")
    if a.out:
        Path(a.out).write_text(json.dumps({"shape": a.shape, "bytes": nbytes, "host": a.host, "repeats": a.repeats,
                                           "cpus": os.cpu_count(), "seconds": med, "all": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
