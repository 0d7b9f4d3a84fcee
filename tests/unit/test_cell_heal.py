"""The DP cells' restart schedule (workflows/cell_heal.py) and the trainer.cells config checks."""

from __future__ import annotations

from datetime import datetime, timedelta, UTC

import pytest
from pydantic import ValidationError

from spec.run import RunConfig
from spec.status import DPCellStatus, DPCells
from spec.trainer import TrainerSpec
from tests.stack import tiny_config
from workflows import cell_heal

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
SPEC = TrainerSpec(cells=2)  # 5 s * 2^k, capped at 300 s


def _dp(*states: str) -> DPCells:
    return DPCells(node="n", lighthouse_pid=1, cells=[DPCellStatus(index=i, pid=100 + i, state=s)
                                                       for i, s in enumerate(states)])


def test_backoff_doubles_from_5_s_and_caps_at_300_s() -> None:
    assert [cell_heal.backoff_s(k, SPEC) for k in range(8)] == [5, 10, 20, 40, 80, 160, 300, 300]
    assert cell_heal.backoff_s(3, TrainerSpec(cells=2, cell_restart_backoff_s=1, cell_restart_backoff_max_s=6)) == 6


def test_a_lost_cell_is_due_after_the_backoff_and_not_before() -> None:
    heal = cell_heal.after_step({}, _dp("alive", "lost"), {}, T0, SPEC)
    assert set(heal) == {"1"} and heal["1"].failures == 0
    assert cell_heal.due(heal, T0) == []
    assert cell_heal.due(heal, T0 + timedelta(seconds=4.9)) == []
    assert cell_heal.due(heal, T0 + timedelta(seconds=5)) == [1]
    # another step that still reports it lost does not push its restart back
    again = cell_heal.after_step(heal, _dp("alive", "lost"), {}, T0 + timedelta(seconds=3), SPEC)
    assert again == heal


def test_failed_restarts_back_off_and_a_recovery_clears_the_cell() -> None:
    heal = cell_heal.after_step({}, _dp("alive", "lost"), {}, T0, SPEC)
    t = T0 + timedelta(seconds=5)
    waits = []
    for _ in range(4):  # restarts that fail: 10, 20, 40, 80 s
        heal = cell_heal.after_step(heal, _dp("alive", "lost"), {"1": "failed: boom"}, t, SPEC)
        waits.append(heal["1"].due_at - t.timestamp())
        t = datetime.fromtimestamp(heal["1"].due_at, UTC)
    assert waits == [10, 20, 40, 80] and heal["1"].failures == 4
    assert heal["1"].lost_at == T0.isoformat()  # when the run learnt of the loss, kept across retries
    assert cell_heal.after_step(heal, _dp("alive", "alive"), {"1": "restarted"}, t, SPEC) == {}
    assert cell_heal.after_step(heal, _dp("alive", "alive"), {"1": "alive"}, t, SPEC) == {}


def test_a_cell_lost_again_in_the_step_it_rejoined_counts_as_a_failed_restart() -> None:
    heal = cell_heal.after_step({}, _dp("alive", "lost"), {}, T0, SPEC)
    heal = cell_heal.after_step(heal, _dp("alive", "lost"), {"1": "restarted"}, T0 + timedelta(seconds=6), SPEC)
    assert heal["1"].failures == 1 and heal["1"].due_at == (T0 + timedelta(seconds=16)).timestamp()
    # a cell lost later, after it had recovered, starts over at 5 s
    heal = cell_heal.after_step({}, _dp("lost", "alive"), {}, T0, SPEC)
    assert heal["0"].failures == 0


def test_cells_config_is_checked_before_the_run() -> None:
    base = tiny_config(__import__("pathlib").Path("/tmp/s"))
    RunConfig.model_validate({**base, "trainer": {"cells": 2}})
    for trainer, extra, needle in (
        ({"cells": 2, "backend": "fsdp2", "ranks_per_cell": 2}, {}, "needs backend single"),
        ({"cells": 2}, {"train": {"ppo_epochs": 2}}, "train.ppo_epochs 2"),
        ({"cells": 2}, {"train": {"estimator": "ppo"}}, "train.estimator ppo"),
        ({"cells": 2}, {"model": {**base["model"], "lora": {"rank": 4}}}, "model.lora"),
        ({"cells": 0}, {}, "cells"),
        ({"cells": 2, "cell_restart_backoff_s": 0}, {}, "cell_restart_backoff_s"),
    ):
        with pytest.raises(ValidationError, match=needle):
            RunConfig.model_validate({**base, **extra, "trainer": trainer})
