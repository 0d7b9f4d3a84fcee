"""A fsdp2 rank on another machine than its driver (``trainer.placement: spread`` over a
cluster of several hosts): the folders a call names travel through Ray (``fsdp2/folders.py``)
and the rank's gloo binds the interface of its Ray node address (``fsdp2/network.py``).

Ranks on two real hosts are tested end to end in tests/e2e/test_ranks_across_hosts.py
(the multi-host bed). Here, on one machine, a real 2-rank cell is told its ranks are away
(``TrainerCell.away``), so every folder goes the remote way, through a stage of the rank's
own, rank 0 included (which the e2e run, whose rank 0 sits with the driver, does not
reach): built from the staged model folder, a step, a checkpoint written on stages and
assembled by the driver, an export by a staged rank 0, and a restore read from a stage
into a cell with one rank away continue bitwise like a cell that never left the driver's
files.
"""

from __future__ import annotations

import socket
from collections import namedtuple
from pathlib import Path

import psutil
import pytest
import ray

from gpu_runtime.models.model_folder import weights_checksum
from gpu_runtime.trainer.fsdp2.cell import TrainerCell
from gpu_runtime.trainer.fsdp2.folders import read_tree, write_tree
from gpu_runtime.trainer.fsdp2.network import GLOO_IFNAME_ENV, interface_of, pin_gloo_interface
from gpu_runtime.trainer.fsdp2.ray_runtime import RayRuntime
from tests.unit.test_policy_trainer import hparams, rollout
from tests.unit.test_trainer_cell import load_model_folder_weights, post_sft_folder, ray_runtime  # noqa: F401

SEED = 7
HP = hparams(micro_batch_size=2, ppo_epochs=1, kl_coef=0.1, warmup_steps=0, lr=1e-3)  # kl: a reference travels too
Addr = namedtuple("Addr", "family address")


# -- folders and interfaces (pure) ---------------------------------------------------------


def test_a_tree_round_trips_and_stays_inside_its_folder(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_tree(src, {"a.json": b"{}", "shards/__1_0.distcp": b"\x00\x01", "shards/.metadata": b"m"})
    assert read_tree(src) == {"a.json": b"{}", "shards/.metadata": b"m", "shards/__1_0.distcp": b"\x00\x01"}
    write_tree(tmp_path / "dst", {"a.json": b"old"})
    write_tree(tmp_path / "dst", read_tree(src))  # merged in, same names replaced
    assert read_tree(tmp_path / "dst") == read_tree(src)
    assert not [p for p in (tmp_path / "dst").rglob("*.part")]
    assert read_tree(tmp_path / "missing") == {}
    for bad in ("../escape", "/etc/passwd", "shards/../../x", ""):
        with pytest.raises(ValueError, match="must stay inside its folder"):
            write_tree(tmp_path / "dst", {bad: b"x"})


def test_gloo_uses_the_interface_of_the_node_address() -> None:
    addrs = {"lo": [Addr(socket.AF_INET, "127.0.0.1")], "eth0": [Addr(socket.AF_PACKET, "aa:bb"),
                                                                   Addr(socket.AF_INET, "10.200.1.3")],
             "eth1": [Addr(socket.AF_INET6, "fe80::1%eth1")]}
    assert interface_of("10.200.1.3", addrs) == "eth0"
    assert interface_of("fe80::1", addrs) == "eth1"
    assert interface_of("10.9.9.9", addrs) is None
    env: dict[str, str] = {}
    assert pin_gloo_interface("10.200.1.3", env, addrs) == "eth0" and env == {GLOO_IFNAME_ENV: "eth0"}
    env = {GLOO_IFNAME_ENV: "ib0"}  # the operator's choice stands
    assert pin_gloo_interface("10.200.1.3", env, addrs) == "ib0" and env == {GLOO_IFNAME_ENV: "ib0"}
    env = {}
    assert pin_gloo_interface("10.9.9.9", env, addrs) is None and env == {}  # none found: gloo's own choice
    loopback = [n for n, entries in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in entries)]
    assert interface_of("127.0.0.1") == loopback[0]  # this machine's own table


# -- a real cell whose ranks take the remote path -------------------------------------------


@pytest.fixture(scope="module")
def folder() -> Path:
    return post_sft_folder(HP, 2, "cell-away-")


def test_away_ranks_train_checkpoint_export_and_restore_bitwise(folder: Path, ray_runtime: RayRuntime,  # noqa: F811
                                                                tmp_path: Path) -> None:
    home = TrainerCell(2, folder, HP, SEED)  # the reference: every rank sees the driver's files
    try:
        assert home.away == [False, False]  # one machine: every rank is on the driver's Ray node
        home.train_step(*rollout(1), 4, HP)
        v1 = home.checksum()
        home.save_state(tmp_path / "home-1")
        home.train_step(*rollout(2), 4, HP)
        v2 = home.checksum()
    finally:
        home.close()

    staged = TrainerCell(2, folder, HP, SEED)
    try:
        staged.away = [True, True]  # every rank, rank 0 included, on a stage of its own
        model = ray.put(read_tree(folder))
        staged._each([("build_away", (model, HP, SEED), {})] * 2)  # rebuilt from the staged model folder
        staged.train_step(*rollout(1), 4, HP)
        assert staged.checksum() == v1
        staged.save_state(tmp_path / "staged-1")  # written on the stages, assembled here
        assert sorted(read_tree(tmp_path / "staged-1")) == sorted(read_tree(tmp_path / "home-1"))
        exported = staged.export_model_folder(tmp_path / "staged-hf")  # by rank 0, on its stage
        assert exported == v1 and (tmp_path / "staged-hf" / "model.safetensors").is_file()
        assert weights_checksum(load_model_folder_weights(tmp_path / "staged-hf")) == v1
    finally:
        staged.close()

    restored = TrainerCell(2, folder, HP, SEED)
    try:
        restored.away = [False, True]  # rank 1 reads the checkpoint from a stage, rank 0 in place
        restored.load_state(tmp_path / "staged-1")
        assert restored.checksum() == v1
        restored.train_step(*rollout(2), 4, HP)
        assert restored.checksum() == v2
    finally:
        restored.close()
