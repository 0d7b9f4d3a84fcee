"""``engines.release_memory``: how ``auto`` resolves (a pure function of the placement),
the config's refusal for overlapping rollout modes, and the trainer's optimizer offload
(a real PolicyTrainer on a tiny model: the state after a round trip and the training
after it are bitwise those of a trainer that never offloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from gpu_runtime.proc.devices import Placement, plan_placement
from gpu_runtime.node.memory_phases import resolve_release_memory
from gpu_runtime.trainer.common.offload import OptimizerOffload
from gpu_runtime.trainer.common.state_io import OPTIM_FILE
from spec.engine import EngineSpec
from spec.run import RunConfig
from tests.unit.test_policy_trainer import assert_same_state, new_trainer, rollout


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


# ---- the knob -----------------------------------------------------------------------
@pytest.mark.parametrize("placement,enabled,why", [
    (plan_placement("cuda", 1), True, "colocated with the trainer on cuda:0"),
    (plan_placement("cuda", 4, trainer_gpu=0, engine_gpus=[1, 2]), False, "do not share the trainer's cuda:0"),
    (plan_placement("cuda", 4, trainer_gpu=1, engine_gpus=[0, 1]), True, "colocated"),  # one engine shares it
    (plan_placement("cpu", 0), False, "trainer is on the CPU"),
])
def test_auto_is_on_only_when_an_engine_shares_the_trainers_gpu(placement: Placement, enabled: bool, why: str) -> None:
    got = resolve_release_memory("auto", placement)
    assert got.enabled is enabled and why in got.reason


def test_on_and_off_ignore_the_placement() -> None:
    for p in (plan_placement("cpu", 0), plan_placement("cuda", 1), plan_placement("cuda", 2, engine_gpus=[1])):
        assert resolve_release_memory("on", p).enabled and not resolve_release_memory("off", p).enabled
    with pytest.raises(ValueError, match="engines.release_memory 'sometimes'"):
        resolve_release_memory("sometimes", plan_placement("cpu", 0))


def test_config_default_is_auto_and_overlapping_modes_turn_it_off() -> None:
    assert RunConfig().engines.release_memory == "auto"
    assert RunConfig.model_validate({"engines": {"release_memory": "on"}}).engines.release_memory == "on"
    for mode in ("one_step_off", "fully_async"):
        cfg = RunConfig.model_validate({"rollout": {"mode": mode}})  # engines omitted: still checked
        assert cfg.engines.release_memory == "off"
        assert RunConfig.model_validate(cfg.model_dump()).engines.release_memory == "off"  # stable on re-validation
        with pytest.raises(ValidationError, match=f"engines.release_memory on needs rollout.mode sync: in {mode}"):
            RunConfig.model_validate({"rollout": {"mode": mode}, "engines": {"release_memory": "on"}})
    with pytest.raises(ValidationError, match="release_memory"):
        EngineSpec.model_validate({"release_memory": "yes"})


# ---- the trainer's optimizer offload --------------------------------------------------
def _state(tr) -> dict[tuple[int, str], torch.Tensor]:
    return {(i, k): t for i, p in enumerate(tr.optimizer.param_groups[0]["params"])
            for k, t in tr.optimizer.state[p].items()}


def test_offload_round_trip_is_bitwise_and_never_aliases() -> None:
    tr = new_trainer()
    tr.train_step(*rollout(0), group_size=4, hparams=tr.hparams)
    live = _state(tr)
    snapshot = {k: t.clone() for k, t in live.items()}
    assert any(p.grad is not None for p in tr.model.parameters())
    off = OptimizerOffload()
    moved = off.offload([tr.optimizer])
    big = [k for k, t in snapshot.items() if t.dim() > 0]
    assert {k[1] for k in big} == {"exp_avg", "exp_avg_sq"}
    assert moved == sum(snapshot[k].numel() * 4 for k in big)
    assert all(p.grad is None for p in tr.model.parameters())  # freed, not parked: zero_grad(set_to_none) is next
    parked = _state(tr)
    for k in big:
        assert parked[k].data_ptr() != live[k].data_ptr() and torch.equal(parked[k], snapshot[k])
        live[k].fill_(float("nan"))  # the old live tensors are not the parked copies
    assert off.offload([tr.optimizer]) == 0  # already parked: a no-op
    off.onload()
    back = _state(tr)
    for k in big:
        assert back[k].data_ptr() != parked[k].data_ptr()
        parked[k].fill_(float("nan"))  # the host buffers are not the state the optimizer now steps
    for k, t in back.items():
        assert torch.equal(t, snapshot[k]), k
    assert not off.offloaded


def test_training_with_offload_between_steps_is_bitwise_a_plain_run(tmp_path: Path) -> None:
    """Three steps, the state parked on the host after each (as the trainer service parks it
    between train steps: ``release_optimizer`` / ``reclaim_optimizer``) and a checkpoint
    written while parked: weights, optimizer, metrics and the checkpoint's optimizer file
    equal those of a trainer that never offloads."""
    plain, parked = new_trainer(), new_trainer()
    for step in range(3):
        batch = rollout(step)
        m_plain = plain.train_step(*batch, group_size=4, hparams=plain.hparams)
        parked.reclaim_optimizer()
        m_parked = parked.train_step(*batch, group_size=4, hparams=parked.hparams)
        parked.release_optimizer()
        assert parked.offload is not None and parked.offload.offloaded
        timed = ("tokens_per_s", "step_seconds")  # wall-clock numbers differ; nothing else may
        assert {k: v for k, v in m_parked.items() if k not in timed} == {k: v for k, v in m_plain.items() if k not in timed}
    parked.save_state(tmp_path / "parked")
    plain.save_state(tmp_path / "plain")
    assert (tmp_path / "parked" / OPTIM_FILE).read_bytes() == (tmp_path / "plain" / OPTIM_FILE).read_bytes()
    parked.reclaim_optimizer()
    assert_same_state(parked, plain)
    assert parked.checksum() == plain.checksum()
