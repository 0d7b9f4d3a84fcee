"""Fault hooks: the test-only environment variables that hold a process at a chosen point
(so a kill, a stop or a full disk lands there) or make one write fail.

Every hook is declared once, in ``HOOKS`` (its variable, the format of its value, where it
fires, what it does; docs/fault-tolerance.md, "Fault injection", shows the same table), and
read by one parser (:func:`parse`) into typed values (:class:`Faults`). The production code
calls the small functions at the end of this module at each hook point; none of it reads
these variables itself. A malformed value fails the first hook that reads it with a
:class:`FaultSpecError` naming the variable. Unset or empty: the hook does nothing.

The variables are read when a hook fires, not once at import: a test sets them on an
in-process trainer or cell between calls. Parsing is cached by the variables' values.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args

log = logging.getLogger(__name__)

DelayPoint = Literal["train", "checkpoint", "upload", "weight_broadcast"]
CellPoint = Literal["allreduce", "quorum"]
EnospcPhase = Literal["checkpoint"]
UPLOAD_GATE_TIMEOUT_S = 600.0  # an upload gate holds the write at most this long
GATE_POLL_S = 0.05


class FaultSpecError(ValueError):
    """A fault variable's value does not parse: ``variable`` names it, ``value`` is what it held."""

    def __init__(self, variable: str, value: str, reason: str, expected: str) -> None:
        super().__init__(f"{variable}={value!r}: {reason} (expected {expected})")
        self.variable = variable
        self.value = value


@dataclass(frozen=True, kw_only=True)
class UploadGate:
    """``MILESTONE_FAULT_UPLOAD_GATE``: a checkpoint's background write waits for ``file``."""

    file: Path
    step: int | None = None  # only checkpoint ``step``'s write; None: every one

    def holds(self, step: int | None) -> bool:
        return self.step is None or step is None or self.step == step


@dataclass(frozen=True, kw_only=True)
class CellDelay:
    """One entry of ``MILESTONE_FAULT_CELL_DELAY``."""

    cell: int
    seconds: float
    version: int | None = None  # only in the step that makes this version; None (``*``): every step
    where: CellPoint = "allreduce"

    def fires(self, cell: int, version: int, where: CellPoint) -> bool:
        return self.cell == cell and self.where == where and self.version in (None, version)


@dataclass(frozen=True, kw_only=True)
class Enospc:
    """``MILESTONE_FAULT_ENOSPC``: ``phase`` at ``step`` fails with ENOSPC while ``gate`` exists."""

    phase: EnospcPhase
    step: int
    gate: Path


@dataclass(frozen=True, kw_only=True)
class Faults:
    """Every hook's value; the defaults do nothing."""

    train_delay_s: float = 0.0
    checkpoint_delay_s: float = 0.0
    upload_delay_s: float = 0.0
    upload_gate: UploadGate | None = None
    weight_broadcast_delay_s: float = 0.0
    cell_delays: tuple[CellDelay, ...] = ()
    cell_gate: Path | None = None
    enospc: Enospc | None = None
    engine_step_delay_ms: float = 0.0


