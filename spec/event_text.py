"""An event as a sentence: the one place a ``RunEvent`` becomes text (``milestone status``, the
run's details in the Temporal UI, the processes' logs). Everything else reads its fields."""

from __future__ import annotations

import json

from spec.events import (
    CellFailed, CellHealed, CellLost, CellRestarted, CellRestartFailed, CellsDiverged, CellsStarted, CellStarted,
    CheckpointCorrupt, CheckpointUploadFailed, DiskFull, Divergence, DynamicFilterEmpty, EngineAdded, EngineChecksum,
    EngineDead, EngineHung, EngineRecovered, EngineRemoved, EngineRestarted, EnginesSet, EvalFailed, EvalSkipped,
    Forked, HParamsSet, LighthouseRestarted, LighthouseRestartFailed, NodeClaimed, NodeLost, RunEvent,
    StaleWriteRefused, TrainerRestarted, TrainerRestored, WeightsReceived, WeightSyncFallback,
)


def event_text(ev: RunEvent) -> str:
    """What ``ev`` says, without its time and kind (``milestone status`` prints those before it)."""
    match ev:
        case EngineDead() | EngineHung() | EngineRestarted() | EngineRecovered() | EngineChecksum() \
                | WeightSyncFallback() | EngineAdded() | EngineRemoved():
            return f"slot {ev.slot}: {_engine(ev)}"
        case WeightsReceived():
            return (f"slots {ev.slots}: version={ev.version} from group {ev.group} "
                    f"({ev.nbytes / 1e6:.1f} MB each, {ev.seconds:.2f}s)")
        case TrainerRestarted():
            return f"pid {ev.old_pid} exited with {ev.returncode}; new pid {ev.pid}"
        case TrainerRestored():
            source = (f"checkpoint step {ev.restored_from_step}" if ev.restored_from_step is not None
                      else "no usable checkpoint: SFT warm-up")
            replayed = f", replayed steps {ev.replayed_steps}" if ev.replayed_steps else ""
            return f"{source}{replayed} -> v{ev.version}"
        case CheckpointUploadFailed():
            return f"checkpoint {ev.step} not durable (the previous durable one stays): {ev.error}"
        case CheckpointCorrupt():
            return (f"checkpoint {ev.step}: {ev.file} (in {ev.stored_in}) sha256 expected {ev.expected}, "
                    f"got {ev.actual}; trying the previous one")
        case DiskFull():
            if ev.step is not None:
                return f"checkpoint {ev.step}: {ev.what}: {ev.free_bytes} bytes free: {ev.error}; retried"
            return f"node {ev.node}: {ev.what}: {ev.error}; the run waits for space"
        case StaleWriteRefused():
            return f"node {ev.node} epoch {ev.epoch}: {ev.error}"
        case CellStarted():
            return (f"cell {ev.generation}: {ev.ranks} ranks, {ev.placement}, pids {ev.pids}, "
                    f"ray {ev.ray_address}")
        case CellFailed():
            return f"cell {ev.generation}: {ev.error_type}: {ev.message}"
        case _:
            return _dp(ev)


def _engine(ev: RunEvent) -> str:
    match ev:
        case EngineDead():
            return f"pid={ev.pid}: {ev.reason}"
        case EngineHung():
            return ev.reason
        case EngineRestarted():
            return f"pid={ev.pid} {ev.model_path}"
        case EngineRecovered():
            return f"version={ev.version}"
        case EngineChecksum():
            if ev.mismatched:
                return f"probe mismatch: {', '.join(ev.mismatched)}"
            version = "" if ev.version is None else f"version={ev.version} "  # None: after a restart
            probed = " (folder's; sampled parameters verified)" if ev.probed else ""
            expected = f", expected {ev.expected}" if ev.expected is not None else ""
            return f"{version}checksum={ev.checksum}{probed}{expected}"
        case WeightSyncFallback():
            trainer = f"; trainer: {ev.trainer_error}" if ev.trainer_error else ""
            return f"version={ev.version}: distributed push failed ({ev.error}{trainer}): loading from disk"
        case EngineAdded():
            return f"num_engines {ev.num_engines}: port {ev.port}"
        case EngineRemoved():
            return f"num_engines {ev.num_engines}"
    raise TypeError(f"not an engine event: {ev.kind}")


def _dp(ev: RunEvent) -> str:
    match ev:
        case CellsStarted():
            return f"{len(ev.pids)} DP cells, pids {ev.pids}, lighthouse pid {ev.lighthouse_pid}"
        case CellLost():
            return f"cell {ev.cell} (pid {ev.pid}): {ev.why}"
        case CellRestartFailed():
            return f"cell {ev.cell}: {ev.error}"
        case CellRestarted():
            return f"cell {ev.cell}: pid {ev.old_pid} -> {ev.pid}; heals from a peer at the next step"
        case CellHealed():
            return (f"cell {ev.cell} copied v{ev.copied_version} from a peer (it held v{ev.held_version}) "
                    f"and trained v{ev.trained_version} with it")
        case CellsDiverged():
            expected = "" if ev.expected_version is None else f" (expected v{ev.expected_version})"
            return (", ".join(f"cell {c.cell}: v{c.version} {c.state_checksum[:12]}" for c in ev.cells)
                    + expected)
        case LighthouseRestarted():
            return f"torchft lighthouse restarted as pid {ev.pid}"
        case LighthouseRestartFailed():
            return ev.error
        case _:
            return _run(ev)


def _run(ev: RunEvent) -> str:
    match ev:
        case NodeClaimed():
            return ev.queue if ev.role == "trainer" else f"{ev.queue} (rollout node)"
        case NodeLost():
            during = "" if ev.step is None else f" during step {ev.step}"
            role = "" if ev.role == "trainer" else " (rollout node)"
            return f"{ev.queue}{role}{during}: {ev.message}"
        case Divergence():
            return f"step {ev.step}: {ev.message}; paused (fix with `milestone set`, then resume)"
        case EvalFailed():
            return f"step {ev.step}: {ev.message}"
        case EvalSkipped():
            return f"no held-out split ({ev.why}): the run is not evaluated"
        case DynamicFilterEmpty():
            return (f"step {ev.step}: no group's rewards varied in {ev.rounds} rounds: trained on the first "
                    f"round's first {ev.groups_trained} groups as they were")
        case HParamsSet():
            return json.dumps(ev.values)
        case EnginesSet():
            return f"{ev.setting} {ev.before} -> {ev.after} from the next step"
        case Forked():
            return f"from {ev.parent} at step {ev.step}"
    raise TypeError(f"no text for event kind {ev.kind}")
