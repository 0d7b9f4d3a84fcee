"""Seconds per RL step on one host against a trainer host + 2 rollout hosts, and the refit's
seconds and bytes/s against the raw TCP throughput of the same link, on the multi-host bed.

The bed (tests/hosts.py, root only): a services host (Temporal, SeaweedFS, the control
worker) and three node hosts as network namespaces on a bridge, each with a private file
view; the store is the bed's S3. ``node0`` runs an agent that trains, ``node1`` and ``node2``
rollout-only agents (``--role rollout``). For each shape (``--shapes demo,0.36b``: examples/
demo.yaml's model, and Qwen2-0.5B's trunk at 0.36B by ``model.init``, as bench_scale):

1. **one host**: the run with ``engines.nodes: 0`` and ``--engines`` engines on node0;
2. **three hosts**: the same run with ``engines.nodes: 2`` and ``--engines`` engines on each
   rollout node (its engines pull every version from node0's weight server);

then, between node0 and node1: the raw TCP throughput of the link (one stream, the bytes of
the version's weights file, from memory to memory: ``bench._link``) and the pulls of the
versions trained during the run, as the rollout nodes' agents logged them (the pull path
alone: bytes over seconds of each ``pull_version``). Prints s/step (mean of steps
2..N of the RLStep summaries), the phases, the refit (the ``update_weights`` phase: pull +
load on every rollout node, in parallel; on one host: the engines loading the trainer's
export), and the pull's GB/s as a fraction of the link's.

Not a timed test: on a shared 2-core machine every host shares the same cores, so three hosts
cannot be faster than one here; what the numbers show is the overhead of spreading (the
pull, the dispatch) at equal total engines.

    .venv/bin/python -m bench.bench_multi_host [--shapes demo,0.36b] [--steps 4] [--engines 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._inproc import demo_config  # noqa: E402
from bench.gpu_check import FULL_SHAPE  # noqa: E402
from spec.run import RunConfig  # noqa: E402
from tests.e2e.faults import progress, run_to_end  # noqa: E402
from tests.hosts import Bed, require_namespaces  # noqa: E402
from tests.stack import wait_for  # noqa: E402
from workflows.run_state import RunProgress  # noqa: E402

SHAPES: dict[str, dict] = {"demo": {}, "0.36b": FULL_SHAPE}
LINK_PORT = 7100
LINK_RUNS = itertools.count()
LINK_ENV = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
GB = 1e9


def shape_config(store: str, shape: str, a: argparse.Namespace, nodes: int) -> RunConfig:
    cfg = demo_config(Path("/nonexistent"), steps=a.steps, sft_steps=a.sft_steps, every=a.steps, keep_last=2,
                      name=f"multi-host-{shape}")
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    raw["store"] = store
    raw["model"] = {**raw["model"], "init": {**raw["model"]["init"], **SHAPES[shape]}}
    raw["rollout"] = {**raw["rollout"], "prompts_per_step": a.prompts, "group_size": a.samples,
                      "max_new_tokens": a.new_tokens, "chunk_size": a.chunk_size}
    raw["engines"] = {**raw["engines"], "num_engines": a.engines, "nodes": nodes}
    raw["eval"] = {**raw.get("eval", {}), "enabled": False}
    raw["train"] = {**raw["train"], "entropy_coef": a.entropy_coef}  # the weights move without SFT
    return RunConfig.model_validate(raw)


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def run(bed: Bed, cfg: RunConfig, run_id: str) -> tuple[dict, RunProgress]:
    async def main(client):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        await run_to_end(client, run_id, cfg.model_dump(mode="json"), timeout_s=3600)
        return time.monotonic() - t0, await progress(client, run_id)

    total, prog = bed.call(main, timeout_s=3700)
    later = prog.steps[1:] or prog.steps  # step 1 is warm-up
    phases = sorted({k for s in later for k in s.phase_seconds})
    out = {
        "total_s": total,
        "s_per_step": mean([s.step_seconds for s in later]),
        "phases": {k: mean([s.phase_seconds.get(k, 0.0) for s in later]) for k in phases},
        "engine_nodes": sorted({e.node for e in prog.engines}),
    }
    return out, prog


def link_seconds(bed: Bed, nbytes: int) -> float:
    """Raw TCP, node0 -> node1, ``nbytes`` in one stream."""
    server = bed.host("node0")
    name = f"link-{next(LINK_RUNS)}"  # a log of its own: "listening" is this sender's
    proc = server.spawn(name, [sys.executable, "-m", "bench._link", "serve", server.addr, str(LINK_PORT),
                                 str(nbytes)], env=LINK_ENV)
    try:
        wait_for(lambda: "listening" in bed.log("node0", name) or proc.poll() is not None, 120,
                 what="the raw TCP sender to listen")
        got = bed.host("node1").run([sys.executable, "-m", "bench._link", "recv", server.addr, str(LINK_PORT),
                                     str(nbytes)], timeout_s=600, env=LINK_ENV)
        if got.returncode:
            raise RuntimeError(f"raw TCP receive failed: {got.stderr[-2000:]}")
        return float(json.loads(got.stdout.strip().splitlines()[-1])["seconds"])
    finally:
        proc.wait(timeout=60)


PULLED = re.compile(r"weights v(\d+) of run (\S+): pulled (\d+) bytes from \S+ in ([\d.]+) s")


def pulls(bed: Bed, run_id: str) -> list[dict]:
    """Every pull the rollout nodes made for ``run_id`` (their agents' log lines): version, bytes, seconds."""
    out = []
    for host in ("node1", "node2"):
        for m in PULLED.finditer(bed.log(host, "gpu")):
            if m.group(2) == run_id:
                out.append({"host": host, "version": int(m.group(1)), "bytes": int(m.group(3)),
                            "seconds": float(m.group(4))})
    return out


def measure_shape(bed: Bed, shape: str, a: argparse.Namespace) -> dict:
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    store = bed.store_uri(bucket)
    out: dict = {"shape": shape}
    one, _ = run(bed, shape_config(store, shape, a, nodes=0), f"{shape}-one-host")
    out["one_host"] = one
    three, _ = run(bed, shape_config(store, shape, a, nodes=2), f"{shape}-three-hosts")
    out["three_hosts"] = three
    # the pulls of the versions trained during the run (v2..: v1's ran while the engines started)
    made = [p for p in pulls(bed, f"{shape}-three-hosts") if p["version"] > 1] or pulls(bed, f"{shape}-three-hosts")
    nbytes = max(p["bytes"] for p in made)
    out["weights_bytes"] = nbytes
    out["pulls"] = made
    link = min(link_seconds(bed, nbytes) for _ in range(a.repeats))
    out["link_gb_s"] = nbytes / link / GB
    out["pull_gb_s"] = statistics.median(p["bytes"] / p["seconds"] for p in made) / GB
    out["pull_fraction_of_link"] = out["pull_gb_s"] / out["link_gb_s"]
    out["refit_s"] = {"one_host": one["phases"].get("update_weights"), "three_hosts": three["phases"].get("update_weights")}
    return out


def report(r: dict) -> None:
    one, three = r["one_host"], r["three_hosts"]
    print(f"\n== {r['shape']}: weights {r['weights_bytes'] / 1e6:.1f} MB ==")
    print(f"s/step      one host {one['s_per_step']:.2f}   trainer host + 2 rollout hosts {three['s_per_step']:.2f}"
          f"   ratio {three['s_per_step'] / one['s_per_step']:.2f}x   (engines on {', '.join(three['engine_nodes'])})")
    for k in sorted(set(one["phases"]) | set(three["phases"])):
        print(f"  {k:16s} {one['phases'].get(k, 0.0):8.2f} {three['phases'].get(k, 0.0):8.2f}")
    print(f"refit (update_weights) one host {r['refit_s']['one_host']:.2f} s, three hosts "
          f"{r['refit_s']['three_hosts']:.2f} s (pull + load, both rollout hosts at once)")
    print(f"link (raw TCP node0 -> node1, one stream) {r['link_gb_s']:.2f} GB/s; the run's pulls (median of "
          f"{len(r['pulls'])}, two rollout hosts at once) {r['pull_gb_s']:.2f} GB/s each = "
          f"{100 * r['pull_fraction_of_link']:.0f}% of the link")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="demo,0.36b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--engines", type=int, default=1, help="engines per engine-running node")
    ap.add_argument("--sft-steps", type=int, default=0)
    ap.add_argument("--entropy-coef", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=3, help="link and pull measurements (the best is kept)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    require_namespaces()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-multi-host-") as tmp:
        bed = Bed(Path(tmp), n_nodes=3)
        try:
            bed.start(agents=False)
            bed.start_node("node0")
            bed.start_node("node1", "--role", "rollout")
            bed.start_node("node2", "--role", "rollout")
            for shape in [s.strip() for s in a.shapes.split(",") if s.strip()]:
                results.append(measure_shape(bed, shape, a))
                report(results[-1])
                if a.json:
                    Path(a.json).write_text(json.dumps(results, indent=1, default=str))
        finally:
            bed.stop()


if __name__ == "__main__":
    main()
