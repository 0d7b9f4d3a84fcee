"""``milestone fork``'s pure parts on a real local store: the lineage, the fork's
state (cursor, train settings, dataset) and what a fork may not change."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.store import artifacts as art
from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.store.lineage import fork_lineage, owner
from gpu_runtime.store.object_store import LocalStore
from milestone_cli.fork import ForkError, apply_sets, cursor_after, fork_input
from spec.events import Forked
from spec.run import RunConfig
from spec.train import TrainSpec
from spec.trainer_rpc import ForkPoint
from workflows.run_state import TrainingRunInput

GROUP = 2


def test_lineage_owner_and_trim() -> None:
    assert fork_lineage([], "p", 5) == [("p", 5)]
    # a fork of a fork: steps <= 3 are the grandparent's, 4..5 the parent's
    assert fork_lineage([("g", 3)], "p", 5) == [("g", 3), ("p", 5)]
    # forking the fork before its own first step reaches back to the grandparent only
    assert fork_lineage([("g", 3)], "p", 2) == [("g", 2)]
    assert fork_lineage([("g", 3)], "p", 3) == [("g", 3)]
    lineage = [("g", 3), ("p", 5)]
    assert [owner(lineage, "me", s) for s in (0, 3, 4, 5, 6)] == ["g", "g", "p", "p", "me"]
    with pytest.raises(ValueError):
        fork_lineage([], "p", -1)


def _store_run(store: LocalStore, run_id: str, steps: range, prompts: int, lr: float) -> None:
    """A run's stored steps as the trainer leaves them: step batch, rewards, train result."""
    for k in steps:
        rewards_key = art.rewards_key(run_id, k)
        rewards = [art.SampleReward(sample_id=f"s{k}-{i}", reward=0.0, correct=False) for i in range(prompts * GROUP)]
        art.put_model(store, rewards_key, art.StepRewards(run_id=run_id, step=k, rewards=rewards))
        hparams = TrainSpec(lr=lr).model_dump(mode="json")
        art.put_json(store, art.step_batch_key(run_id, k), {
            "step": k, "policy_version": k - 1, "chunk_keys": [], "rewards_key": rewards_key,
            "group_size": GROUP, "hparams": hparams,
        })
        store.put_bytes(f"{art.step_prefix(run_id, k)}/train_result.json", b"{}")


def _checkpoint(store: LocalStore, tmp: Path, run_id: str, step: int, cursor: int) -> None:
    src = tmp / f"src-{run_id}-{step}"
    src.mkdir()
    (src / "policy.safetensors").write_bytes(f"{run_id}{step}".encode())
    ckpts = CheckpointStore(store, art.checkpoints_prefix(run_id), local_dir=tmp / f"local-{run_id}")
    ckpts.save(step, src, {"policy_version": step, "data_cursor": cursor}, sync=True)
    ckpts.close()


@pytest.fixture
def parent(tmp_path: Path) -> tuple[LocalStore, RunConfig]:
    """Run p: 6 steps of 4 prompts (lr 1e-4; step 4 onward with lr 5e-5 after a `milestone
    set`), a checkpoint after step 2."""
    store = LocalStore(tmp_path / "store")
    cfg = RunConfig(steps=6, store=f"file://{tmp_path / 'store'}", train=TrainSpec(lr=1e-4))
    store.put_bytes(art.dataset_key("p", "train"), b'{"prompt": "1+1="}\n' * 10)
    _store_run(store, "p", range(1, 4), 4, 1e-4)
    _store_run(store, "p", range(4, 7), 4, 5e-5)
    _checkpoint(store, tmp_path, "p", 2, 8)
    return store, cfg


def test_fork_state_after_step(parent: tuple[LocalStore, RunConfig]) -> None:
    store, cfg = parent
    inp = fork_input(store, "p", 4, cfg, TrainingRunInput(config=cfg), [], train_from_config=False)
    st = inp.state
    assert st is not None and (st.next_step, st.policy_version, st.initialized) == (5, 4, True)
    assert st.data_cursor == 16  # checkpoint 2 (cursor 8) + 2 steps x 4 prompts
    assert st.train is not None and st.train.lr == 5e-5  # what step 4 trained with, `milestone set` included
    assert st.dataset is not None and st.dataset.key == "runs/p/data/train.jsonl" and st.dataset.n_rows == 10
    assert inp.lineage == [ForkPoint(run_id="p", step=4)]
    [forked] = st.events
    assert isinstance(forked, Forked) and (forked.parent, forked.step) == ("p", 4)
    # a change: lr for the steps after the fork, and more steps
    inp = fork_input(store, "p", 4, cfg, TrainingRunInput(config=cfg), ["lr=1e-3", "steps=9"], train_from_config=False)
    assert inp.state is not None and inp.state.train is not None and inp.state.train.lr == 1e-3
    assert inp.config.steps == 9
    # from the SFT policy: nothing shared but v0 and the data
    inp = fork_input(store, "p", 0, cfg, TrainingRunInput(config=cfg), [], train_from_config=False)
    assert inp.state is not None and (inp.state.next_step, inp.state.data_cursor) == (1, 0)


