"""Cost per RL step by model size: a real stack against a plain in-process loop, at the demo shape and at 0.36B.

For each shape (``--shapes demo,0.36b``: examples/demo.yaml's model, and Qwen2-0.5B's trunk,
hidden 896, intermediate 4864, 24 layers, 14 / 2 heads, random init through ``model.init``)
runs a short RL run (``--prompts`` x ``--samples``, ``--new-tokens`` new tokens, ``--steps``
steps, a checkpoint every ``--every`` steps and after the last, ``--engines`` torch engines,
SFT cut to ``--sft-steps``, default 0: ``train.entropy_coef`` ``--entropy-coef`` then makes
every step change the weights; no held-out eval, file:// store in a temp dir) once per
``rollout.mode`` (``--modes``) on a fresh stack (``bench.bench_rl_step.measure_temporal``),
then the same work in a plain single-process loop (``measure_plain``: the same chunks and
seeds, ``train_step``, a weight copy into the generating model, a state snapshot written and
uploaded on the ``CheckpointStore``'s thread every ``--every`` steps, the project's own way; no Temporal, no engine process, no
version published) in a process of its own. Prints, per shape:

- seconds per phase and per step (mean of steps 2..N, step 1 is warm-up), each mode
  against the plain loop; s/step is the close-to-close cadence of the RLStep children;
- bytes written by kind and where (store / node / plain loop), from a ledger of
  every file seen under the store folder, the node's work dir and its version folders (``bench._watch``: a scan every
  ``--scan-interval`` s, renames and hard links counted once), split by when each file was
  written (its mtime): before step 1 (init), during a step without / with a checkpoint (per
  step), after the last step; and the Temporal history payload bytes per step (the RLStep histories);
- each process's peak RSS (the kernel's VmHWM, read on the watch thread until the run ends;
  the plain loop's own ``ru_maxrss``) and the bytes it wrote to disk (``/proc/<pid>/io``
  write_bytes, over the whole run including init).

The 0.36B run needs ~25 GB of free disk while a mode runs (each mode's folders are removed
after it) and ~7 GB of memory. Not a timed test: ratios on a shared machine move with its load.

    .venv/bin/python -m bench.bench_scale [--shapes demo,0.36b] [--modes sync,one_step_off] \
        [--steps 6] [--every 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._inproc import demo_config  # noqa: E402
from bench._watch import Ledger, Watch  # noqa: E402
from bench.bench_rl_step import PHASES, cadence, mean, measure_plain, measure_temporal, with_mode  # noqa: E402
from bench.gpu_check import FULL_SHAPE  # noqa: E402
from gpu_runtime.models.model_folder import model_checksum, read_meta  # noqa: E402
from gpu_runtime.store.object_store import LocalStore  # noqa: E402
from gpu_runtime.trainer.policy.trainer import PolicyTrainer  # noqa: E402
from gpu_runtime.trainer.work_dir import versions_root  # noqa: E402
from spec.run import RunConfig  # noqa: E402
from tests.stack import Stack  # noqa: E402

SHAPES: dict[str, dict] = {"demo": {}, "0.36b": FULL_SHAPE}  # model.init over demo.yaml's
WINDOWS = ("init", "step", "checkpoint step", "after")
GB = 1e9


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------- config
def scale_config(store_dir: Path, shape: str, a: argparse.Namespace, name: str) -> RunConfig:
    """demo.yaml at ``shape`` with the short run of the flags."""
    cfg = demo_config(store_dir, steps=a.steps, sft_steps=a.sft_steps, every=a.every, keep_last=2, name=name)
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    raw["model"] = {**raw["model"], "init": {**raw["model"]["init"], **SHAPES[shape]}}
    raw["rollout"] = {**raw["rollout"], "prompts_per_step": a.prompts, "group_size": a.samples,
                      "max_new_tokens": a.new_tokens}
    raw["engines"] = {**raw["engines"], "num_engines": a.engines}
    raw["eval"] = {**raw.get("eval", {}), "enabled": False}  # the plain loop evaluates nothing
    # without SFT every answer scores 0, every advantage is 0 and no weight would change (nor would a
    # checkpoint's upload: unchanged files are not uploaded again); the entropy bonus moves them all
    raw["train"] = {**raw["train"], "entropy_coef": a.entropy_coef}
    return RunConfig.model_validate(raw)


# ---------------------------------------------------------------- what a file is
def classify_store(parts: tuple[str, ...]) -> tuple[str, str] | None:
    """``runs/<run>/weights|checkpoints|steps/...`` of a file:// store."""
    kind = parts[2] if len(parts) > 3 and parts[0] == "runs" else ""
    return ({"weights": "version publish", "checkpoints": "checkpoint", "steps": "step records"}
            .get(kind, "other"), "store")


