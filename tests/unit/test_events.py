"""The run's events (``spec.events``): each kind decodes as its own model from the JSON a
history or a result file holds, and ``spec.event_text`` has a sentence for every kind."""

from __future__ import annotations

import typing

import pytest
from pydantic import TypeAdapter, ValidationError

from spec import events as ev
from spec.event_text import event_text

EVENTS = TypeAdapter(list[ev.RunEvent])

ONE_OF_EACH: list[ev.RunEvent] = [
    ev.EngineDead(at="t", slot=1, pid=7, reason="process exited rc=-9"),
    ev.EngineHung(at="t", slot=1, reason="health_generate failed: timed out"),
    ev.EngineRestarted(at="t", slot=1, pid=8, model_path="/w/v3"),
    ev.EngineRecovered(at="t", slot=1, version="3"),
    ev.EngineChecksum(at="t", kind="checksum_ok", slot=0, version="3", checksum="abc"),
    ev.EngineChecksum(at="t", kind="checksum_ok", slot=0, version="3", checksum="abc", probed=True),
    ev.EngineChecksum(at="t", kind="checksum_mismatch", slot=0, checksum="abd", expected="abc"),
    ev.EngineChecksum(at="t", kind="checksum_mismatch", slot=0, version="3", mismatched=["lm_head.weight"]),
    ev.WeightSyncFallback(at="t", slot=1, version="3", error="timed out", trainer_error="nccl"),
    ev.WeightsReceived(at="t", version="3", slots=[0, 1], group="r/v3", nbytes=4096, seconds=0.25),
    ev.EngineAdded(at="t", slot=2, num_engines=3, port=30002),
    ev.EngineRemoved(at="t", slot=2, num_engines=2),
    ev.TrainerRestarted(at="t", old_pid=5, returncode=-9, pid=6),
    ev.TrainerRestored(at="t", restored_from_step=2, replayed_steps=[3, 4], version=4),
    ev.TrainerRestored(at="t", restored_from_step=None, replayed_steps=[1], version=1),
    ev.CheckpointUploadFailed(at="t", step=4, error="store down"),
    ev.CheckpointCorrupt(at="t", step=2, file="model.safetensors", stored_in="step_000002", expected="a",
                         actual="missing"),
    ev.DiskFull(at="t", node="node0", what="checkpoint 3", error="no space left"),
    ev.DiskFull(at="t", step=3, what="model folder", free_bytes=0, error="[Errno 28] No space left on device"),
    ev.StaleWriteRefused(at="t", node="n9", epoch=1, error="refused put x"),
    ev.CellStarted(at="t", generation=1, ranks=2, placement="spread", pids=[10, 11], ray_address="local"),
    ev.CellFailed(at="t", kind="cell_rank_died", generation=1, error_type="CellRankDied", message="rank 1 died"),
    ev.CellsStarted(at="t", pids=[10, 11], lighthouse_pid=9),
    ev.CellLost(at="t", cell=1, pid=11, why="died during train_step"),
    ev.CellRestartFailed(at="t", cell=1, error="did not start"),
    ev.CellRestarted(at="t", cell=1, old_pid=11, pid=12),
    ev.CellHealed(at="t", cell=1, held_version=0, copied_version=3, trained_version=4),
    ev.CellsDiverged(at="t", cells=[ev.CellVersion(cell=0, version=4, state_checksum="aa"),
                                    ev.CellVersion(cell=1, version=4, state_checksum="bb")], expected_version=4),
    ev.LighthouseRestarted(at="t", pid=13),
    ev.LighthouseRestartFailed(at="t", error="exited with 247"),
    ev.NodeClaimed(at="t", queue="node-a-1"),
    ev.NodeLost(at="t", queue="node-a-1", step=2, message="no liveness heartbeat"),
    ev.Divergence(at="t", step=2, message="loss is not finite"),
    ev.EvalFailed(at="t", step=0, message="eval split unreadable"),
    ev.EvalSkipped(at="t", why="data.eval_path is not set"),
    ev.DynamicFilterEmpty(at="t", step=2, rounds=3, groups_trained=4),
    ev.HParamsSet(at="t", values={"lr": 0.001, "tis_cap": None}),
    ev.EnginesSet(at="t", before=2, after=3),
    ev.Forked(at="t", parent="p", step=4),
]


def test_every_model_is_in_the_list() -> None:
    models = set(typing.get_args(typing.get_args(ev.RunEvent)[0]))
    assert models == {type(e) for e in ONE_OF_EACH}
    kinds = [k for m in models for k in typing.get_args(m.model_fields["kind"].annotation)]
    assert len(kinds) == len(set(kinds))  # one model per kind


def test_events_round_trip_as_their_own_models() -> None:
    back = EVENTS.validate_json(EVENTS.dump_json(ONE_OF_EACH))
    assert back == ONE_OF_EACH and [type(e) for e in back] == [type(e) for e in ONE_OF_EACH]


def test_a_kind_needs_its_fields() -> None:
    with pytest.raises(ValidationError):
        EVENTS.validate_python([{"at": "t", "kind": "cell_lost", "cell": 1}])  # no pid, no why
    with pytest.raises(ValidationError):
        EVENTS.validate_python([{"at": "t", "kind": "no_such_kind"}])


def test_every_event_has_a_sentence() -> None:
    texts = [event_text(e) for e in ONE_OF_EACH]
    assert all(texts) and len(set(texts)) == len(texts)


def test_the_sentences_say_the_fields() -> None:
    """The renderer's own test: the sentences ``milestone status`` prints."""
    assert event_text(ONE_OF_EACH[0]) == "slot 1: pid=7: process exited rc=-9"
    assert event_text(ev.TrainerRestored(at="t", restored_from_step=4, replayed_steps=[5], version=5)) == (
        "checkpoint step 4, replayed steps [5] -> v5")
    assert event_text(ev.NodeLost(at="t", queue="q", message="m")) == "q: m"
    assert event_text(ev.NodeLost(at="t", queue="q", step=3, message="m")) == "q during step 3: m"
    assert event_text(ev.HParamsSet(at="t", values={"lr": 0.001})) == '{"lr": 0.001}'
    assert event_text(ev.CellHealed(at="t", cell=1, held_version=0, copied_version=3, trained_version=4)) == (
        "cell 1 copied v3 from a peer (it held v0) and trained v4 with it")


def test_utc_now_is_iso_utc() -> None:
    assert ev.utc_now().endswith("+00:00")


def test_the_run_details_show_the_last_event() -> None:
    from workflows.run_details import run_details
    from workflows.run_state import RunState

    st = RunState(events=[ev.NodeClaimed(at="2026-01-01T00:00:00+00:00", queue="q"),
                          ev.EnginesSet(at="2026-01-01T00:00:05.5+00:00", before=2, after=3)])
    assert run_details("running", st, 3, []).endswith(
        "last event: 2026-01-01T00:00:05 engines_set: " + event_text(st.events[-1]))
    assert "last event" not in run_details("running", RunState(), 3, [])
