"""The seam between workflow contracts and the trainer's typed API.

The mirrored models cannot drift (same field sets), and each translation carries
every field across (a non-default value in, the same value out)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from activities import translate
from gpu_runtime.rollout.evaluate import EvalStats
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.trainer.api import (
    HPARAMS_ADDED_LATER, CheckpointSaved, NodeEvent, Rebuild, TrainerHParams, TrainResult, VersionInfo,
    stored_hparams, stored_step_batch,
)
from workflows.config import (
    CheckpointSpec, DistillSpec, HParamUpdate, LoraSpec, ModelInitSpec, ModelSpec, RewardSpec, RewardTerm, RolloutSpec, SFTSpec, TrainSpec,
)
from workflows.trainer_config import TrainerSpec
from workflows.contracts.events import RunEvent
from workflows.contracts.placement import DatasetInfo, InitPolicyInput
from workflows.contracts.sampling import RolloutInput
from workflows.contracts.training import EvalInput, SFTRowsInput, TrainStepInput


@pytest.mark.parametrize("workflow_side,runtime_side", translate.MIRRORS, ids=lambda m: m.__name__)
def test_mirrored_field_sets_agree(workflow_side: type, runtime_side: type) -> None:
    assert set(workflow_side.model_fields) == set(runtime_side.model_fields)


def test_runtime_hparams_have_no_defaults_of_their_own() -> None:
    """Each knob's default lives in the run config only."""
    for (_, runtime_side) in translate.MIRRORS:
        defaults = [n for n, f in runtime_side.model_fields.items() if not f.is_required()]
        assert defaults == [], f"{runtime_side.__name__} declares defaults for {defaults}"


def test_rollout_spec_reaches_the_rollout_request() -> None:
    """Every generation knob; the dynamic-sampling ones stay with the workflow."""
    assert translate.ROLLOUT_WORKFLOW_ONLY < set(RolloutSpec.model_fields)
    assert set(RolloutSpec.model_fields) - translate.ROLLOUT_WORKFLOW_ONLY <= {
        f.name for f in dataclasses.fields(RolloutRequest)}


def test_every_train_knob_can_be_set_mid_run() -> None:
    assert set(HParamUpdate.model_fields) - {"unset"} == set(TrainSpec.model_fields)


# non-default values everywhere, so a dropped field shows
TRAIN = TrainSpec(lr=1.5e-5, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01, warmup_steps=3, grad_clip=0.5,
                  estimator="cispo", clip_eps=0.1, clip_eps_high=0.28, loss_agg="seq_mean_token_sum_norm",
                  loss_agg_norm_len=16, kl_coef=0.05, kl_estimator="k2", kl_in_reward=True, entropy_coef=0.01,
                  tis_cap=2.0, scale_adv_by_std=False, ppo_epochs=3, micro_batch_size=7, precision="bf16")
DATASET = DatasetInfo(key="runs/r/data/train.jsonl", n_rows=10, sha256="x")


# the critic / GAE knobs apply to estimator ppo only
TRAIN_PPO = TRAIN.model_copy(update=dict(estimator="ppo", scale_adv_by_std=True, gamma=0.99, lam=0.9, vf_coef=0.25, value_clip=0.3,
                                         critic_lr=2e-5, critic_warmup_steps=2))


def test_train_spec_arrives_whole() -> None:
    for train in (TRAIN, TrainSpec.model_validate(TRAIN_PPO.model_dump())):
        assert translate.trainer_hparams(train).model_dump() == train.model_dump()


def test_run_setup_and_step_batch() -> None:
    inp = InitPolicyInput(
        run_id="r", store_uri="file:///s", seed=5,
        model=ModelSpec(init=ModelInitSpec(arch="llama", hidden_size=32, num_attention_heads=4, vocab_size=300)),
        sft=SFTSpec(steps=7, batch_size=3, lr=2e-3, grad_clip=0.5), train=TRAIN, dataset=DATASET,
        checkpoint=CheckpointSpec(every=2, keep_last=9), config_hash="abc", policy_version=4,
    )
    setup = translate.run_setup(inp)
    assert setup.model.model_dump() == inp.model.model_dump()
    assert setup.sft.model_dump() == inp.sft.model_dump()
    assert setup.hparams.model_dump() == TRAIN.model_dump()
    assert (setup.keep_last, setup.config_hash, setup.dataset_key, setup.seed) == (9, "abc", DATASET.key, 5)

    step = TrainStepInput(run_id="r", step=3, store_uri="file:///s", policy_version=2, chunk_keys=["a", "b"],
                          rewards_key="rw", group_size=4, train=TRAIN.model_copy(update={"lr": 9e-6}))
    batch = translate.step_batch(step)
    assert (batch.step, batch.policy_version, batch.chunk_keys, batch.rewards_key, batch.group_size) == (
        3, 2, ["a", "b"], "rw", 4)
    assert batch.hparams.lr == 9e-6  # the step's own settings (set_hparams), not the run's initial ones