def classify_node(parts: tuple[str, ...]) -> tuple[str, str] | None:
    """``<node>/trainer/<run>/weights|checkpoints/...``, ``<node>/trainer/save-*`` (a checkpoint's
    state before its local copy), ``<node>/weights/<run>/...`` (the engines' folders: hard links
    to the trainer's export, or downloads)."""
    rest = parts[1:]
    if rest[:1] == ("weights",) or rest[:2] == ("trainer", ".versions"):  # the version folders (versions_root)
        return "version publish", "node"
    if rest[:1] == ("trainer",) and len(rest) > 2:
        if rest[1].startswith("save-"):
            return "checkpoint", "node"
        return {"weights": ("version publish", "node"), "checkpoints": ("checkpoint", "node")}.get(
            rest[2], ("other", "node"))
    return "other", "node"


def classify_versions(parts: tuple[str, ...]) -> tuple[str, str] | None:
    """The node's version folders when ``$MILESTONE_VERSIONS_DIR`` puts them elsewhere (a tmpfs:
    RAM): ``<run>/trainer|engines|upload/v<N>/...``."""
    return "version publish", "node versions dir"


def classify_plain(parts: tuple[str, ...]) -> tuple[str, str] | None:
    """The plain loop's folder: ``plain-store`` and ``plain-ckpt`` (its CheckpointStore),
    ``save-*`` (its state before the copy), the rest (its base model, the dataset)."""
    top = parts[0]
    if top in ("plain-store", "plain-ckpt") or top.startswith("save-"):
        return "checkpoint", "plain"
    return "other", "plain"


def by_window(ledger: Ledger, bounds: list[float], ckpt: list[bool]) -> dict[str, dict[str, int]]:
    """{window: {"kind/where": bytes}}: files written before step 1, during the
    steps (without / with a checkpoint), after the last step. ``bounds``: step 1's start, then
    each step's end."""
    out: dict[str, dict[str, int]] = {w: {} for w in WINDOWS}

    def add(window: str, got: dict[tuple[str, str], int]) -> None:
        for (kind, where), n in got.items():
            key = f"{kind}/{where}"
            out[window][key] = out[window].get(key, 0) + n

    add("init", ledger.bytes_by_kind(end=bounds[0]))
    for i, is_ckpt in enumerate(ckpt):
        add("checkpoint step" if is_ckpt else "step", ledger.bytes_by_kind(bounds[i], bounds[i + 1]))
    add("after", ledger.bytes_by_kind(start=bounds[-1]))
    return out


# ---------------------------------------------------------------- runs
def stack_pids(stack: Stack) -> dict[str, int]:
    pids = {"temporal server": stack.server.proc.pid if stack.server.proc else 0,
            **{("control worker" if n == "control" else "node agent"): p.pid for n, p in stack.procs.items()}}
    node = stack.node_pids("node0")
    pids.update({"trainer": node.get("trainer") or 0, "router": node.get("router") or 0})
    pids.update({f"engine {i}": pid for i, pid in enumerate(node.get("engines", []))})
    return {role: pid for role, pid in pids.items() if pid}


