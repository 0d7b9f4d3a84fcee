"""Fault injection on a real fleet: 2 torch engines behind a real sglang-router."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime

import pytest

from gpu_runtime.engine.backends import TorchEngineBackend
from gpu_runtime.engine.client import EngineClient
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.fleet_types import HealthConfig, NoHealthyEngine, WeightMismatch
from gpu_runtime.engine.router import RouterProcess
from gpu_runtime.proc.processes import pid_alive
from spec.events import EngineEvent
from tests.engine_fixtures import free_port, free_port_block, model_dirs_fixture, wait_for  # noqa: F401

HEALTH = HealthConfig(interval_s=1.0, timeout_s=1.0, first_wait_s=60.0, failure_threshold=1)
BATCH = [[1, 5, 6, 7, 8], [1, 9], [1, 10, 11], [1, 12, 13, 14]]
SP = {"max_new_tokens": 40, "temperature": 1.0, "top_p": 0.9, "sampling_seed": 77}


def _make_fleet(model_dirs, tmp_path, *, with_router: bool) -> EngineFleet:
    router = RouterProcess(free_port(), [], log_path=tmp_path / "router.log") if with_router else None
    return EngineFleet(TorchEngineBackend(threads=1, step_delay_ms=25), 2, model_dirs["v1"], free_port_block(2),
                       tmp_path / "logs", router=router, health=HEALTH)


@pytest.fixture
def fleet(model_dirs, tmp_path) -> Iterator[EngineFleet]:
    f = _make_fleet(model_dirs, tmp_path, with_router=True)
    try:
        f.start()
        yield f
    finally:
        f.stop()  # kills every engine and the router by pid, even when the test failed


def _tokens(results: list[dict]) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def _kill_busy_engine_mid_chunk(fleet: EngineFleet) -> tuple[list[dict], int]:
    box: dict[str, object] = {}
    t = threading.Thread(target=lambda: box.update(out=fleet.generate_chunk(BATCH, SP)))
    t.start()
    clients = {s.slot: (EngineClient(s.url, timeout_s=5), s.pid) for s in fleet.snapshot()}

    def busy() -> int | None:
        for slot, (c, _) in clients.items():
            try:
                if c.server_info()["busy"]:
                    return slot + 1
            except Exception:  # noqa: BLE001
                pass
        return None

    slot = wait_for(busy, 30, "an engine to be decoding", interval_s=0.02) - 1
    os.kill(clients[slot][1], signal.SIGKILL)
    t.join(timeout=120)
    assert not t.is_alive()
    return box["out"][0], slot


def test_sigkill_mid_chunk_completes_with_identical_tokens(fleet) -> None:
    reference, _ = fleet.generate_chunk(BATCH, SP)
    out, slot = _kill_busy_engine_mid_chunk(fleet)
    assert _tokens(out) == _tokens(reference)
    assert [r["meta_info"]["output_token_logprobs"] for r in out] == \
           [r["meta_info"]["output_token_logprobs"] for r in reference]
    wait_for(lambda: fleet.snapshot()[slot].state == "empty", 10, "dead slot to be empty")
    assert any(e.kind == "engine_dead" and e.slot == slot for e in fleet.events)
    assert fleet.router.worker_urls() == {fleet.snapshot()[1 - slot].url}


def test_direct_mode_retries_same_request_on_survivor(model_dirs, tmp_path) -> None:
    f = _make_fleet(model_dirs, tmp_path, with_router=False)
    try:
        f.start()
        reference, _ = f.generate_chunk(BATCH, SP)
        out, slot = _kill_busy_engine_mid_chunk(f)
        assert _tokens(out) == _tokens(reference)
        assert f.snapshot()[slot].state == "empty"
    finally:
        f.stop()


def test_sigstop_is_detected_killed_and_healed(fleet, model_dirs) -> None:
    seen: list[EngineEvent] = []
    fleet.on_event = seen.append
    victim = fleet.snapshot()[0]
    t0 = time.time()
    os.kill(victim.pid, signal.SIGSTOP)
    ev = wait_for(lambda: next((e for e in seen if e.kind == "engine_dead" and e.slot == 0), None), 30, "engine_dead")
    latency = datetime.fromisoformat(ev.at).timestamp() - t0
    assert latency <= HEALTH.interval_s + HEALTH.timeout_s + 1.0, latency
    assert any(e.kind == "engine_hung" and e.slot == 0 for e in seen)
    with pytest.raises(ProcessLookupError):
        os.kill(victim.pid, 0)  # killed and reaped
    assert fleet.snapshot()[0].state == "empty"
    assert victim.url not in fleet.router.worker_urls()
    # a chunk still runs on the survivor
    fleet.generate_chunk(BATCH, {**SP, "max_new_tokens": 4})

    # gated recovery with the newest weights, then the weight update to everyone
    assert fleet.restart_empty_slots(model_dirs["v2"], 2) == [0]
    snap = fleet.snapshot()
    assert snap[0].state == "healthy" and snap[0].checksum == model_dirs["c2"] and snap[0].restart_count == 1
    assert snap[0].pid != victim.pid
    assert fleet.router.worker_urls() == {s.url for s in snap}
    assert fleet.update_weights(model_dirs["v2"], 2) == {0: model_dirs["c2"], 1: model_dirs["c2"]}
    assert {e.kind for e in seen} >= {"engine_restarted", "engine_recovered", "checksum_ok"}
    # the router sends the restarted engine traffic at once (no circuit-breaker wait)
    restarted = EngineClient(snap[0].url, timeout_s=10)
    for _ in range(4):
        out, _ = fleet.generate_chunk(BATCH, {**SP, "max_new_tokens": 4})
        assert out[0]["meta_info"]["weight_version"] == "2"
    assert restarted.server_info()["num_generate_requests"] >= 1


def test_all_engines_dead_then_recovery(fleet, model_dirs) -> None:
    reference, _ = fleet.generate_chunk(BATCH, SP)
    for s in fleet.snapshot():
        os.kill(s.pid, signal.SIGKILL)
    with pytest.raises(NoHealthyEngine):
        fleet.generate_chunk(BATCH, SP)
    assert all(s.state == "empty" for s in fleet.snapshot())
    assert sorted(fleet.restart_empty_slots()) == [0, 1]
    out, url = fleet.generate_chunk(BATCH, SP)
    assert url == fleet.router.url and _tokens(out) == _tokens(reference)


def test_restarted_slot_whose_port_was_taken_moves_to_a_free_port(fleet) -> None:
    """Another process binds a dead engine's port before the restart: the slot moves
    (new port, new router member) instead of failing to start forever."""
    reference, _ = fleet.generate_chunk(BATCH, SP)
    victim = fleet.snapshot()[0]
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: fleet.snapshot()[0].state == "empty", 30, "dead slot to be empty")
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the dead engine's port may be in TIME_WAIT
    squatter.bind(("127.0.0.1", int(victim.url.rsplit(":", 1)[1])))
    squatter.listen()
    try:
        assert fleet.restart_empty_slots() == [0]
        moved = fleet.snapshot()[0]
        assert moved.state == "healthy" and moved.url != victim.url
        assert fleet.router.worker_urls() == {s.url for s in fleet.snapshot()}
        out, _ = fleet.generate_chunk(BATCH, SP)
        assert _tokens(out) == _tokens(reference)
    finally:
        squatter.close()


def test_update_weights_reports_checksum_mismatch(fleet, model_dirs, tmp_path) -> None:
    bad = tmp_path / "tampered"
    shutil.copytree(model_dirs["v2"], bad)
    (bad / "milestone.json").write_text(json.dumps({"weight_version": 2, "checksum": "0" * 64}))
    with pytest.raises(WeightMismatch) as ei:
        fleet.update_weights(bad, 2)
    assert ei.value.slots == [0, 1]
    assert sum(e.kind == "checksum_mismatch" for e in fleet.events) == 2


def test_sampled_weight_probe_for_engines_without_a_checksum(model_dirs, tmp_path) -> None:
    """SGLang engines cannot hash their state; the fleet spot-checks sampled parameters via
    ``/get_weights_by_name`` instead. SGLang itself needs CUDA, so the torch engine (which
    serves the same route with SGLang's ``param[:truncate_size]`` semantics) stands in."""
    backend = TorchEngineBackend(threads=1)
    backend.supports_checksum = False
    fleet = EngineFleet(backend, 2, model_dirs["v1"], free_port_block(2), tmp_path / "logs", health=HEALTH)
    try:
        fleet.start()
        fleet.update_weights(model_dirs["v2"], 2)  # probe agrees with the folder the engines loaded
        assert sum(e.kind == "checksum_ok" for e in fleet.events) == 2
        # an engine that silently kept other weights is caught by the probe
        slot = fleet.slots[0]
        EngineClient(slot.url).update_weights_from_disk(str(model_dirs["v1"]), 2)
        assert fleet.supervisor.gate.probe_mismatch(slot, str(model_dirs["v2"]))
        assert not fleet.supervisor.gate.probe_mismatch(fleet.slots[1], str(model_dirs["v2"]))
        # a passing engine stands for the folder's checksum (update_weights compares it with the
        # trainer's); a restarted one is probed too before it rejoins
        fleet.kill_slot(0)
        assert fleet.restart_empty_slots(model_dirs["v2"], 2) == [0]
        assert [s.checksum for s in fleet.snapshot()] == [model_dirs["c2"]] * 2
    finally:
        fleet.stop()


def test_an_engine_whose_port_is_taken_while_it_starts_moves(model_dirs, tmp_path) -> None:
    """The fleet picks a free port, but another process may bind it while the engine loads
    its model (CI saw an outgoing connection's ephemeral port do so): the engine exits with
    EADDRINUSE and the slot moves to a new port instead of failing the fleet's start."""
    f = EngineFleet(TorchEngineBackend(threads=1), 1, model_dirs["v1"], free_port_block(1), tmp_path / "logs",
                    health=HEALTH)
    blocked = f.slots[0].port
    starter = threading.Thread(target=f.start)
    with socket.socket() as squatter:
        try:
            starter.start()
            wait_for(lambda: f.slots[0].proc is not None, 30, "the engine spawned")
            squatter.bind(("127.0.0.1", blocked))  # before the engine binds: it is still importing torch
            squatter.listen()
            starter.join(120)
            assert not starter.is_alive()
            (slot,) = f.snapshot()
            assert slot.state == "healthy" and slot.url != f"http://127.0.0.1:{blocked}", slot
            assert EngineClient(slot.url, timeout_s=5).health()
            assert b"Address already in use" in (tmp_path / "logs" / "engine-0.log").read_bytes()
        finally:
            f.stop()
            starter.join(30)


def test_resize_grows_with_verified_engines_and_shrinks_out_of_the_router(fleet, model_dirs) -> None:
    """engines.num_engines changed mid-run (``set_engines``): grow starts the new slots with the
    newest weights (checksum-gated, added to the router, no restart counted); shrink takes the
    highest slots out of the router, then stops them by pid. A chunk's tokens do not depend on
    how many engines share it."""
    reference, _ = fleet.generate_chunk(BATCH, SP)
    fleet.update_weights(model_dirs["v2"], 2)
    fleet.resize(3)
    assert fleet.restart_empty_slots() == [2]  # the node's ensure_engines does this after a resize
    snap = fleet.snapshot()
    assert [(s.state, s.weight_version, s.restart_count) for s in snap] == [("healthy", 2, 0)] * 3
    assert len({s.checksum for s in snap}) == 1
    assert fleet.router.worker_urls() == {s.url for s in snap}
    assert [e.kind for e in fleet.events if e.slot == 2] == ["engine_added", "engine_recovered"]
    on_three, _ = fleet.generate_chunk(BATCH, SP)
    gone = [s.pid for s in fleet.snapshot()[1:]]
    fleet.resize(1)
    assert [s.slot for s in fleet.snapshot()] == [0]
    assert fleet.router.worker_urls() == {fleet.snapshot()[0].url}
    wait_for(lambda: not any(pid_alive(p) for p in gone), 30, "the removed engines stopped")
    assert sorted(e.slot for e in fleet.events if e.kind == "engine_removed") == [1, 2]
    on_one, _ = fleet.generate_chunk(BATCH, SP)
    assert _tokens(on_one) == _tokens(on_three) != _tokens(reference)  # v2's tokens, whatever the fleet's size
