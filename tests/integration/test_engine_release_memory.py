"""``engines.release_memory`` on real torch engine subprocesses: SGLang's
``/release_memory_occupation`` and ``/resume_memory_occupation``, a weight update while
released, and an engine SIGKILLed while released. On the CPU nothing is freed, but the
weights really leave the module and come back (a copy each way), so what is checked
here (refusal, health, bitwise generation and checksum after resume, recovery) is the
CUDA code path; the memory itself is checked by the gpu-marked test_release_memory_cuda.py."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_runtime.engine.backends import TorchEngineBackend
from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.fleet_types import HealthConfig
from tests.engine_fixtures import free_port_block, model_dirs_fixture, procs_fixture, started_engine, wait_for  # noqa: F401

PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 10, 11]]
SP = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "sampling_seed": 11}
HEALTH = HealthConfig(interval_s=0.5, timeout_s=5.0, first_wait_s=120.0, failure_threshold=1)


def _gen(c: EngineClient) -> list[tuple[list[int], list]]:
    return [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in c.generate(PROMPTS, SP)]


@pytest.fixture
def engine(model_dirs, procs, tmp_path: Path) -> Iterator[EngineClient]:
    c = started_engine(procs, model_dirs["v1"], tmp_path / "engine.log", timeout_s=120, up_within_s=120)
    yield c
    c.close()


def test_release_refuses_generation_and_resume_is_bitwise(engine: EngineClient, model_dirs) -> None:
    before = _gen(engine)
    assert engine.weights_checksum() == (model_dirs["c1"], "1")
    out = engine.release_memory_occupation()
    assert out["success"] and out["released"] == ["kv_cache", "weights"] and out["weight_bytes"] > 0
    with pytest.raises(EngineError) as refused:
        engine.generate(PROMPTS, SP)
    assert refused.value.status == 503
    assert "memory is released" in str(refused.value) and "/resume_memory_occupation" in str(refused.value)
    # asleep, not dead: both probes the fleet and the router use answer 200, saying so
    assert engine._request("GET", "/health")["status"] == "released"
    assert engine._request("GET", "/health_generate")["status"] == "released"
    assert engine.server_info()["memory_occupation"]["released"] == ["kv_cache", "weights"]
    engine.release_memory_occupation()  # idempotent
    resumed = engine.resume_memory_occupation()
    assert resumed["released"] == [] and resumed["checksum"] == model_dirs["c1"]
    assert engine.weights_checksum() == (model_dirs["c1"], "1")
    assert engine._request("GET", "/health")["status"] == "ok"
    assert _gen(engine) == before  # same seed, same tokens and logprobs, bitwise


def test_partial_tags_and_bad_tags(engine: EngineClient) -> None:
    before = _gen(engine)
    engine.release_memory_occupation(["kv_cache"])
    with pytest.raises(EngineError) as refused:
        engine.generate(PROMPTS, SP)
    assert refused.value.status == 503 and "kv_cache" in str(refused.value)
    engine.resume_memory_occupation(["kv_cache"])
    assert _gen(engine) == before
    with pytest.raises(EngineError) as bad:
        engine.release_memory_occupation(["optimizer"])
    assert bad.value.status == 400 and "tags must be" in str(bad.value)
    assert engine.server_info()["memory_occupation"]["released"] == []


def test_weight_update_while_released_is_served_after_resume(engine: EngineClient, model_dirs) -> None:
    """The update lands in the host copy; the resume brings that version to the device."""
    engine.release_memory_occupation()
    engine.update_weights_from_disk(str(model_dirs["v2"]), 2)
    assert engine.weights_checksum() == (model_dirs["c2"], "2")
    with pytest.raises(EngineError) as refused:
        engine.generate(PROMPTS, SP)
    assert refused.value.status == 503
    assert engine.resume_memory_occupation()["checksum"] == model_dirs["c2"]
    after_resume = _gen(engine)
    engine.update_weights_from_disk(str(model_dirs["v2"]), 2)  # the plain path, for reference
    assert engine.weights_checksum() == (model_dirs["c2"], "2")
    assert _gen(engine) == after_resume


def _fleet(model_dirs, tmp_path: Path, health: HealthConfig) -> Iterator[EngineFleet]:
    f = EngineFleet(TorchEngineBackend(threads=1), 2, model_dirs["v1"], free_port_block(2), tmp_path / "logs",
                    health=health, weight_version=1)
    try:
        f.start()
        yield f
    finally:
        f.stop()  # every engine by pid, even when the test failed


@pytest.fixture
def fleet(model_dirs, tmp_path: Path) -> Iterator[EngineFleet]:
    yield from _fleet(model_dirs, tmp_path, HEALTH)


@pytest.fixture
def quiet_fleet(model_dirs, tmp_path: Path) -> Iterator[EngineFleet]:
    """Its monitor sweeps once an hour: a dead engine is found by the next call, not a probe."""
    yield from _fleet(model_dirs, tmp_path, HEALTH.model_copy(update={"interval_s": 3600.0}))


def test_fleet_keeps_released_engines_and_restarts_one_killed_while_released(fleet: EngineFleet, model_dirs) -> None:
    """The train phase: both engines released, health sweeps leave them alone; one is
    SIGKILLed; the update_weights phase resumes the survivor, restarts the dead slot on
    the new version and pushes it: both serve v2, checksum-verified."""
    assert sorted(fleet.release_memory()) == [0, 1] and fleet.released
    for _ in range(3):
        fleet.check_now()  # probes answer "released": nobody is declared dead
    assert [s.state for s in fleet.snapshot()] == ["healthy", "healthy"]
    assert not [e for e in fleet.events if e.kind == "engine_dead"]
    victim = fleet.snapshot()[0]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: fleet.snapshot()[0].state == "empty", 60, "the monitor to reap the engine killed while released")
    assert fleet.resume_memory() == [1] and not fleet.released
    assert fleet.restart_empty_slots(model_dirs["v2"], 2) == [0]
    assert fleet.update_weights(model_dirs["v2"], 2) == {0: model_dirs["c2"], 1: model_dirs["c2"]}
    slots = fleet.snapshot()
    assert [(s.state, s.weight_version, s.checksum) for s in slots] == [("healthy", 2, model_dirs["c2"])] * 2
    assert slots[0].pid != victim.pid and slots[0].restart_count == 1
    gens = [_gen(EngineClient(s.url, timeout_s=120)) for s in slots]
    assert gens[0] == gens[1]  # the restarted engine and the resumed one serve the same weights


def test_fleet_declares_an_engine_that_cannot_resume_dead(quiet_fleet: EngineFleet, model_dirs) -> None:
    """Killed while released and not yet reaped by the monitor: the resume fails, the slot
    is declared dead, and the gated recovery restarts it with the served version."""
    fleet = quiet_fleet
    fleet.release_memory()
    victim = fleet.snapshot()[1]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: fleet.slots[1].proc is not None and fleet.slots[1].proc.poll() is not None, 30, "engine gone")
    assert fleet.resume_memory() == [0]
    assert [s.state for s in fleet.snapshot()] == ["healthy", "empty"]
    assert fleet.restart_empty_slots() == [1]
    assert [(s.state, s.weight_version, s.checksum) for s in fleet.snapshot()] == [("healthy", 1, model_dirs["c1"])] * 2
