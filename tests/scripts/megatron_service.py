"""A megatron run through ``TrainerService`` (what the node's trainer process runs), then a
second service restoring and replaying it, in a process of its own:
``tests.megatron_fixtures.run_service`` runs it for the CUDA test and its CPU rehearsal
(``python -m tests.scripts.megatron_service <work dir> cuda|cpu``); prints ``RESULT {json}``,
which ``check_service`` reads."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

RUN = "mg"


def _no_runtime_problem(*, need_cuda: bool = True) -> str | None:
    return None


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True)
    work, device = Path(argv[0]), argv[1]
    if device == "cuda":
        from gpu_runtime.trainer.common.device import use_device

        use_device("cuda:0")  # as the trainer process of a --device cuda node
    else:
        from gpu_runtime.trainer.megatron import trainer as mt
        from tests.megatron_fixtures import shim_cpu_forward

        shim_cpu_forward()
        mt.runtime_problem = _no_runtime_problem  # the CPU rehearsal: the shim stands in for CUDA
    from bench._inproc import dataset_rows, run_setup, step_batch, store_rollout
    from gpu_runtime.data.rewards import score_samples
    from gpu_runtime.models.causal_lm import load_causal_lm
    from gpu_runtime.models.model_folder import model_checksum
    from gpu_runtime.store import artifacts as art
    from gpu_runtime.store.object_store import LocalStore
    from gpu_runtime.trainer.service import TrainerService
    from spec.run import RunConfig
    from tests.stack import tiny_config

    cfg = RunConfig.model_validate(tiny_config(
        work / "store", steps=2, sft={"steps": 5}, train={"lr": 1e-3, "micro_batch_size": 4},
        checkpoint={"every": 100, "keep_last": 5}, trainer={"backend": "megatron"}))
    setup = run_setup(cfg, RUN)
    store = LocalStore(work / "store")
    rows = dataset_rows(cfg, work / "train.jsonl")
    store.put_file(setup.dataset_key, work / "train.jsonl")
    by_index = dict(enumerate(rows))
    first = TrainerService(work / "first")
    v0 = first.ensure_version(setup, 0)  # SFT on the HF trainer -> post-SFT folder -> the GPTModel; checkpoint v0
    out: dict[str, object] = {"trainer": type(first.trainer).__name__, "v0_sft_steps": v0.sft_metrics.get("sft_steps")}
    folder, checksums = Path(v0.model_path), [v0.checksum]
    for step in (1, 2):
        keys, samples = store_rollout(store, cfg, RUN, step, folder, rows)
        rkey = art.rewards_key(RUN, step)
        scored = score_samples(samples, by_index, cfg.reward)
        # plus a made-up term so every group has reward variance (a tiny model after 5 SFT steps is
        # rarely right: equal rewards would be a zero gradient, a step that proves nothing)
        scored = [r.model_copy(update={"reward": r.reward + (i % 3) / 2}) for i, r in enumerate(scored)]
        art.put_model(store, rkey, art.StepRewards(run_id=RUN, step=step, rewards=scored))
        res = first.train_step(setup, step_batch(cfg, RUN, step, keys, rkey))
        checksums.append(res.checksum)
        folder = first._weights_dir(res.policy_version)
        if step == 1:
            first.save_checkpoint(1, data_cursor=4, sync=True)
    out["metrics"] = sorted(res.metrics)
    out["versions"] = res.policy_version
    out["distinct"] = len(set(checksums))
    out["published"] = model_checksum(load_causal_lm(folder)) == checksums[-1]  # what an engine loads
    second = TrainerService(work / "second")  # a new trainer process: restore step 1, replay step 2
    info = second.ensure_version(setup, 2)
    out["rebuild"] = [info.rebuild.restored_from_step, info.rebuild.replayed_steps] if info.rebuild else None
    out["replayed_bitwise"] = info.checksum == checksums[-1]
    out["second_trainer"] = type(second.trainer).__name__
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
