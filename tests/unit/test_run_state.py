"""``RunState.commit`` and ``RunState.summary``: the run's bookkeeping after each step,
from hand-made step summaries (no Temporal)."""

from __future__ import annotations

from datetime import datetime, UTC

from spec.events import NodeClaimed
from spec.status import CellInfo, DPCellStatus, DPCells, EngineSlotInfo
from spec.trainer import TrainerSpec
from workflows import cell_heal
from workflows.run_state import EVENTS_KEEP, HISTORY_KEEP, SUMMARY_STEPS, RunState
from workflows.contracts.sampling import Sampled
from workflows.contracts.step import StepSummary
from workflows.contracts.training import EvalResult

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
SPEC = TrainerSpec()
PROMPTS = 4


def step(n: int, **kw: object) -> StepSummary:
    fields: dict = dict(step=n, policy_version=n, data_cursor=PROMPTS * n, reward_mean=n / 10, reward_std=0.1,
                        accuracy=0.5, loss=1.0 / n, step_seconds=1.0, weights_key=f"w{n}",
                        events=[NodeClaimed(at="t", queue=f"e{n}")], engines=[EngineSlotInfo(slot=0, state="healthy")])
    return StepSummary(**(fields | kw))


def batch(version: int, cursor: int) -> Sampled:
    return Sampled(chunk_keys=[], rewards_key="", prompts=PROMPTS, reward_mean=0.0, reward_std=0.0, accuracy=0.0,
                   reward_errors=0, response_len_mean=0.0, chunks_reused=0, engine_retries=0, phases={},
                   policy_version=version, data_cursor=cursor)


def run(steps: int, state: RunState | None = None) -> RunState:
    st = state or RunState()
    for n in range(st.next_step, st.next_step + steps):
        st = st.commit(step(n), NOW, SPEC)
    return st


def test_commit_moves_the_cursor_and_the_version_and_leaves_the_old_state_as_it_was() -> None:
    before = RunState(buffer=[batch(0, 0)], events=[NodeClaimed(at="t", queue="placed")])
    cell = CellInfo(node="n", generation=1, placement="spread", ray_address="local", ranks=[])
    ahead = [batch(1, 8)]
    after = before.commit(step(1, cell=cell, next_buffer=ahead), NOW, SPEC)
    assert (after.next_step, after.policy_version, after.data_cursor) == (2, 1, PROMPTS)
    assert (after.buffer, after.cells) == (ahead, [cell])  # the buffer replaced, not appended to
    assert [e.queue for e in after.events if isinstance(e, NodeClaimed)] == ["placed", "e1"]
    assert after.engines == [EngineSlotInfo(slot=0, state="healthy")]
    assert after.first_rewards == [0.1]
    # the history keeps the step without what the state carries elsewhere
    kept = after.history[0]
    assert (kept.events, kept.engines, kept.cell, kept.next_buffer, kept.dp) == ([], [], None, [], None)
    assert kept.weights_key == "w1" and kept.reward_mean == 0.1
    assert before == RunState(buffer=[batch(0, 0)], events=[NodeClaimed(at="t", queue="placed")])  # pure


def test_history_events_and_first_rewards_are_bounded() -> None:
    st = run(HISTORY_KEEP + 3, RunState(events=[NodeClaimed(at="t", queue="old")] * EVENTS_KEEP))
    assert [s.step for s in st.history] == list(range(4, HISTORY_KEEP + 4))
    assert len(st.events) == EVENTS_KEEP and st.events[-1] == NodeClaimed(at="t", queue=f"e{HISTORY_KEEP + 3}")
    assert st.first_rewards == [n / 10 for n in range(1, SUMMARY_STEPS + 1)]


def test_dp_cells_lost_in_a_step_are_scheduled_and_an_unreported_step_keeps_the_schedule() -> None:
    dp = DPCells(node="n", lighthouse_pid=1, cells=[DPCellStatus(index=0, pid=5, state="alive"),
                                                    DPCellStatus(index=1, pid=6, state="lost")])
    spec = TrainerSpec(cells=2)
    st = RunState().commit(step(1, dp=dp), NOW, spec)
    assert st.dp == dp and st.cell_heal == cell_heal.after_step({}, dp, {}, NOW, spec)
    later = st.commit(step(2), NOW, spec)  # a step that reports no DP state changes neither
    assert (later.dp, later.cell_heal) == (st.dp, st.cell_heal)
    # a restart's outcome without new DP state: the schedule moves on, the last DP state stays
    restarted = later.commit(step(3, cell_restarts={"1": "restarting"}), NOW, spec)
    assert restarted.dp == dp and restarted.cell_heal == {}


def test_the_summary_compares_the_first_and_last_steps_and_names_the_last_eval() -> None:
    before = EvalResult(step=0, policy_version=0, greedy_accuracy=0.2, pass_at_k=0.4, k=2, n=8, seconds=1.0)
    st = run(3, RunState(eval_before=before))
    st = st.commit(step(4, eval_greedy=0.6, eval_pass_at_k=0.8, eval_k=2, eval_n=8), NOW, SPEC)
    st = run(4, st)
    s = st.summary("r")
    assert (s.run_id, s.steps, s.policy_version, s.data_cursor, s.final_weights_key) == ("r", 8, 8, 8 * PROMPTS, "w8")
    assert s.first_reward_mean == sum(n / 10 for n in range(1, 6)) / 5
    assert s.last_reward_mean == sum(n / 10 for n in range(4, 9)) / 5
    assert (s.eval_before_greedy, s.eval_before_pass_at_k) == (0.2, 0.4)
    assert (s.eval_step, s.eval_greedy, s.eval_pass_at_k, s.eval_k) == (4, 0.6, 0.8, 2)
    empty = RunState().summary("r")
    assert (empty.steps, empty.first_reward_mean, empty.final_weights_key, empty.eval_step) == (0, 0.0, "", None)
