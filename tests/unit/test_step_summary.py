"""``summarize``: a step's ``StepSummary`` from hand-made phase results (no Temporal)."""

from __future__ import annotations

from spec.run import RunConfig
from spec.events import NodeClaimed
from spec.status import DPCellStatus, DPCells, EngineSlotInfo
from spec.train import TrainSpec
from workflows.contracts.cells import RestartCellsResult
from workflows.contracts.placement import DatasetInfo
from workflows.contracts.sampling import Sampled, SamplingStats
from workflows.contracts.step import RLStepInput
from workflows.contracts.training import CheckpointResult, EvalResult, TrainStepResult, UpdateWeightsResult
from workflows.step_summary import StepResults, summarize

INP = RLStepInput(run_id="r", step=3, config=RunConfig(), train=TrainSpec(), policy_version=2, data_cursor=8,
                  dataset=DatasetInfo(key="k", n_rows=100, sha256="0"), node_queue="node-a-1")


def ev(name: str) -> NodeClaimed:
    """An event told apart from the others by its field (any kind would do)."""
    return NodeClaimed(at="t", queue=name)


def batch(version: int, cursor: int, seconds: float = 1.0, **kw: object) -> Sampled:
    fields: dict = dict(chunk_keys=[f"c{cursor}"], rewards_key=f"r{cursor}", prompts=4, reward_mean=0.5, reward_std=0.25,
                        accuracy=0.75, reward_errors=1, response_len_mean=6.0, chunks_reused=2, engine_retries=1,
                        phases={"rollout": seconds, "reward": 0.5}, policy_version=version, data_cursor=cursor)
    return Sampled(**(fields | kw))


TRAINED = TrainStepResult(policy_version=3, checksum="s3", seconds=2.0, replayed_steps=[2],
                          restored_from_step=1, node_events=[ev("trained")],
                          metrics={"loss": 0.4, "kl": 0.01, "grad_norm": 0.9, "dp_cells": 1.0},
                          dp=DPCells(node="n", lighthouse_pid=1, cells=[DPCellStatus(index=0, pid=5, state="alive")]))
SYNCED = UpdateWeightsResult(policy_version=3, seconds=0.25, node_events=[ev("synced")],
                             engines=[EngineSlotInfo(slot=0, state="healthy", weight_version=3)])


def test_an_rl_step_with_every_phase() -> None:
    sampled = batch(1, 8, node_events=[ev("sampled")], agent={"episodes": 4.0},
                    sampling=SamplingStats(rounds=2, prompts_drawn=8, groups_generated=8, groups_kept=4,
                                           groups_filtered_all_correct=2, groups_filtered_all_wrong=2,
                                           groups_filtered_other=0, groups_trained=4, trained_reward_mean=0.5))
    later = [batch(1, 12), batch(2, 16, seconds=3.0)]
    s = summarize(StepResults(
        inp=INP, seconds=9.0, cursor=12, sampled=sampled, trained=TRAINED, synced=SYNCED,
        checkpoint=CheckpointResult(step=3, key="ck3", weights_key="w3", seconds=0.5, durable=True, node_events=[ev("saved")]),
        evaluated=EvalResult(step=3, policy_version=3, greedy_accuracy=0.5, pass_at_k=0.75, k=4, n=8, seconds=1.5,
                             node_events=[ev("evaluated")]),
        eval_events=[ev("eval_note")],
        restarted=RestartCellsResult(outcome={"1": "restarting"}, node_events=[ev("restarted")]),
        buffered=later[:1], sampled_ahead=later[1:],
    ))
    assert (s.step, s.policy_version, s.data_cursor, s.step_seconds) == (3, 3, 12, 9.0)
    assert (s.reward_mean, s.reward_std, s.accuracy, s.reward_errors) == (0.5, 0.25, 0.75, 1)
    assert (s.loss, s.kl, s.grad_norm, s.dp_cells) == (0.4, 0.01, 0.9, 1)
    assert (s.response_len_mean, s.chunks_reused, s.engine_retries) == (6.0, 2, 1)
    assert s.phase_seconds == {"rollout": 1.0, "reward": 0.5, "train": 2.0, "update_weights": 0.25, "checkpoint": 0.5,
                               "eval": 1.5}
    assert s.activity_seconds == 5.75
    assert (s.checkpointed, s.weights_key, s.restored_from_step, s.replayed_steps) == (True, "w3", 1, [2])
    assert [e.queue for e in s.events if isinstance(e, NodeClaimed)] == ["sampled", "trained", "synced", "saved", "evaluated", "eval_note", "restarted"]
    assert s.engines == SYNCED.engines and s.dp == TRAINED.dp and s.cell_restarts == {"1": "restarting"}
    assert (s.eval_greedy, s.eval_pass_at_k, s.eval_k, s.eval_n) == (0.5, 0.75, 4, 8)
    assert s.sampling == sampled.sampling and s.agent == {"episodes": 4.0}
    assert (s.rollout_version, s.staleness) == (1, 1)
    # the batches sampled ahead ran 3.5 s beside a 2 s train step: 2 s overlapped
    assert (s.overlap_seconds, s.buffer_depth, s.next_buffer) == (2.0, 2, later)


def test_an_sft_step_sampled_nothing() -> None:
    s = summarize(StepResults(inp=INP, seconds=4.0, cursor=13, trained=TRAINED, synced=SYNCED))
    assert (s.reward_mean, s.reward_std, s.accuracy, s.reward_errors, s.response_len_mean) == (0.0, 0.0, 0.0, 0, 0.0)
    assert s.phase_seconds == {"train": 2.0, "update_weights": 0.25, "checkpoint": 0.0}
    assert (s.checkpointed, s.eval_greedy, s.sampling, s.agent, s.cell_restarts) == (False, None, None, None, {})
    assert s.weights_key == ""  # not checkpointed: the store holds no folder of this version
    assert (s.rollout_version, s.staleness) == (2, 0)  # its rows are read at the version it trains from
    assert (s.overlap_seconds, s.buffer_depth, s.next_buffer) == (0.0, 0, [])
    assert [e.queue for e in s.events if isinstance(e, NodeClaimed)] == ["trained", "synced"]
