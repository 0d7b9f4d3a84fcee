"""Trainer recovery time (restore checkpoint + replay stored steps) vs checkpoint interval.

First runs ``--steps`` RL steps of the demo model (examples/demo.yaml, SFT cut to
``--sft-steps``) in-process with ``TrainerService``, rollouts by ``generate_batch``
over the real chunk plan, rewards by ``score_samples``, and a synchronous checkpoint
after EVERY step into a temp file:// store (keep_last large), recording the weights
checksum of every version of this uninterrupted trainer.

Then, for a crash at the end of step v = ``--steps``, for each interval k the newest
checkpoint is floor(v/k)*k (with v = 15 = 2^4 - 1 that is the worst case, k-1 steps
to replay, for every k in 1, 2, 4, 8). A fresh ``TrainerService`` in a fresh work dir
that only sees the checkpoints at multiples of k measures:
  restore s: ``ensure_version(floor(v/k)*k)``  (download + verify + load + export weights)
  total s:   ``ensure_version(v)``              (the same + replay of the k-1 steps)
  replay s:  total - restore   (k=1: nothing to replay, total = restore)
and checks that the rebuilt weights (and optimizer state) are bitwise equal to the
uninterrupted trainer's at version v.

    .venv/bin/python -m bench.bench_restore [--steps 15] [--intervals 1 2 4 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._inproc import demo_config, dataset_rows, generate_step, rollout_request, run_setup, step_batch  # noqa: E402
from gpu_runtime.store import artifacts as art  # noqa: E402
from gpu_runtime.data.rewards import score_samples  # noqa: E402
from gpu_runtime.store.object_store import LocalStore  # noqa: E402
from gpu_runtime.trainer.run_binding import RunBinding  # noqa: E402
from gpu_runtime.trainer.service import TrainerService  # noqa: E402
from spec.trainer_rpc import Rebuild, RunSetup, VersionInfo  # noqa: E402

log = logging.getLogger("bench_restore")
RUN_ID = "bench-restore"


class IntervalTrainerService(TrainerService):
    """A TrainerService that only sees the checkpoints a run with interval k would have."""

    def __init__(self, work_dir: Path, interval: int) -> None:
        super().__init__(work_dir)
        self.interval = interval

    def _bind(self, setup: RunSetup) -> RunBinding:
        run = super()._bind(setup)
        ck = run.ckpts
        if not getattr(ck, "_bench_interval", None):
            every = ck.list_durable
            ck.list_durable = lambda: [c for c in every() if c.step % self.interval == 0]
            ck._bench_interval = self.interval
        return run


def build_run(cfg, setup: RunSetup, work: Path) -> tuple[dict[int, str], TrainerService]:
    """The uninterrupted run: every step's artifacts + a durable checkpoint after every step."""
    store = LocalStore(work / "store")
    rows = dataset_rows(cfg, work / "train.jsonl")
    store.put_file(setup.dataset_key, work / "train.jsonl")
    spec = cfg.reward
    svc = TrainerService(work / "uninterrupted")
    info = svc.ensure_version(setup, 0)  # SFT warm-up -> v0, checkpoint step 0 (sync)
    checksums = {0: info.checksum}
    by_index = dict(enumerate(rows))
    for step in range(1, cfg.steps + 1):
        assert svc.trainer is not None
        gen_model = copy.deepcopy(svc.trainer.model).eval()
        chunks = generate_step(gen_model, rollout_request(cfg, RUN_ID, step, len(rows)), rows, svc.trainer.tokenizer)
        keys = []
        for c in chunks:
            keys.append(art.rollout_chunk_key(RUN_ID, step, c.chunk))
            art.put_model(store, keys[-1], c)
        samples = [s for c in chunks for s in c.samples]
        rewards = score_samples(samples, by_index, spec)
        rkey = art.rewards_key(RUN_ID, step)
        art.put_model(store, rkey, art.StepRewards(run_id=RUN_ID, step=step, rewards=rewards))
        res = svc.train_step(setup, step_batch(cfg, RUN_ID, step, keys, rkey))
        checksums[step] = res.checksum
        svc.save_checkpoint(step, data_cursor=step * cfg.rollout.prompts_per_step, sync=True)
        print(f"  step {step:>2}: reward {statistics.fmean(r.reward for r in rewards):.3f} "
              f"v{res.policy_version} {res.checksum[:12]} ({res.seconds:.2f}s train)", flush=True)
    assert svc.wait_for_uploads(120)
    return checksums, svc


