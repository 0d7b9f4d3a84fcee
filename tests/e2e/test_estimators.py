"""Each estimator family through a whole (tiny, 2-step) run on one shared stack:
real Temporal server, workers, trainer, engine and router processes. Every step's
train metrics are finite and the weights moved off v0."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.stack import Stack, running_stack, tiny_config
from workers.common import connect
from workflows.config import RunConfig
from workflows.contracts import CONTROL_QUEUE, RunProgress, TrainingRunInput
from workflows.training_run import TrainingRun

pytestmark = pytest.mark.e2e
STEPS = 2

# the smallest settings that still reach each code path (the tiny run's rewards vary within a group)
FAMILIES: dict[str, dict] = {
    "grpo-dr": dict(scale_adv_by_std=False, loss_agg="seq_mean_token_sum_norm", loss_agg_norm_len=4),
    "rloo": dict(estimator="rloo", dual_clip_c=3.0, tis_cap=2.0),
    "reinforce_pp_baseline": dict(estimator="reinforce_pp_baseline", kl_coef=0.05, kl_in_reward=True, kl_estimator="k2"),
    "gspo": dict(estimator="gspo", loss_agg="seq_mean_token_mean", clip_eps=3e-4, clip_eps_high=4e-4, ppo_epochs=2),
    "cispo": dict(estimator="cispo", clip_eps_high=4.0),
}
EXTRA_METRICS = {"rloo": ("dual_clip_fraction", "tis_weight_mean", "tis_clip_fraction")}


@pytest.fixture(scope="module")
def estimator_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("estimators")) as s:
        yield s


def config(store: Path, train: dict) -> dict:
    return tiny_config(
        store, steps=STEPS, train={"lr": 1e-4, **train}, checkpoint={"every": STEPS, "keep_last": 1},
        eval={"enabled": False}, engines={"num_engines": 1},
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_estimator_family_trains(estimator_stack: Stack, family: str) -> None:
    store = estimator_stack.workdir / "store"
    run_id = f"est-{family}"

    async def main() -> RunProgress:
        client = await connect(estimator_stack.server.address)
        cfg = RunConfig.model_validate(config(store, FAMILIES[family]))
        handle = await client.start_workflow(
            TrainingRun.run, TrainingRunInput(config=cfg), id=run_id, task_queue=CONTROL_QUEUE
        )
        summary = await asyncio.wait_for(handle.result(), 300)
        assert summary.steps == STEPS and summary.policy_version == STEPS
        return await handle.query("progress", result_type=RunProgress)

    progress = asyncio.run(main())
    assert [s.step for s in progress.steps] == list(range(1, STEPS + 1))
    for s in progress.steps:
        assert all(math.isfinite(v) for v in (s.reward_mean, s.loss, s.kl, s.grad_norm)), s
        assert s.grad_norm > 0, f"{family} step {s.step}: no gradient"

    run = store / "runs" / run_id
    for step in range(1, STEPS + 1):
        hparams = json.loads((run / "steps" / f"{step:06d}" / "step_batch.json").read_text())["hparams"]
        assert {k: hparams[k] for k in FAMILIES[family]} == FAMILIES[family]  # the trainer got the family's knobs
        metrics = json.loads((run / "steps" / f"{step:06d}" / "train_result.json").read_text())["metrics"]
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        for name in EXTRA_METRICS.get(family, ()):
            assert name in metrics, (family, name)

    v0 = load_file(str(run / "weights" / "v000000" / "model.safetensors"))
    last = load_file(str(run / "weights" / f"v{STEPS:06d}" / "model.safetensors"))
    assert v0.keys() == last.keys()
    assert any(not torch.equal(v0[k], last[k]) for k in v0), f"{family}: the weights did not change"
