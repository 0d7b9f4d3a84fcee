"""Fencing on a real local store (gpu_runtime/store/fence.py): the placement epoch is
raised by compare-and-swap, writes of an older epoch are refused and reported, a run
writes only under its own prefix, and a checkpoint written by a placement left
behind is never durable state."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

import pytest

from gpu_runtime.store import artifacts as art
from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.store.fence import (
    Fence,
    FencedStore,
    Placement,
    ReadOnlyPrefix,
    StaleEpoch,
    fence_key,
    next_epoch,
    raise_fence,
    read_fence,
)
from gpu_runtime.store.object_store import LocalStore, StoreError


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def test_epochs_only_move_forward(store: LocalStore) -> None:
    assert next_epoch(store, "r") == 1 and read_fence(store, "r") == Fence()
    raise_fence(store, "r", 1, "n0", from_step=1)
    assert raise_fence(store, "r", 1, "n0", from_step=1).epoch == 1  # a retried init_policy: no change
    with pytest.raises(StaleEpoch, match="epoch 1, the run is at epoch 1 \\(node n0\\)"):
        raise_fence(store, "r", 1, "n1", from_step=1)  # another node cannot take the same epoch
    assert next_epoch(store, "r") == 2
    fence = raise_fence(store, "r", 2, "n1", from_step=5)
    assert (fence.epoch, fence.node) == (2, "n1")
    assert fence.history == (Placement(1, "n0", 1), Placement(2, "n1", 5))
    with pytest.raises(StaleEpoch):
        raise_fence(store, "r", 1, "n0", from_step=1)  # a late placement of the old node
    assert read_fence(store, "r").epoch == 2


def test_writes_of_an_older_epoch_are_refused_and_reported(store: LocalStore, tmp_path: Path) -> None:
    raise_fence(store, "r", 1, "n0", from_step=1)
    refused: list[StaleEpoch] = []
    old = FencedStore(store, "r", 1, "n0", on_refused=refused.append)
    key = art.rewards_key("r", 3)
    old.put_bytes(key, b"epoch 1")
    raise_fence(store, "r", 2, "n1", from_step=3)  # the run moved to n1 at step 3
    new = FencedStore(store, "r", 2, "n1")
    new.put_bytes(key, b"epoch 2")
    src = tmp_path / "w.bin"
    src.write_bytes(b"zombie")
    for write in (lambda: old.put_bytes(key, b"zombie"), lambda: old.put_file(key, src),
                  lambda: old.delete(key), lambda: old.delete_prefix(art.step_prefix("r", 3))):
        with pytest.raises(StaleEpoch, match=f"refused .* {art.step_prefix('r', 3)}.*epoch 1, the run is at epoch 2"):
            write()
    assert store.get_bytes(key) == b"epoch 2" and old.get_bytes(key) == b"epoch 2"  # reads still work
    assert len(refused) == 4 and all(e.epoch == 1 and e.fence.node == "n1" for e in refused)
    FencedStore(store, "r", 0).put_bytes(key, b"unfenced")  # epoch 0: a run from before fencing


def test_a_run_writes_only_under_its_own_prefix(store: LocalStore) -> None:
    fork = FencedStore(store, "fork", 1)
    fork.put_bytes(art.rewards_key("fork", 1), b"ok")
    for key in (art.rewards_key("parent", 1), fence_key("fork"), "runs/forked/x"):
        with pytest.raises(ReadOnlyPrefix):
            fork.put_bytes(key, b"no")
    assert not store.exists(art.rewards_key("parent", 1))


def test_accepts_state_written_before_the_run_moved_on() -> None:
    fence = Fence(3, "n2", (Placement(1, "n0", 1), Placement(2, "n1", 5), Placement(3, "n2", 9)))
    assert fence.accepts(step=4, epoch=1) and fence.accepts(step=0, epoch=1)  # committed before the move
    assert not fence.accepts(step=5, epoch=1)  # n0 was left behind at step 5
    assert fence.accepts(step=8, epoch=2) and not fence.accepts(step=9, epoch=2)
    assert fence.accepts(step=12, epoch=3) and fence.accepts(step=2, epoch=3)
    assert Fence().accepts(step=7, epoch=0)


def test_a_left_behind_checkpoint_is_not_durable(store: LocalStore, tmp_path: Path) -> None:
    raise_fence(store, "r", 1, "n0", from_step=1)

    def save(step: int, epoch: int) -> None:
        src = tmp_path / f"ckpt-{step}-{epoch}"
        src.mkdir()
        (src / "policy.safetensors").write_bytes(f"{step}@{epoch}".encode())
        plain = CheckpointStore(store, art.checkpoints_prefix("r"), tmp_path / f"local-{step}-{epoch}")
        plain.save(step, src, {"policy_version": step, "epoch": epoch}, sync=True)
        plain.close()

    save(4, 1)
    raise_fence(store, "r", 2, "n1", from_step=5)
    save(5, 1)  # n0's checkpoint of step 5 slipped in as the run moved (the check-then-write window)
    ckpts = CheckpointStore(store, art.checkpoints_prefix("r"), tmp_path / "reader",
                            accept=lambda i: read_fence(store, "r").accepts(i.step, int(i.meta.get("epoch", 0))))
    assert [c.step for c in ckpts.list_durable()] == [4]
    assert ckpts.restore(tmp_path / "restored").step == 4
    save(5, 2)  # n1 redoes step 5
    assert [c.step for c in ckpts.list_durable()] == [4, 5]


def test_local_update_is_a_compare_and_swap(store: LocalStore) -> None:
    def bump(old: bytes | None) -> bytes:
        return str(int(old or b"0") + 1).encode()

    threads = [threading.Thread(target=lambda: [store.update("runs/r/n", bump) for _ in range(25)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get_bytes("runs/r/n") == b"100"
    store.update("runs/r/n", lambda old: None)  # None: leave it
    assert store.get_bytes("runs/r/n") == b"100"
    with open(store.root / "runs" / "r" / ".n.lock", "a") as held:  # another writer holds the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(StoreError, match="lock held"):
            store.update("runs/r/n", bump, lock_timeout_s=0.2)