def fresh_ensure(setup: RunSetup, root: Path, interval: int, target: int, tag: str) -> tuple[VersionInfo, TrainerService]:
    svc = IntervalTrainerService(Path(tempfile.mkdtemp(dir=root, prefix=f"{tag}-k{interval}-")), interval)
    info = svc.ensure_version(setup, target)
    return info, svc


def same_state(a: TrainerService, b: TrainerService) -> bool:
    """Weights and AdamW moments bitwise equal."""
    assert a.trainer is not None and b.trainer is not None
    if a.trainer.checksum() != b.trainer.checksum() or a.trainer.opt_steps != b.trainer.opt_steps:
        return False
    sa, sb = a.trainer.optimizer.state_dict()["state"], b.trainer.optimizer.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[i][n], sb[i][n]) for i in sa for n in sa[i] if isinstance(sa[i][n], torch.Tensor)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=15, help="RL steps; the crash is at the end of the last one")
    ap.add_argument("--sft-steps", type=int, default=50)
    ap.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)  # as the trainer process runs (bitwise replay needs a fixed thread count)

    with tempfile.TemporaryDirectory(prefix="bench-restore-") as tmp:
        work = Path(tmp)
        cfg = demo_config(work / "store", steps=args.steps, sft_steps=args.sft_steps, every=1, keep_last=1000,
                          name=RUN_ID)
        setup = run_setup(cfg, RUN_ID)
        print(f"building the run: demo model {cfg.model.init.hidden_size}h x {cfg.model.init.num_hidden_layers}L, "
              f"{cfg.samples_per_step} samples/step, SFT {cfg.sft.steps} steps, {cfg.steps} RL steps, "
              f"checkpoint after every step", flush=True)
        t = time.monotonic()
        checksums, uninterrupted = build_run(cfg, setup, work)
        ck_dir = work / "store" / art.checkpoints_prefix(RUN_ID) / "step-000001"
        ck_mb = sum(f.stat().st_size for f in ck_dir.rglob("*") if f.is_file()) / (1 << 20)
        print(f"built in {time.monotonic() - t:.1f}s; one checkpoint ~{ck_mb:.1f} MB", flush=True)

        v = cfg.steps
        meas = work / "measure"
        meas.mkdir()
        fresh_ensure(setup, meas, 1, v, "warmup")  # untimed: one-time process costs (imports, allocator)
        rows = []
        for k in args.intervals:
            c = (v // k) * k
            restore_s, total_s, ok = [], [], True
            for _ in range(args.repeats):
                info_r, svc_r = fresh_ensure(setup, meas, k, c, "restore")
                assert info_r.rebuild == Rebuild(restored_from_step=c, replayed_steps=[]), info_r
                restore_s.append(info_r.seconds)
                if c == v:  # nothing to replay: the same call, not measured twice
                    info_t, svc = info_r, svc_r
                else:
                    info_t, svc = fresh_ensure(setup, meas, k, v, "replay")
                assert info_t.rebuild == Rebuild(restored_from_step=c, replayed_steps=list(range(c + 1, v + 1))), info_t
                total_s.append(info_t.seconds)
                ok = ok and info_t.checksum == checksums[v] and same_state(svc, uninterrupted)
            rows.append((k, c, v - c, statistics.median(restore_s), statistics.median(total_s), ok, info_t.checksum))

        base = rows[0][4]
        print()
        print(f"crash at the end of step {v}; fresh TrainerService + work dir each time; "
              f"median of {args.repeats}")
        print(f"{'interval':>8} {'restored':>8} {'replayed':>8} {'restore s':>10} {'replay s':>9} {'total s':>8} "
              f"{'vs k=' + str(rows[0][0]):>7} {'s/replayed step':>15}  bitwise (weights {checksums[v][:12]}, optimizer)")
        for k, c, n, r, tot, ok, got in rows:
            per = f"{(tot - r) / n:.3f}" if n else "-"
            print(f"{k:>8} {'step ' + str(c):>8} {n:>8} {r:>10.3f} {tot - r:>9.3f} {tot:>8.3f} {tot / base:>6.1f}x "
                  f"{per:>15}  {ok} ({got[:12]})")
        print("restore s = ensure_version(checkpoint step): download + sha256 verify + load_state + export/upload "
              "weights; replay s = ensure_version(v) - restore s")


if __name__ == "__main__":
    main()