# ---- the value formats: each raises ValueError with the reason ----------------------------
def _duration(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError("not a finite number >= 0")
    return value


def _count(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{what} {value} is negative")
    return value


def _file(text: str) -> Path:
    if not text:
        raise ValueError("no file named")
    return Path(text)


def _upload_gate(text: str) -> UploadGate:
    step, _, file = text.rpartition(":")
    return UploadGate(file=_file(file), step=_count(step, "step") if step else None)


def _cell_delay(entry: str) -> CellDelay:
    parts = entry.split(":")
    if not 2 <= len(parts) <= 4:
        raise ValueError(f"entry {entry!r} has {len(parts)} fields, not 2 to 4")
    cell, seconds = parts[:2]
    version = parts[2] if len(parts) > 2 else "*"
    where = parts[3] if len(parts) > 3 else "allreduce"
    if where not in get_args(CellPoint):
        raise ValueError(f"entry {entry!r}: where {where!r} is not one of {', '.join(get_args(CellPoint))}")
    return CellDelay(cell=_count(cell, "cell"), seconds=_duration(seconds),
                     version=None if version == "*" else _count(version, "version"), where=cast(CellPoint, where))


def _cell_delays(text: str) -> tuple[CellDelay, ...]:
    return tuple(_cell_delay(entry) for entry in text.split(",") if entry)


def _enospc(text: str) -> Enospc:
    parts = text.split(":", 2)
    if len(parts) != 3:
        raise ValueError("not three fields")
    phase, step, gate = parts
    if phase not in get_args(EnospcPhase):
        raise ValueError(f"phase {phase!r} is not one of {', '.join(get_args(EnospcPhase))}")
    return Enospc(phase=cast(EnospcPhase, phase), step=_count(step, "step"), gate=_file(gate))


@dataclass(frozen=True, kw_only=True)
class Hook:
    """One fault variable: ``field`` of :class:`Faults` holds its parsed value."""

    variable: str
    field: str
    format: str
    fires: str
    effect: str
    convert: Callable[[str], Any]


HOOKS: tuple[Hook, ...] = (
    Hook(variable="MILESTONE_ENGINE_STEP_DELAY_MS", field="engine_step_delay_ms", format="<milliseconds>",
         fires="node agent, starting a torch engine (its --step-delay-ms)",
         effect="the engine sleeps this long per decode step, so a kill lands mid-rollout", convert=_duration),
    Hook(variable="MILESTONE_FAULT_TRAIN_DELAY_S", field="train_delay_s", format="<seconds>",
         fires="trainer process, each train_step after step_batch.json is written",
         effect="sleeps this long, so a kill lands inside the step", convert=_duration),
    Hook(variable="MILESTONE_FAULT_CHECKPOINT_DELAY_S", field="checkpoint_delay_s", format="<seconds>",
         fires="trainer process, each checkpoint call before it saves",
         effect="sleeps this long, so a kill lands inside the checkpoint", convert=_duration),
    Hook(variable="MILESTONE_FAULT_UPLOAD_DELAY_S", field="upload_delay_s", format="<seconds>",
         fires="trainer process, a checkpoint's background write before its files exist",
         effect="sleeps this long, so a kill lands inside the write", convert=_duration),
    Hook(variable="MILESTONE_FAULT_UPLOAD_GATE", field="upload_gate", format="[<step>:]<file>",
         fires="trainer process, a checkpoint's background write (of checkpoint <step> only, with one)",
         effect="waits until <file> exists (at most 10 minutes)", convert=_upload_gate),
    Hook(variable="MILESTONE_FAULT_WEIGHT_BROADCAST_DELAY_S", field="weight_broadcast_delay_s", format="<seconds>",
         fires="trainer process, each broadcast_weights (engines.weight_sync: distributed) after every member "
               "joined the push's group, before the first tensor",
         effect="sleeps this long, so an engine kill lands inside the broadcast", convert=_duration),
    Hook(variable="MILESTONE_FAULT_CELL_DELAY", field="cell_delays",
         format="<cell>:<seconds>[:<version>[:<where>]], comma-separated",
         fires="DP cell <cell> (trainer.cells >= 2), in the step that makes <version> (* or omitted: every step), "
               "before its allreduce (<where> allreduce, the default) or before it asks for the quorum (quorum)",
         effect="logs 'fault delay before the <where> of v<version>' and sleeps <seconds>, so a cell or "
                "lighthouse kill lands there", convert=_cell_delays),
    Hook(variable="MILESTONE_FAULT_CELL_GATE", field="cell_gate", format="<file>",
         fires="with MILESTONE_FAULT_CELL_DELAY",
         effect="a cell delay ends as soon as <file> exists (<seconds> the most it waits)", convert=_file),
    Hook(variable="MILESTONE_FAULT_ENOSPC", field="enospc", format="checkpoint:<step>:<file>",
         fires="trainer process, the checkpoint call of version <step>",
         effect="fails with a real OSError(ENOSPC) while <file> exists", convert=_enospc),
)
VARIABLES = tuple(h.variable for h in HOOKS)


def parse(env: Mapping[str, str]) -> Faults:
    """The hooks' values in ``env``; raises :class:`FaultSpecError` naming a malformed one."""
    values: dict[str, Any] = {}
    for hook in HOOKS:
        text = env.get(hook.variable, "")
        if not text:
            continue
        try:
            values[hook.field] = hook.convert(text)
        except ValueError as err:
            raise FaultSpecError(hook.variable, text, str(err), hook.format) from None
    return Faults(**values)  # each field's value as its hook's converter returns it


def current() -> Faults:
    """The hooks as this process's environment sets them now."""
    return _parsed(tuple(os.environ.get(v, "") for v in VARIABLES))


@functools.lru_cache(maxsize=16)
def _parsed(values: tuple[str, ...]) -> Faults:
    return parse(dict(zip(VARIABLES, values, strict=True)))


def _wait_for(file: Path, at_most_s: float) -> None:
    deadline = time.monotonic() + at_most_s
    while not file.exists() and time.monotonic() < deadline:
        time.sleep(GATE_POLL_S)


# ---- the hook points -----------------------------------------------------------------------
def delay(point: DelayPoint, step: int | None = None) -> None:
    """The trainer process at ``point``: sleep ``MILESTONE_FAULT_<POINT>_DELAY_S``; at ``upload``
    (checkpoint ``step``'s background write) also wait for ``MILESTONE_FAULT_UPLOAD_GATE``."""
    now = current()
    seconds = {"train": now.train_delay_s, "checkpoint": now.checkpoint_delay_s,
               "upload": now.upload_delay_s, "weight_broadcast": now.weight_broadcast_delay_s}[point]
    if seconds > 0:
        log.info("fault injection: waiting %.1fs at %s", seconds, point)
        time.sleep(seconds)
    gate = now.upload_gate
    if point == "upload" and gate is not None and gate.holds(step):
        _wait_for(gate.file, UPLOAD_GATE_TIMEOUT_S)


def cell_delay(cell: int, version: int, where: CellPoint = "allreduce") -> None:
    """DP cell ``cell`` in the step that makes ``version``, before ``where``: each matching
    ``MILESTONE_FAULT_CELL_DELAY`` entry in turn (the log line is what tests wait for)."""
    now = current()
    for entry in now.cell_delays:
        if entry.fires(cell, version, where):
            log.warning("fault delay before the %s of v%d: %g s", where, version, entry.seconds)
            if now.cell_gate is None:
                time.sleep(entry.seconds)
            else:
                _wait_for(now.cell_gate, entry.seconds)


def enospc(phase: EnospcPhase, step: int) -> None:
    """Raise ``OSError(ENOSPC)`` when ``MILESTONE_FAULT_ENOSPC`` names ``phase`` and ``step``
    and its gate file exists (a test removes it: space has returned)."""
    spec = current().enospc
    if spec is not None and spec.phase == phase and spec.step == step and spec.gate.exists():
        raise OSError(errno.ENOSPC, f"No space left on device (injected by MILESTONE_FAULT_ENOSPC while "
                                    f"{spec.gate} exists)")


def engine_step_delay_ms() -> float:
    """``MILESTONE_ENGINE_STEP_DELAY_MS``: the torch engines' sleep per decode step (0: none)."""
    return current().engine_step_delay_ms
