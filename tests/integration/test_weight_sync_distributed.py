"""``engines.weight_sync: distributed`` across real processes (gloo, CPU): a real trainer
subprocess (``gpu_runtime.trainer.server``, brought to policy version 0 by its own SFT
warm-up) broadcasts the version from memory to two real torch engine servers through
SGLang's routes (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``), driven by the fleet as the node agent drives it.

- the engines report the trainer's checksum and generate bitwise what an engine that
  loaded the same version from disk generates;
- an engine SIGKILLed inside the broadcast (the trainer waits between the join and the
  first tensor: ``MILESTONE_FAULT_WEIGHT_BROADCAST_DELAY_S``) breaks the group: the push
  falls back to disk for the engines it did not reach (``weight_sync_fallback`` events),
  the survivor ends on the new version with the trainer's checksum, the dead engine is
  declared dead and the gated recovery restarts it on that version;
- the same with every tensor sent alone (SGLang's way, ``bucket_bytes`` 0): the
  survivor cannot have received the version before the trainer's send failed;
- a member that never joins fails the join within the stated timeout, not gloo's 30 min,
  and the engines keep serving their old weights.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_runtime.data.datasets import generate_arithmetic, write_jsonl
from gpu_runtime.engine.backends import TorchEngineBackend
from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine import weight_push
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.fleet_types import HealthConfig
from gpu_runtime.store import artifacts as art
from gpu_runtime.trainer.process import TrainerProcess
from gpu_runtime.weight_sync.distributed import folder_manifest
from spec.model import ModelSpec
from spec.run import CheckpointSpec
from spec.train import SFTSpec, TrainSpec
from spec.trainer import TrainerSpec
from spec.trainer_rpc import RunSetup, VersionInfo
from tests.engine_fixtures import free_port, free_port_block, model_dirs_fixture, procs_fixture, started_engine, wait_for  # noqa: F401

HEALTH = HealthConfig(interval_s=1.0, timeout_s=10.0, first_wait_s=120.0, failure_threshold=3)
PROMPTS = [[1, 5, 6, 7], [1, 9], [3, 4, 5]]
SP = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7}
RUN = "dsync"
BROADCAST_DELAY_S = 4.0  # the trainer's pause between the join and the first tensor (the kill lands there)
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def trainer(model_dirs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TrainerProcess, VersionInfo]]:
    """A trainer subprocess holding policy version 0 of a run over the tiny v1 model
    (one SFT step: its weights are neither v1's nor v2's)."""
    root = tmp_path_factory.mktemp("trainer")
    store = root / "store"
    key = art.dataset_key(RUN, "train")
    (store / key).parent.mkdir(parents=True)
    n = write_jsonl(generate_arithmetic(16, 0, 9, "+"), store / key)
    assert n == 16
    setup = RunSetup(
        run_id=RUN, store_uri=f"file://{store}", seed=3, model=ModelSpec(path=str(model_dirs["v1"])),
        sft=SFTSpec(steps=1, batch_size=4, lr=1e-2), hparams=TrainSpec(), dataset_key=key,
        keep_last=CheckpointSpec().keep_last, config_hash="dsync", distill=None, trainer=TrainerSpec(),
    )
    os.environ["MILESTONE_FAULT_WEIGHT_BROADCAST_DELAY_S"] = str(BROADCAST_DELAY_S)
    try:
        proc = TrainerProcess(root / "work", root / "trainer.log")
        proc.start()
    finally:
        del os.environ["MILESTONE_FAULT_WEIGHT_BROADCAST_DELAY_S"]
    try:
        info = proc.ensure_version(setup, 0)
        assert info.checksum not in (model_dirs["c1"], model_dirs["c2"])
        yield proc, info
    finally:
        proc.stop()


def _fleet(model_dirs, tmp_path: Path) -> EngineFleet:
    fleet = EngineFleet(TorchEngineBackend(threads=1), 2, model_dirs["v1"], free_port_block(2), tmp_path / "logs",
                        health=HEALTH, weight_version=1)
    fleet.start()
    return fleet


def test_trainer_broadcasts_a_version_to_two_engines(trainer, model_dirs, procs, tmp_path: Path) -> None:
    proc, info = trainer
    fleet = _fleet(model_dirs, tmp_path)
    try:
        out = fleet.update_weights(info.model_path, 0, "distributed", proc.broadcaster(RUN, TIMEOUT_S))
        assert out == {0: info.checksum, 1: info.checksum}
        assert fleet.last_push is not None and sorted(fleet.last_push.updated) == sorted(s.url for s in fleet.slots)
        assert fleet.last_push.trainer_error is None
        assert "weight_sync_fallback" not in [e.kind for e in fleet.events]
        for s in fleet.snapshot():
            assert (s.weight_version, s.checksum) == (0, info.checksum)
            assert "updated weights from distributed group" in (tmp_path / "logs" / f"engine-{s.slot}.log").read_text()
        # bitwise the tokens and logprobs of an engine that loaded the version from disk
        ref = started_engine(procs, Path(info.model_path), tmp_path / "ref.log", timeout_s=60, up_within_s=120,
                             what="reference engine up")
        assert ref.weights_checksum()[0] == info.checksum
        want = [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in ref.generate(PROMPTS, SP)]
        for s in fleet.snapshot():
            got = EngineClient(s.url, timeout_s=60).generate(PROMPTS, SP)
            assert [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in got] == want
        # a version the trainer does not hold is never broadcast: every engine loads it from disk
        out = fleet.update_weights(model_dirs["v2"], 2, "distributed", proc.broadcaster(RUN, TIMEOUT_S))
        assert out == {0: model_dirs["c2"], 1: model_dirs["c2"]}
        assert fleet.last_push is not None and not fleet.last_push.updated
        assert "the trainer holds v0" in (fleet.last_push.trainer_error or "")
        assert [e.slot for e in fleet.events if e.kind == "weight_sync_fallback"] == [0, 1]
    finally:
        fleet.stop()


@pytest.mark.parametrize("per_tensor", [False, True], ids=["packed", "per-tensor"])
def test_engine_killed_during_the_broadcast_falls_back_to_disk(
    per_tensor: bool, trainer, model_dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    proc, info = trainer
    if per_tensor:
        monkeypatch.setattr(weight_push, "DEFAULT_BUCKET_BYTES", 0)
    fleet = _fleet(model_dirs, tmp_path)
    logs = tmp_path / "logs"
    try:
        victim = fleet.slots[1].proc
        assert victim is not None

        def kill_when_receiving() -> bool:
            if all("receiving" in (logs / f"engine-{i}.log").read_text() for i in (0, 1)):
                os.kill(victim.pid, signal.SIGKILL)
                return True
            return False

        killer = threading.Thread(target=lambda: wait_for(kill_when_receiving, 120, "engines inside the broadcast"))
        killer.start()
        try:
            out = fleet.update_weights(info.model_path, 0, "distributed", proc.broadcaster(RUN, TIMEOUT_S))
        finally:
            killer.join()
        assert out == {0: info.checksum}  # the survivor, with the trainer's checksum
        push = fleet.last_push
        assert push is not None and fleet.slots[1].url in push.failed
        kinds = [(e.kind, e.slot) for e in fleet.events]
        assert ("weight_sync_fallback", 1) in kinds and ("engine_dead", 1) in kinds
        # the survivor got the whole version by broadcast before the trainer's send to the
        # dead engine failed (the tiny model is one 4 MiB bucket), or else from disk
        survivor_log = (logs / "engine-0.log").read_text()
        if per_tensor:  # the trainer failed at its first tensors: nobody got the whole version
            assert push.updated == []
        if fleet.slots[0].url in push.updated:
            assert ("weight_sync_fallback", 0) not in kinds
            assert "updated weights from distributed group" in survivor_log
        else:
            assert ("weight_sync_fallback", 0) in kinds
            assert f"updated weights from {Path(info.model_path).resolve()} version=0" in survivor_log
        snap = fleet.snapshot()
        assert (snap[0].state, snap[0].weight_version, snap[0].checksum) == ("healthy", 0, info.checksum)
        assert snap[1].state == "empty"
        # the survivor served its old version until the new one was whole; now the gated
        # recovery restarts the dead engine on the new version, as after any engine death
        assert fleet.restart_empty_slots() == [1]
        snap = fleet.snapshot()
        assert [(s.state, s.weight_version, s.checksum) for s in snap] == [("healthy", 0, info.checksum)] * 2
    finally:
        fleet.stop()


def test_a_member_that_never_joins_times_out_and_weights_stay(model_dirs, procs, tmp_path: Path) -> None:
    """World size 3, but only one engine joins (no trainer, no second engine): the join
    fails after the stated timeout with a clear error, and the engine keeps v1."""
    c = started_engine(procs, model_dirs["v1"], tmp_path / "engine.log", timeout_s=60, up_within_s=120)
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        c.init_weights_update_group(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=3,
                                    group_name="lonely", backend="gloo", timeout_s=3.0)
    assert err.value.status == 400 and "timeout 3s" in str(err.value)
    assert time.monotonic() - t0 < 60  # bounded by the stated timeout, far below gloo's 30 minutes
    manifest = folder_manifest(model_dirs["v2"])
    with pytest.raises(EngineError, match="no weight update group 'lonely'"):
        c.update_weights_from_distributed(**manifest.as_request(), group_name="lonely", version=2)
    assert c.weights_checksum() == (model_dirs["c1"], "1")
    assert c.destroy_weights_update_group("lonely")["success"] is True


def test_sglang_shaped_requests_and_the_probe_gate(trainer, model_dirs, tmp_path: Path) -> None:
    """What the fleet sends an SGLang engine (``supports_checksum`` off: SGLang's fields
    only, no ``checksum`` nor ``timeout_s``), answered by the torch engine, gated by the
    sampled-parameter probe as SGLang engines are. SGLang itself needs CUDA (not here)."""
    proc, info = trainer
    backend = TorchEngineBackend(threads=1)
    backend.supports_checksum = False
    fleet = EngineFleet(backend, 2, model_dirs["v1"], free_port_block(2), tmp_path / "logs", health=HEALTH,
                        weight_version=1)
    try:
        fleet.start()
        fleet.update_weights(info.model_path, 0, "distributed", proc.broadcaster(RUN, TIMEOUT_S))
        assert fleet.last_push is not None and len(fleet.last_push.updated) == 2, fleet.last_push
        assert sum(e.kind == "checksum_ok" for e in fleet.events) == 2
        for s in fleet.slots:
            assert EngineClient(s.url).weights_checksum() == (info.checksum, "0")
    finally:
        fleet.stop()
