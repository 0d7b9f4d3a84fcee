"""The real conversions between workflow contracts and the node's runtime calls: each carries
its input whole (the sections themselves, not copies) and turns trainer results into the
activity results the workflow records. (``init_policy`` and ``train_step`` carry the trainer's
``RunSetup`` and ``StepBatch`` themselves: tests/unit/test_workflows.py checks what the run
sends.)"""

from __future__ import annotations

import dataclasses

from activities import translate
from gpu_runtime.rollout.evaluate import EvalStats
from spec.rollout import RolloutSpec
from spec.events import CheckpointCorrupt, EngineDead, TrainerRestarted, TrainerRestored
from spec.train import TrainSpec
from spec.trainer_rpc import CheckpointSaved, Rebuild, TrainResult, VersionInfo
from workflows.contracts.placement import DatasetInfo
from workflows.contracts.sampling import RolloutInput
from workflows.contracts.training import EvalInput

# non-default values everywhere, so a dropped field shows
TRAIN = TrainSpec(lr=1.5e-5, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01, warmup_steps=3, grad_clip=0.5,
                  estimator="cispo", clip_eps=0.1, clip_eps_high=0.28, loss_agg="seq_mean_token_sum_norm",
                  loss_agg_norm_len=16, kl_coef=0.05, kl_estimator="k2", kl_in_reward=True, entropy_coef=0.01,
                  tis_cap=2.0, scale_adv_by_std=False, ppo_epochs=3, micro_batch_size=7, precision="bf16")
DATASET = DatasetInfo(key="runs/r/data/train.jsonl", n_rows=10, sha256="x")


def test_rollout_request() -> None:
    spec = RolloutSpec(prompts_per_step=3, group_size=5, chunk_size=6, max_new_tokens=9, temperature=0.7,
                       top_p=0.9, top_k=11)
    inp = RolloutInput(run_id="r", step=2, store_uri="file:///s", seed=8, policy_version=1, data_cursor=3,
                       dataset=DATASET, rollout=spec)
    req = translate.rollout_request(inp, n_rows=10)
    assert dataclasses.asdict(req) == {"run_id": "r", "step": 2, "seed": 8, "policy_version": 1, "data_cursor": 3,
                                       "n_rows": 10, "round": 0, "rollout": spec, "node": "", "chunks": None}
    # a rollout node's share: its chunks, stamped with its node id
    req = translate.rollout_request(inp.model_copy(update={"chunks": [0, 2]}), n_rows=10, node="n1")
    assert (req.chunks, req.node) == ((0, 2), "n1")
    # a dynamic-sampling round draws its own number of prompts
    req = translate.rollout_request(inp.model_copy(update={"round": 2, "n_prompts": 7}), n_rows=10)
    assert (req.round, req.rollout.prompts_per_step, req.rollout.group_size) == (2, 7, 5)
    assert inp.rollout.prompts_per_step == 3  # the input is not changed


EVENT = EngineDead(at="1970-01-01T00:00:00+00:00", slot=1, pid=None, reason="killed")


def test_eval_request_and_result() -> None:
    inp = EvalInput(run_id="r", step=4, store_uri="file:///s", seed=8, policy_version=4, eval_key="e", k=5,
                    temperature=0.6, max_new_tokens=7, chunk_size=3)
    req = translate.eval_request(inp)
    assert dataclasses.asdict(req) == inp.model_dump(exclude={"store_uri", "eval_key", "epoch"})
    out = translate.eval_result(inp, EvalStats(greedy_accuracy=0.5, pass_at_k=0.75, sampled_accuracy=0.4, k=5, n=8,
                                                        seconds=1.5), [EVENT])
    assert out.model_dump(exclude={"node_events"}) == {
        "step": 4, "policy_version": 4, "greedy_accuracy": 0.5, "pass_at_k": 0.75, "sampled_accuracy": 0.4, "k": 5, "n": 8, "seconds": 1.5}
    assert out.node_events == [EVENT]


def test_results_carry_rebuild_and_events() -> None:
    res = TrainResult(policy_version=6, checksum="c", metrics={"loss": 0.5}, seconds=1.25,
                      rebuild=Rebuild(restored_from_step=4, replayed_steps=[5]),
                      events=[CheckpointCorrupt(at="t", step=5, file="f", stored_in="step_000005", expected="a",
                                                actual="missing")])
    out = translate.train_step_result(res, [EVENT])
    assert (out.policy_version, out.checksum, out.metrics, out.seconds) == (6, "c", {"loss": 0.5}, 1.25)
    assert (out.restored_from_step, out.replayed_steps) == (4, [5])
    assert [e.kind for e in out.node_events] == ["engine_dead", "checkpoint_corrupt", "trainer_restored"]
    assert out.node_events[0] == EVENT
    restored = out.node_events[2]
    assert isinstance(restored, TrainerRestored)
    assert (restored.restored_from_step, restored.replayed_steps, restored.version) == (4, [5], 5)


def test_first_sft_is_not_a_restore_but_a_rebuild_from_sft_is() -> None:
    first = VersionInfo(policy_version=0, checksum="c", model_path="p", sft_metrics={"sft_steps": 3},
                        rebuild=Rebuild(restored_from_step=None, replayed_steps=[]))
    info = translate.policy_info(first, [])
    assert info.node_events == [] and info.restored_from_step is None and info.sft_metrics == {"sft_steps": 3}
    lost = first.model_copy(update={"policy_version": 2, "rebuild": Rebuild(restored_from_step=None, replayed_steps=[1, 2])})
    (ev,) = translate.policy_info(lost, []).node_events
    assert isinstance(ev, TrainerRestored) and (ev.restored_from_step, ev.replayed_steps, ev.version) == (None, [1, 2], 2)


def test_checkpoint_after_a_trainer_restart_reports_the_restore() -> None:
    saved = CheckpointSaved(step=4, key="k", weights_key="w", durable=True, rebuild=Rebuild(restored_from_step=2, replayed_steps=[3, 4]))
    out = translate.checkpoint_result(saved, 0.5, [TrainerRestarted(at="t", old_pid=1, returncode=-9, pid=2)])
    assert (out.step, out.key, out.durable, out.seconds) == (4, "k", True, 0.5)
    assert [e.kind for e in out.node_events] == ["trainer_restarted", "trainer_restored"]