def project_run(cfg: RunConfig, run_dir: Path, run_id: str, interval_s: float) -> dict:
    """One mode on a fresh stack, reduced to numbers (its folders removed afterwards)."""
    manifest = run_dir / "store" / "runs" / run_id / "checkpoints" / f"step-{cfg.steps:06d}" / "manifest.json"
    durable: list[float] = []  # the last checkpoint's manifest mtime, once it exists

    @contextmanager
    def watch(stack: Stack) -> Iterator[Watch]:
        versions = versions_root(stack.workdir / "nodes" / "node0" / "trainer")  # $MILESTONE_VERSIONS_DIR: elsewhere
        roots = [(run_dir / "store", classify_store), (stack.workdir / "nodes", classify_node)]
        if stack.workdir not in versions.parents:
            roots.append((versions, classify_versions))
        with Watch(roots, pids=lambda: stack_pids(stack), interval_s=interval_s) as w:
            yield w
            # the run completes before its last checkpoint's upload ends: wait for it (its bytes count)
            deadline = time.monotonic() + 600
            while not manifest.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            durable.extend([manifest.stat().st_mtime] if manifest.exists() else [])

    try:
        r = measure_temporal(cfg, run_dir, run_id, watch)
        w: Watch = r["watched"]
        steps, tl = r["steps"], r["timelines"]
        meas = [s for s in steps if s.step > 1]
        final = read_meta(run_dir / "store" / "runs" / run_id / "weights" / f"v{cfg.steps:06d}").get("checksum")
        return {
            "phases": {p: mean([s.phase_seconds.get(p, 0.0) for s in meas]) for p in PHASES},
            "step_wall": mean([s.step_seconds for s in meas]),
            "cadence": cadence(r["closes"]),
            "wall_plain_step": mean([s.step_seconds for s in meas if not s.checkpointed]),
            "wall_plain_step_median": median([s.step_seconds for s in meas if not s.checkpointed]),
            "wall_steady": mean([s.step_seconds for s in meas if s.step != cfg.steps]),
            "per_step": [{"step": s.step, "wall": s.step_seconds, "checkpointed": s.checkpointed,
                          "phases": {p: s.phase_seconds.get(p, 0.0) for p in PHASES}} for s in steps],
            # the stall: checkpoints the run goes on from (the last one is durable before the run ends)
            "wall_ckpt_step": mean([s.step_seconds for s in meas if s.checkpointed and s.step != cfg.steps]),
            "ckpt_phase": mean([s.phase_seconds.get("checkpoint", 0.0) for s in meas
                                if s.checkpointed and s.step != cfg.steps]),
            "final_ckpt_phase": steps[-1].phase_seconds.get("checkpoint", 0.0),
            "overlap": mean([s.overlap_seconds for s in meas]),
            "init_s": r["init"], "stack_start_s": r["stack_start"],
            "n_ckpt": sum(s.checkpointed for s in steps), "n_steps": len(steps),
            "bytes": by_window(w.ledger, [tl[0]["_first"], *(t["_last"] for t in tl)],
                               [s.checkpointed for s in steps]),
            "history_bytes_per_step": mean([t["payload bytes in"] + t["payload bytes out"] + t["result bytes"]
                                            for t in tl]),
            "procs": {role: {"peak_rss": p.peak_rss, "write_bytes": p.write_bytes} for role, p in w.procs.items()},
            "checksum": final,
            # seconds from the last RLStep's close to its checkpoint's manifest in the store (None: not in 600 s)
            "last_ckpt_durable_after": durable[0] - tl[-1]["_last"] if durable else None,
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def plain_child(cfg_json: str, work: str, interval_s: float) -> dict:
    """The plain loop in this (spawned) process, so its ru_maxrss and write_bytes are its own."""
    cfg, folder = RunConfig.model_validate_json(cfg_json), Path(work)
    folder.mkdir(parents=True, exist_ok=True)
    with Watch([(folder, classify_plain)], interval_s=interval_s) as w:
        out = measure_plain(cfg, folder)
    probe = publish_probe(out.pop("trainer"), folder / "probe")
    steps = out["steps"]
    meas = steps[1:]
    starts = steps[0]["end"] - steps[0]["wall"]
    return {
        "phases": {p: mean([s["phases"][p] for s in meas]) for p in PHASES},
        "step_wall": mean([s["wall"] for s in meas]),
        "wall_plain_step": mean([s["wall"] for s in meas if not s["checkpointed"]]),
        "wall_plain_step_median": median([s["wall"] for s in meas if not s["checkpointed"]]),
        "wall_steady": mean([s["wall"] for s in meas[:-1]]),
        "per_step": [{"step": i + 1, "wall": s["wall"], "checkpointed": s["checkpointed"], "phases": s["phases"]}
                     for i, s in enumerate(steps)],
        "wall_ckpt_step": mean([s["wall"] for s in meas[:-1] if s["checkpointed"]]),
        "ckpt_phase": mean([s["phases"]["checkpoint"] for s in meas[:-1] if s["checkpointed"]]),
        "final_ckpt_phase": steps[-1]["phases"]["checkpoint"],
        "n_ckpt": sum(s["checkpointed"] for s in steps), "n_steps": len(steps),
        "checkpoint_parts": {k: mean([s["checkpoint_parts"][k] for s in meas[:-1] if s["checkpointed"]])
                             for k in ("wait_previous", "snapshot")},
        "publish_probe": probe,
        "bytes": by_window(w.ledger, [starts, *(s["end"] for s in steps)], [s["checkpointed"] for s in steps]),
        "procs": {"plain loop": {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                                 "write_bytes": psutil.Process().io_counters().write_bytes}},
        "checksum": out["checksum"],
    }


def publish_probe(trainer: PolicyTrainer, folder: Path) -> dict[str, float]:
    """What publishing a version costs the project's trainer beyond the plain loop's step, timed
    once in the plain loop's process after its run: the checksum the folder carries, the
    model folder written (``export_model_folder``: checksum + safetensors), its copy into a
    file:// store."""
    t = time.perf_counter()
    model_checksum(trainer.model)
    checksum_s = time.perf_counter() - t
    t = time.perf_counter()
    trainer.export_model_folder(folder / "v")
    export_s = time.perf_counter() - t
    t = time.perf_counter()
    store = LocalStore(folder / "store")
    for f in sorted(x for x in (folder / "v").rglob("*") if x.is_file()):
        store.put_file(f"v/{f.relative_to(folder / 'v').as_posix()}", f)
    copy_s = time.perf_counter() - t
    shutil.rmtree(folder, ignore_errors=True)
    return {"checksum": checksum_s, "export (checksum + write)": export_s, "copy to the store": copy_s}


def plain_run(cfg: RunConfig, work: Path, interval_s: float) -> dict:
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:  # its exit terminates the child
            return pool.apply(plain_child, (cfg.model_dump_json(), str(work), interval_s))
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- report
def settle() -> float:
    """Wait for the disk to write back what the measured run left dirty (its folder is already
    removed: ``project_run``, ``plain_run``), so the next run does not pay for this one's
    writeback (the last durable checkpoint of a 0.36B run leaves GBs dirty); returns the seconds."""
    t = time.monotonic()
    os.sync()
    return time.monotonic() - t


def report(shape: str, cfg: RunConfig, runs: dict[str, dict]) -> None:
    plain = runs["plain"]
    modes = [m for m in runs if m != "plain"]
    base = plain["step_wall"]
    print(f"\n== {shape}: model.init {cfg.model.init.hidden_size}h x {cfg.model.init.num_hidden_layers}L "
          f"(intermediate {cfg.model.init.intermediate_size}, heads {cfg.model.init.num_attention_heads}/"
          f"{cfg.model.init.num_key_value_heads}), {cfg.rollout.prompts_per_step} x {cfg.rollout.group_size} "
          f"samples of {cfg.rollout.max_new_tokens} new tokens, {cfg.engines.num_engines} engine(s), {cfg.steps} "
          f"steps, checkpoint every {cfg.checkpoint.every} and after the last")
    head = f"{f'seconds (mean of steps 2..{cfg.steps})':<34} {'plain':>9}"
    print(head + "".join(f" {m:>13} {'x plain':>8}" for m in modes))

    def row(name: str, key: str, sub: str | None = None) -> None:
        def val(r: dict) -> float:
            return r[key][sub] if sub else r[key]
        b = val(plain) if key in plain else float("nan")
        cells = "".join(f" {val(runs[m]):>13.3f} {val(runs[m]) / b if b > 1e-4 else float('nan'):>7.2f}x"
                        for m in modes)
        print(f"{name:<34} {b:>9.3f}" + cells)

    for p in PHASES:
        row(f"  {p}", "phases", p)
    row("step wall (RLStep / loop step)", "step_wall")
    row("  steps before the last", "wall_steady")  # what a long run sees: the last waits for its durable checkpoint
    row("  steps without a checkpoint", "wall_plain_step")
    row("  steps without a checkpoint, median", "wall_plain_step_median")
    for m in ["plain", *modes]:
        if "per_step" in runs[m]:
            print(f"    {m} per step (s, * = checkpoint): " + " ".join(
                f"{x['wall']:.1f}{'*' if x['checkpointed'] else ''}" for x in runs[m]["per_step"]))
    row("  steps with a checkpoint", "wall_ckpt_step")
    row("  checkpoint phase, when due", "ckpt_phase")
    row("  the last step's (durable) checkpoint", "final_ckpt_phase")
    print(f"{'s/step, close to close':<34} {base:>9.3f}"
          + "".join(f" {runs[m]['cadence']:>13.3f} {runs[m]['cadence'] / base:>7.2f}x" for m in modes))
    parts = ", ".join(f"{k} {v:.2f}s" for k, v in plain["checkpoint_parts"].items())
    probe = ", ".join(f"{k} {v:.2f}s" for k, v in plain["publish_probe"].items())
    print(f"  plain: checkpoint = {parts}; publishing a version (not in its step, timed once after): {probe}")
    for m in modes:
        r = runs[m]
        stall = r["ckpt_phase"] / r["wall_plain_step"] if r["wall_plain_step"] > 0 else float("nan")
        last = r["last_ckpt_durable_after"]
        print(f"  {m}: the last checkpoint durable in the store "
              + (f"{last:.1f}s after the run's last step closed" if last is not None else "not within 600 s"))
        print(f"  {m}: checkpoint stall {r['ckpt_phase']:.2f}s = {100 * stall:.0f}% of a step without one; "
              f"overlap {r['overlap']:.2f}s/step; init incl. SFT {r['init_s']:.1f}s, stack start "
              f"{r['stack_start_s']:.1f}s; history payloads {r['history_bytes_per_step'] / 1e3:.1f} kB/step")

    print("\nbytes written, GB (files under the store / node dir, by when each was written; per step = "
          "mean over the steps of that kind)")
    cols = [(r, m) for m in ["plain", *modes] for r in [runs[m]]]
    print(f"{'':<28}" + "".join(f"{m:>28}" for _, m in cols))
    print(f"{'kind/where':<28}" + "".join(f" {'init':>7} {'/step':>6} {'/ckpt':>6} {'after':>5}" for _ in cols))
    keys = sorted({k for r, _ in cols for w in WINDOWS for k in r["bytes"][w]})
    for k in keys:
        line = f"{k:<28}"
        for r, _ in cols:
            n_step, n_ck = r["n_steps"] - r["n_ckpt"], r["n_ckpt"]
            b = r["bytes"]
            line += (f" {b['init'].get(k, 0) / GB:>7.3f} {b['step'].get(k, 0) / GB / max(n_step, 1):>6.3f}"
                     f" {b['checkpoint step'].get(k, 0) / GB / max(n_ck, 1):>6.3f} {b['after'].get(k, 0) / GB:>5.2f}")
        print(line)

    print(f"\n{'process':<18} " + "".join(f" {m + ' peak RSS':>24} {'wrote':>8}" for _, m in cols))
    roles = list(dict.fromkeys(role for r, _ in cols for role in r["procs"]))
    for role in roles:
        line = f"{role:<18} "
        for r, _ in cols:
            p = r["procs"].get(role)
            line += f" {p['peak_rss'] / GB:>22.2f}GB {p['write_bytes'] / GB:>6.2f}GB" if p else f" {'-':>24} {'-':>8}"
        print(line)
    sync = runs.get("sync")
    if sync:
        print(f"final weights v{cfg.steps}: sync {str(sync['checksum'])[:12]} plain {plain['checksum'][:12]} "
              f"bitwise equal: {sync['checksum'] == plain['checksum']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="demo,0.36b", help=f"comma-separated: {', '.join(SHAPES)}")
    ap.add_argument("--modes", default="sync,one_step_off", help="rollout.mode values, comma-separated")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every k steps (and after the last)")
    ap.add_argument("--prompts", type=int, default=4, help="rollout.prompts_per_step")
    ap.add_argument("--samples", type=int, default=4, help="rollout.group_size")
    ap.add_argument("--new-tokens", type=int, default=6, help="rollout.max_new_tokens")
    ap.add_argument("--engines", type=int, default=1, help="engines.num_engines (the plain loop generates on 1 thread)")
    ap.add_argument("--sft-steps", type=int, default=0)
    ap.add_argument("--entropy-coef", type=float, default=0.01,
                    help="train.entropy_coef (> 0 so that the weights change without SFT)")
    ap.add_argument("--scan-interval", type=float, default=0.1, help="seconds between the watch thread's samples")
    ap.add_argument("--json", default=None, help="also write every number here (after each run)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in --json (same settings) and measure only the missing ones")
    a = ap.parse_args()
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not shapes or any(s not in SHAPES for s in shapes):
        ap.error(f"--shapes: choose from {', '.join(SHAPES)}")
    if not modes or any(m not in ("sync", "one_step_off", "fully_async") for m in modes):
        ap.error("--modes: rollout.mode values (sync, one_step_off, fully_async)")
    if a.steps < 2:
        ap.error("--steps must be >= 2 (step 1 is excluded as warm-up)")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def on_term(*_: object) -> None:  # a TERM still stops the stack (finally blocks); a second one waits for that
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)

    settings = {k: v for k, v in vars(a).items() if k not in ("shapes", "modes", "json", "resume")}
    results: dict[str, dict] = {}
    if a.resume and a.json and Path(a.json).exists():  # runs already measured with the same settings count
        saved = json.loads(Path(a.json).read_text())
        if saved.get("settings") != settings:
            ap.error(f"--resume: {a.json} was measured with other settings: {saved.get('settings')}")
        results = saved["shapes"]
    os.sync()  # what was written before the bench is not its first run's writeback
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        work = Path(tmp)
        for shape in shapes:
            tag = shape.replace(".", "")
            runs = results.setdefault(shape, {})
            for mode in [*modes, "plain"]:
                if mode in runs:
                    continue
                run_id = f"scale-{tag}-{mode.replace('_', '-')}"
                load, t, free = os.getloadavg()[0], time.monotonic(), shutil.disk_usage(work).free / GB
                if mode == "plain":
                    runs[mode] = plain_run(scale_config(work / "unused", shape, a, "plain"), work / run_id,
                                           a.scan_interval)
                else:
                    cfg = with_mode(scale_config(work / run_id / "store", shape, a, run_id), mode)
                    runs[mode] = project_run(cfg, work / run_id, run_id, a.scan_interval)
                runs[mode]["load"] = [load, os.getloadavg()[0]]
                print(f"{shape} {mode}: {time.monotonic() - t:.0f}s, load average {load:.1f} -> "
                      f"{os.getloadavg()[0]:.1f}, {free:.0f} GB free before; settled in {settle():.0f}s",
                      flush=True)
                if a.json:  # after each run: an interrupted bench resumes from here (--resume)
                    Path(a.json).write_text(json.dumps({"settings": settings, "shapes": results}, indent=1) + "\n")
            report(shape, scale_config(work / "unused", shape, a, "plain"),
                   {m: runs[m] for m in [*modes, "plain"]})
    print("\nnotes: step 1 is warm-up (excluded from the seconds). Bytes: a file counts once with the largest size "
          "seen, under the window its mtime falls in (an async checkpoint upload that outlives its step counts "
          "under the next one, the last under 'after'); 'version publish/node' is the trainer's export (the "
          "engines' hard links to it add nothing). 'wrote' is /proc/<pid>/io write_bytes over the whole run.")


if __name__ == "__main__":
    main()