def test_fork_of_a_fork_reads_each_step_from_its_owner(parent: tuple[LocalStore, RunConfig], tmp_path: Path) -> None:
    store, cfg = parent
    _store_run(store, "f", range(5, 7), 3, 1e-3)  # f = p forked at 4, 3 prompts per step after
    f_input = TrainingRunInput(config=cfg, lineage=[ForkPoint(run_id="p", step=4)])
    inp = fork_input(store, "f", 6, cfg, f_input, ["steps=8"], train_from_config=False)
    assert inp.lineage == [ForkPoint(run_id="p", step=4), ForkPoint(run_id="f", step=6)]
    assert inp.state is not None and inp.state.data_cursor == 8 + 2 * 4 + 2 * 3
    assert inp.state.train is not None and inp.state.train.lr == 1e-3
    assert cursor_after(store, [("p", 4)], 4) == 16


def test_fork_refuses_what_it_cannot_do(parent: tuple[LocalStore, RunConfig]) -> None:
    store, cfg = parent
    rec = TrainingRunInput(config=cfg)
    with pytest.raises(ForkError, match="no trained step 7"):
        fork_input(store, "p", 7, cfg.model_copy(update={"steps": 9}), rec, [], train_from_config=False)
    with pytest.raises(ForkError, match="seed: a fork cannot change it"):
        fork_input(store, "p", 2, cfg, rec, ["seed=3"], train_from_config=False)
    with pytest.raises(ForkError, match="data: a fork cannot change it"):
        fork_input(store, "p", 2, cfg, rec, ["data.num_train=5"], train_from_config=False)
    with pytest.raises(ForkError, match="steps: 6 leaves nothing to train after step 6"):
        fork_input(store, "p", 6, cfg, rec, [], train_from_config=False)
    with pytest.raises(ForkError, match="kl_coef"):
        fork_input(store, "p", 2, cfg, rec, ["kl_coef=0.1"], train_from_config=False)
    with pytest.raises(ForkError, match="no such config key"):
        fork_input(store, "p", 2, cfg, rec, ["nope.x=1"], train_from_config=False)
    with pytest.raises(ForkError, match="lr"):
        fork_input(store, "p", 2, cfg, rec, ["lr=-1"], train_from_config=False)


def test_apply_sets_reads_yaml_values() -> None:
    cfg, train = apply_sets(RunConfig(), TrainSpec(), ["betas=[0.8,0.9]", "rollout.temperature=0.5", "ppo_epochs=2"])
    assert train.betas == (0.8, 0.9) and train.ppo_epochs == 2 and cfg.rollout.temperature == 0.5
    with pytest.raises(ForkError, match="expected KEY=VALUE"):
        apply_sets(RunConfig(), TrainSpec(), ["lr"])


def test_cursor_after_a_dynamic_sampling_step_counts_every_round(tmp_path: Path) -> None:
    """A step with dynamic sampling trains its kept groups (a selection of its rounds) but drew
    every round's prompts: the fork's cursor moves past all of them, as the run's did."""
    store = LocalStore(tmp_path / "store")

    def rewards(key: str, n: int) -> None:
        rs = [art.SampleReward(sample_id=f"s{i}", reward=0.0, correct=False) for i in range(n * GROUP)]
        art.put_model(store, key, art.StepRewards(run_id="d", step=1, rewards=rs))

    def step(k: int, prompts: int, groups: list[list[int]]) -> None:
        """Step ``k``: two rounds of ``prompts`` prompts, ``groups`` trained; nothing is copied."""
        rewards(art.rewards_key("d", k, 0), prompts)
        rewards(art.rewards_key("d", k, 1), prompts)
        art.put_json(store, art.step_batch_key("d", k), {
            "step": k, "policy_version": k - 1, "chunk_keys": [], "rewards_key": "", "group_size": GROUP,
            "hparams": TrainSpec().model_dump(mode="json"),
            "selection": {"rounds": [{"chunk_keys": [], "rewards_key": art.rewards_key("d", k, r)} for r in (0, 1)],
                          "groups": groups},
        })

    step(1, 6, [[0, 0], [0, 1], [1, 2], [1, 3]])
    assert cursor_after(store, [("d", 1)], 1) == 12
    step(2, 3, [[0, 0], [1, 2]])
    assert cursor_after(store, [("d", 2)], 2) == 12 + 6
