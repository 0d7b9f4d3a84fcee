"""``SnapshotBuffers``: a checkpoint's host copies, allocated once (on their own thread when
warmed after a train step) and reused by every later snapshot; a copy is the source's bytes."""

from __future__ import annotations

import torch

from gpu_runtime.trainer.common.snapshot import SnapshotBuffers


def test_warmed_buffers_are_the_ones_every_snapshot_copies_into() -> None:
    live = {"policy.safetensors": {"w": torch.randn(4, 3), "b": torch.randn(3)},
            "optimizer.safetensors": {"0.exp_avg": torch.randn(4, 3)}}
    bufs = SnapshotBuffers()
    assert len(bufs.missing(live)) == 3
    thread = bufs.warm(bufs.missing(live))
    assert thread is not None
    thread.join(10)
    assert bufs.missing(live) == [] and bufs.warm([]) is None
    assert bufs.nbytes == (12 + 3 + 12) * 4
    first = {f: bufs.copy(f, sd) for f, sd in live.items()}
    ptrs = {(f, k): t.data_ptr() for f, sd in first.items() for k, t in sd.items()}
    live["policy.safetensors"]["w"].add_(1.0)  # the trainer trains on: the snapshot keeps what it copied
    assert not torch.equal(first["policy.safetensors"]["w"], live["policy.safetensors"]["w"])
    again = {f: bufs.copy(f, sd) for f, sd in live.items()}
    assert {(f, k): t.data_ptr() for f, sd in again.items() for k, t in sd.items()} == ptrs  # no new allocation
    assert all(torch.equal(again[f][k], live[f][k]) for f in live for k in live[f])


def test_a_new_shape_gets_a_new_buffer() -> None:
    bufs = SnapshotBuffers()
    bufs.copy("f", {"w": torch.zeros(2)})
    assert bufs.missing({"f": {"w": torch.zeros(3)}}) == [("f", "w", (3,), torch.float32)]
    assert torch.equal(bufs.copy("f", {"w": torch.ones(3)})["w"], torch.ones(3))
