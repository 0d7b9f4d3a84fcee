"""Each estimator family through a whole (tiny, 2-step) run on one shared stack:
real Temporal server, workers, trainer, engine and router processes. Every step's
train metrics are finite and the weights moved off v0. PPO (a critic, GAE, stop
strings in the rollout) runs 3 steps, and again with its trainer SIGKILLed inside
step 3's train_step: policy, critic and the critic's optimizer end bitwise equal."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpu_runtime.models.tokenizer import Tokenizer
from spec.run import RunConfig
from tests.e2e.faults import assert_bitwise_equal, final_weights, kill_trainer, run_to_end, run_with_fault
from tests.stack import Stack, running_stack, tiny_config
from workers.common import connect
from workflows.run_state import RunProgress, TrainingRunInput
from workflows.queues import CONTROL_QUEUE
from workflows.stubs import TRAIN_STEP
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
ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "1.5"}  # a kill lands inside train_step


@pytest.fixture(scope="module")
def estimator_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("estimators"), env=ENV) as s:
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
        return await handle.query(TrainingRun.progress)

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


# ---- PPO: a critic, GAE, a stop string; and the trainer killed mid-step ----------------------
PPO = dict(estimator="ppo", kl_coef=0.05, kl_in_reward=True, critic_lr=1e-3, lam=0.9, value_clip=0.2)
PPO_STEPS = 3
STOP = "1"  # most sums of two digits contain a 1: many samples stop on it
PPO_METRICS = ("value_loss", "value_clip_fraction", "explained_variance", "critic_grad_norm")


def ppo_config(store: Path) -> dict:
    """Checkpoints at step 2 (the critic in it) and 3: the killed step 3 restores the critic."""
    return tiny_config(
        store, steps=PPO_STEPS, train={"lr": 1e-4, **PPO}, rollout={"stop": [STOP]},
        checkpoint={"every": 2, "keep_last": 2}, eval={"enabled": False}, engines={"num_engines": 1},
    )


@pytest.fixture(scope="module")
def ppo_baseline(estimator_stack: Stack) -> str:
    async def main() -> None:
        client = await connect(estimator_stack.server.address)
        summary = await run_to_end(client, "ppo", ppo_config(estimator_stack.workdir / "store"))
        assert summary.steps == PPO_STEPS and summary.policy_version == PPO_STEPS

    asyncio.run(main())
    return "ppo"


def checkpoint_file(store: Path, run_id: str, step: int, name: str) -> Path:
    return store / "runs" / run_id / "checkpoints" / f"step-{step:06d}" / name


def test_ppo_trains_policy_and_critic_and_stops_at_stop_strings(estimator_stack: Stack, ppo_baseline: str) -> None:
    store = estimator_stack.workdir / "store"
    run = store / "runs" / ppo_baseline
    for step in range(1, PPO_STEPS + 1):
        metrics = json.loads((run / "steps" / f"{step:06d}" / "train_result.json").read_text())["metrics"]
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert all(name in metrics for name in PPO_METRICS) and metrics["critic_grad_norm"] > 0, metrics
        assert metrics["grad_norm"] > 0 and -1.0 <= metrics["value_clip_fraction"] <= 1.0

    # the policy moved, and only the policy is published
    v0, last = final_weights(store, ppo_baseline, 0), final_weights(store, ppo_baseline, PPO_STEPS)
    assert v0.keys() == last.keys() and any(not torch.equal(v0[k], last[k]) for k in v0)
    assert not any(k.startswith(("trunk.", "head.")) for k in last)
    # the critic started as the v0 policy's trunk (step 1) and has trained since
    critic = load_file(str(checkpoint_file(store, ppo_baseline, PPO_STEPS, "critic.safetensors")))
    trunk = {k.removeprefix("trunk."): v for k, v in critic.items() if k.startswith("trunk.")}
    assert trunk and {"head.weight", "head.bias"} <= critic.keys()
    assert any(not torch.equal(v, v0[f"model.{k}"]) for k, v in trunk.items())

    # rollout.stop reached the engine: no response has the stop string before its last token
    stopped = 0
    for step in range(1, PPO_STEPS + 1):
        for chunk in sorted((run / "steps" / f"{step:06d}" / "rollout").glob("chunk-*.json")):
            for sample in json.loads(chunk.read_text())["samples"]:
                *head, _last = sample["response_ids"]
                assert STOP not in decode(store, ppo_baseline, head), sample
                stopped += STOP in sample["response_text"]
    assert stopped > 0


@cache
def _tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.load(folder)


def decode(store: Path, run_id: str, ids: list[int]) -> str:
    return _tokenizer(store / "runs" / run_id / "weights" / "v000000").decode(ids)


def test_ppo_trainer_killed_mid_step_ends_bitwise_equal(estimator_stack: Stack, ppo_baseline: str) -> None:
    store = estimator_stack.workdir / "store"
    run_id = "ppo-trainer-crash"
    _, p, old = run_with_fault(estimator_stack, run_id, ppo_config(store), (PPO_STEPS, TRAIN_STEP), kill_trainer)
    step = p.steps[PPO_STEPS - 1]
    assert step.restored_from_step == 2 and step.replayed_steps == []  # the critic came from checkpoint 2
    assert estimator_stack.node_pids("node0")["trainer"] != old
    assert_bitwise_equal(final_weights(store, run_id, PPO_STEPS), final_weights(store, ppo_baseline, PPO_STEPS))
    for name in ("critic.safetensors", "critic_optimizer.safetensors", "optimizer.safetensors"):
        a, b = (checkpoint_file(store, r, PPO_STEPS, name) for r in (run_id, ppo_baseline))
        assert_bitwise_equal(load_file(str(a)), load_file(str(b)))