def test_stored_records_from_before_a_knob_existed_read_as_the_old_trainer() -> None:
    """A step batch or checkpoint stored by an older version lacks the later knobs: they
    read as the values that reproduce that version (the run config's defaults)."""
    assert set(HPARAMS_ADDED_LATER) < set(TrainerHParams.model_fields)
    assert HPARAMS_ADDED_LATER == {k: TrainSpec().model_dump()[k] for k in HPARAMS_ADDED_LATER}
    step = TrainStepInput(run_id="r", step=3, store_uri="file:///s", policy_version=2, chunk_keys=["a"],
                          rewards_key="rw", group_size=4, train=TrainSpec(lr=2e-5))
    batch = translate.step_batch(step)
    old = json.loads(batch.model_dump_json())
    for key in HPARAMS_ADDED_LATER:
        del old["hparams"][key]
    assert stored_step_batch(json.dumps(old)) == batch
    assert stored_step_batch(batch.model_dump_json()) == batch
    assert stored_hparams(old["hparams"]) == batch.hparams
    with pytest.raises(ValueError):  # a live message must carry every field
        TrainerHParams.model_validate(old["hparams"])


def test_rollout_request() -> None:
    spec = RolloutSpec(prompts_per_step=3, group_size=5, chunk_size=6, max_new_tokens=9, temperature=0.7,
                       top_p=0.9, top_k=11)
    inp = RolloutInput(run_id="r", step=2, store_uri="file:///s", seed=8, policy_version=1, data_cursor=3,
                       dataset=DATASET, rollout=spec)
    req = translate.rollout_request(inp, n_rows=10)
    generation = spec.model_dump(exclude=translate.ROLLOUT_WORKFLOW_ONLY)
    assert dataclasses.asdict(req) == {"run_id": "r", "step": 2, "seed": 8, "policy_version": 1, "data_cursor": 3,
                                       "n_rows": 10, "round": 0, **generation}
    # a dynamic-sampling round draws its own number of prompts
    req = translate.rollout_request(inp.model_copy(update={"round": 2, "n_prompts": 7}), n_rows=10)
    assert (req.round, req.prompts_per_step, req.group_size) == (2, 7, 5)


def test_reward_settings_carry_every_field_with_the_kind_defaults() -> None:
    spec = RewardSpec(kind="weighted", terms=[
        RewardTerm(kind="gsm8k", weight=0.8, mode="flexible"),
        RewardTerm(kind="format", pattern="a.*", weight=0.2, name="fmt"),
        RewardTerm(kind="judge", url="http://127.0.0.1:1/j", concurrency=2, timeout_s=3.0),
        RewardTerm(kind="custom", function="m:f", error_policy="zero"),
    ])
    settings = translate.reward_settings(spec)
    assert settings.kind == "weighted" and settings.terms is not None
    assert [(t.name, t.weight) for t in settings.terms] == [("gsm8k", 0.8), ("fmt", 0.2), ("judge", 1.0), ("custom", 1.0)]
    gsm8k, fmt, judge, custom = settings.terms
    assert (gsm8k.mode, gsm8k.format_score, gsm8k.url) == ("flexible", 0.0, None)
    assert (fmt.pattern, fmt.format_score) == ("a.*", 1.0)
    assert (judge.url, judge.concurrency, judge.max_retries, judge.timeout_s, judge.batch_size) == (
        "http://127.0.0.1:1/j", 2, 5, 3.0, None)
    assert (custom.function, custom.error_policy) == ("m:f", "zero")
    plain = translate.reward_settings(RewardSpec(kind="http", url="https://rm/score"))
    assert (plain.batch_size, plain.max_retries, plain.terms) == (32, 5, None)
    assert [t.name for t in plain.term_list()] == ["http"]


def test_eval_request_and_result() -> None:
    inp = EvalInput(run_id="r", step=4, store_uri="file:///s", seed=8, policy_version=4, eval_key="e", k=5,
                    temperature=0.6, max_new_tokens=7, chunk_size=3)
    req = translate.eval_request(inp)
    assert dataclasses.asdict(req) == inp.model_dump(exclude={"store_uri", "eval_key", "epoch"})
    out = translate.eval_result(inp, EvalStats(greedy_accuracy=0.5, pass_at_k=0.75, k=5, n=8, seconds=1.5), [EVENT])
    assert out.model_dump(exclude={"node_events"}) == {
        "step": 4, "policy_version": 4, "greedy_accuracy": 0.5, "pass_at_k": 0.75, "k": 5, "n": 8, "seconds": 1.5}
    assert [e.kind for e in out.node_events] == ["engine_dead"]


EVENT = NodeEvent(at=0.0, kind="engine_dead", detail="slot 1: killed")


def test_results_carry_rebuild_and_events() -> None:
    res = TrainResult(policy_version=6, checksum="c", weights_key="w", metrics={"loss": 0.5}, seconds=1.25,
                      rebuild=Rebuild(restored_from_step=4, replayed_steps=[5]),
                      events=[NodeEvent(at=1.0, kind="checkpoint_corrupt", detail="step=5")])
    out = translate.train_step_result(res, [EVENT])
    assert (out.policy_version, out.checksum, out.weights_key, out.metrics, out.seconds) == (6, "c", "w", {"loss": 0.5}, 1.25)
    assert (out.restored_from_step, out.replayed_steps) == (4, [5])
    assert [e.kind for e in out.node_events] == ["engine_dead", "checkpoint_corrupt", "trainer_restored"]
    assert out.node_events[0] == RunEvent(at="1970-01-01T00:00:00+00:00", kind="engine_dead", detail="slot 1: killed")
    assert "checkpoint step 4, replayed steps [5] -> v5" in out.node_events[2].detail


def test_first_sft_is_not_a_restore_but_a_rebuild_from_sft_is() -> None:
    first = VersionInfo(policy_version=0, checksum="c", weights_key="w", model_path="p", sft_metrics={"sft_steps": 3},
                        rebuild=Rebuild(restored_from_step=None, replayed_steps=[]))
    info = translate.policy_info(first, [])
    assert info.node_events == [] and info.restored_from_step is None and info.sft_metrics == {"sft_steps": 3}
    lost = first.model_copy(update={"policy_version": 2, "rebuild": Rebuild(restored_from_step=None, replayed_steps=[1, 2])})
    (ev,) = translate.policy_info(lost, []).node_events
    assert ev.kind == "trainer_restored" and "no usable checkpoint" in ev.detail


def test_checkpoint_after_a_trainer_restart_reports_the_restore() -> None:
    saved = CheckpointSaved(step=4, key="k", durable=True, rebuild=Rebuild(restored_from_step=2, replayed_steps=[3, 4]))
    out = translate.checkpoint_result(saved, 0.5, [NodeEvent(at=2.0, kind="trainer_restarted", detail="pid 1")])
    assert (out.step, out.key, out.durable, out.seconds) == (4, "k", True, 0.5)
    assert [e.kind for e in out.node_events] == ["trainer_restarted", "trainer_restored"]


def test_run_setup_carries_lora_and_distill() -> None:
    inp = InitPolicyInput(
        run_id="r", store_uri="file:///s", seed=5,
        model=ModelSpec(path="/m", lora=LoraSpec(r=4, alpha=3.0, dropout=0.1, target_modules=["q_proj"], export="adapter")),
        sft=SFTSpec(), train=TRAIN, dataset=DATASET, checkpoint=CheckpointSpec(), config_hash="abc",
        distill=DistillSpec(teacher_path="/t", coef=0.5),
    )
    setup = translate.run_setup(inp)
    assert setup.model.lora is not None and setup.model.lora.model_dump() == inp.model.lora.model_dump()
    assert setup.distill is not None and setup.distill.model_dump() == {"teacher_path": "/t", "coef": 0.5}
    assert translate.run_setup(inp.model_copy(update={"distill": None})).distill is None
    step = TrainStepInput(run_id="r", step=3, store_uri="file:///s", policy_version=2, chunk_keys=[], rewards_key="",
                          group_size=4, train=TRAIN, sft_rows=SFTRowsInput(data_cursor=64, n_rows=32))
    batch = translate.step_batch(step)
    assert batch.sft is not None and (batch.sft.data_cursor, batch.sft.n_rows) == (64, 32)
    old = json.loads(batch.model_dump_json())
    del old["sft"]  # a step batch stored before SFT mode is an RL step
    assert stored_step_batch(json.dumps(old)).sft is None


def test_run_setup_carries_the_trainer_backend() -> None:
    inp = InitPolicyInput(
        run_id="r", store_uri="file:///s", seed=5, model=ModelSpec(), sft=SFTSpec(), train=TRAIN, dataset=DATASET,
        checkpoint=CheckpointSpec(), config_hash="abc", trainer=TrainerSpec(backend="fsdp2", ranks_per_cell=4, placement="spread",
                                                                         ray_address="10.0.0.2:6379", collective_timeout_s=9),
    )
    setup = translate.run_setup(inp)
    assert setup.trainer is not None and setup.trainer.model_dump() == {
        "backend": "fsdp2", "ranks_per_cell": 4, "placement": "spread", "ray_address": "10.0.0.2:6379",
        "collective_timeout_s": 9, "cells": 1, "cell_restart_backoff_s": 5.0, "cell_restart_backoff_max_s": 300.0}
    dp = translate.run_setup(inp.model_copy(update={"trainer": TrainerSpec(cells=3, cell_restart_backoff_s=1)}))
    assert dp.trainer is not None and (dp.trainer.cells, dp.trainer.cell_restart_backoff_s) == (3, 1.0)
    default = translate.run_setup(inp.model_copy(update={"trainer": TrainerSpec()}))
    assert default.trainer is not None and default.trainer.backend == "single"
    mg = translate.run_setup(inp.model_copy(update={"trainer": TrainerSpec(backend="megatron")}))
    assert mg.trainer is not None and mg.trainer.backend == "megatron"
