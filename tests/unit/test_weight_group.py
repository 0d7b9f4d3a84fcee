"""A cross-host weight push's group (``engines.weight_sync: distributed`` with rollout nodes):
the workflow's plan (name, nodes, ranks, world size), the roster the trainer's node writes
from the nodes' registrations (offsets, world size, backend, who falls back), and the
rendezvous itself on a real hosted ``TCPStore``: a trainer (rank 0, a client of the store
like everyone) and members on threads carrying a real model's weights bitwise over gloo,
a node that declines or never registers left out, a member that dies failing within the
timeout. Real engines and agents: tests/e2e/test_rollout_broadcast.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.models.causal_lm import export_state_dict
from gpu_runtime.models.model_folder import weights_checksum
from gpu_runtime.weight_sync.distributed import GroupSpec, Manifest, WeightGroup, manifest_of
from gpu_runtime.weight_sync.group_rendezvous import HostedGroup, HostedGroups, Rendezvous
from gpu_runtime.weight_sync.group_roster import Registration, Roster, declined, plan_roster, roster_backend
from gpu_runtime.weight_sync.member_push import GroupMember, member_push
from spec.engine import EngineSpec
from tests.engine_fixtures import tiny_model
from workflows.contracts.weight_group import WeightGroupAddress
from workflows.weight_group_plan import group_name, plan_group, seats


# ---- the workflow's plan -------------------------------------------------------------------
def test_the_plan_puts_node_i_at_rank_one_plus_i_times_its_engines() -> None:
    name = group_name("run-a", 3, 1, "abcd1234")
    assert name == "run-a/v3/a1/abcd1234"
    plan = plan_group(name, ["q-b", "q-a", "q-c"], EngineSpec(num_engines=2, weight_sync_timeout_s=7))
    assert (plan.nodes, plan.engines_per_node, plan.world_size, plan.timeout_s) == (3, 2, 7, 7.0)
    assert [plan.first_rank(i) for i in range(3)] == [1, 3, 5]
    got = seats(plan, WeightGroupAddress(master_address="10.0.0.1", master_port=4242), ["q-b", "q-a", "q-c"])
    assert {q: s.node for q, s in got.items()} == {"q-b": 0, "q-a": 1, "q-c": 2}  # slot order, not names
    assert all(s.address.master_address == "10.0.0.1" and s.group == plan for s in got.values())
    with pytest.raises(ValueError, match="at least one rollout node"):
        plan_group(name, [], EngineSpec())
    with pytest.raises(ValueError, match="plans 3 rollout nodes, not 2"):
        seats(plan, WeightGroupAddress(master_address="h", master_port=1), ["q-a", "q-b"])


def test_distributed_with_rollout_nodes_is_allowed_for_torch_engines_only() -> None:
    assert EngineSpec(nodes=2, weight_sync="distributed").nodes == 2
    with pytest.raises(ValueError, match="needs engines.backend torch"):
        EngineSpec(nodes=2, weight_sync="distributed", backend="sglang")


# ---- the roster ----------------------------------------------------------------------------
def reg(node: int, engines: int, **kw: Any) -> Registration:
    return Registration(node=node, engines=engines, **kw)


def test_every_node_present_is_the_plan() -> None:
    roster = plan_roster([reg(1, 2), reg(0, 2), reg(2, 2)], trainer_device="cpu", trainer_machine="h0")
    assert (roster.world_size, roster.offsets, roster.backend) == (7, {0: 1, 1: 3, 2: 5}, "gloo")
    plan = plan_group("g", ["a", "b", "c"], EngineSpec(num_engines=2))
    assert roster.world_size == plan.world_size and all(roster.seat(i) == plan.first_rank(i) for i in range(3))
    assert roster.left_out(range(3)) == []


def test_missing_declined_and_short_nodes_shift_the_ranks_and_fall_back() -> None:
    # node 1 declined (no folder to start from), node 3 never registered, node 2 brings one engine of two
    roster = plan_roster([reg(0, 2), reg(1, 0, why="no folder"), reg(2, 1)], trainer_device="cpu",
                         trainer_machine="h0")
    assert (roster.world_size, roster.offsets, roster.ranks) == (4, {0: 1, 2: 3}, {0: 2, 2: 1})
    assert roster.left_out(range(4)) == [1, 3]
    tp = plan_roster([reg(0, 1, ranks_per_engine=2), reg(1, 2, ranks_per_engine=2)], trainer_device="cpu",
                     trainer_machine="h0")
    assert (tp.world_size, tp.offsets) == (7, {0: 1, 1: 3})  # an engine holds tp ranks from its first on
    again = plan_roster([reg(0, 2), reg(0, 1)], trainer_device="cpu", trainer_machine="h0")
    assert again.ranks == {0: 1}  # a node's last registration counts


def test_no_engine_anywhere_is_no_broadcast_and_says_why() -> None:
    roster = plan_roster([reg(0, 0, why="no healthy engine")], trainer_device="cpu", trainer_machine="h0")
    assert roster.world_size == 0 and roster.seat(0) is None and "node 0: no healthy engine" in roster.why
    assert plan_roster([], trainer_device="cpu", trainer_machine="h").left_out([0, 1]) == [0, 1]
    assert declined("trainer holds v2").left_out([0]) == [0]


def test_the_backend_is_nccl_only_between_distinct_gpus_of_each_machine() -> None:
    gpu = {"devices": ("cuda:0",)}
    assert roster_backend("cpu", "h0", [reg(0, 1, machine="h1", **gpu)]) == "gloo"
    assert roster_backend("cuda:0", "h0", [reg(0, 1, machine="h1", **gpu), reg(1, 1, machine="h2", **gpu)]) == "nccl"
    assert roster_backend("cuda:0", "h0", [reg(0, 1, machine="h0", **gpu)]) == "gloo"  # the trainer's own GPU
    assert roster_backend("cuda:0", "h0", [reg(0, 2, machine="h1", devices=("cuda:0", "cuda:0"))]) == "gloo"
    assert roster_backend("cuda:0", "h0", [reg(0, 2, machine="h1", devices=("cuda:0", "cuda:1"))]) == "nccl"
    assert roster_backend("cuda", "h0", [reg(0, 1, machine="h1", devices=("cpu",))]) == "gloo"
    assert roster_backend("cuda:0", "h0", [reg(0, 1, machine="h1")]) == "gloo"  # devices unknown: host memory


def test_registrations_and_rosters_travel_as_json() -> None:
    r = reg(2, 3, ranks_per_engine=2, devices=("cuda:0", "cuda:1", "cuda:0"), machine="h", why="")
    assert Registration.from_json(r.to_json()) == r
    roster = plan_roster([reg(0, 1), reg(1, 2)], trainer_device="cpu", trainer_machine="h",
                         manifest={"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]}, bucket_bytes=64)
    assert Roster.from_json(roster.to_json()) == roster
    with pytest.raises(ValueError, match="backend 'mpi'"):
        Roster.from_json('{"world_size": 2, "backend": "mpi"}')
    with pytest.raises(ValueError, match="engines -1"):
        reg(0, -1)


# ---- the rendezvous, on a real store ----------------------------------------------------------
TIMEOUT_S = 4.0


class Trainer(threading.Thread):
    """Rank 0 on a thread: waits for ``nodes`` registrations on ``group``, writes the roster, sends ``state``."""

    def __init__(self, group: HostedGroup, nodes: int, state: dict[str, torch.Tensor], manifest: Manifest,
                 wait_s: float = TIMEOUT_S) -> None:
        super().__init__()
        self.group, self.nodes, self.state, self.manifest, self.wait_s = group, nodes, state, manifest, wait_s
        self.roster: Roster | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            regs = self.group.registrations(self.nodes, self.wait_s)
            self.roster = plan_roster(regs.values(), trainer_device="cpu", trainer_machine="here",
                                      manifest=self.manifest.as_request(), bucket_bytes=self.manifest.bucket_bytes)
            self.group.publish(self.roster)
            if self.roster.world_size < 2:
                return
            spec = GroupSpec("127.0.0.1", self.group.port, self.roster.world_size, self.group.group_name, "gloo")
            g = WeightGroup(spec, 0, TIMEOUT_S, store_hosted=True)
            try:
                g.send(self.state, self.manifest)
            finally:
                g.close()
        except BaseException as err:  # noqa: BLE001 - the test reads it
            self.error = err


class Engines:
    """Stand-in engines: each url joins at its rank in this process and keeps what it received."""

    def __init__(self, dead: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.got: dict[str, dict[str, torch.Tensor]] = {}
        self.ranks: dict[str, int] = {}
        self.dead = dead
        self._lock = threading.Lock()

    def receive(self, url: str, rank: int, *, spec: GroupSpec, manifest: Manifest, version: str, checksum: str | None,
                request_timeout_s: float, group_timeout_s: float | None) -> None:
        with self._lock:
            self.ranks[url] = rank
        if url in self.dead:
            raise ConnectionError(f"{url}: connection refused")  # registered, then gone: never joins
        g = WeightGroup(spec, rank, group_timeout_s or TIMEOUT_S)
        try:
            got = g.receive(manifest)
        finally:
            g.close()
        if checksum is not None and weights_checksum(got) != checksum:
            raise ValueError(f"{url}: checksum mismatch")
        with self._lock:
            self.got[url] = got


def member(port: int, node: int, name: str, checksum: str, tmp: Path) -> GroupMember:
    return GroupMember(Rendezvous("127.0.0.1", port, name, TIMEOUT_S), node, "3", checksum, tmp / f"v3-{node}",
                       materialize=lambda: tmp, machine="here")


def push_all(port: int, name: str, checksum: str, tmp: Path, nodes: dict[int, list[str]],
             engines: Engines) -> dict[int, Any]:
    """``member_push`` of every node in ``nodes`` at once (threads), as their agents do."""
    out: dict[int, Any] = {}

    def one(node: int, urls: list[str]) -> None:
        out[node] = member_push(urls, member(port, node, name, checksum, tmp), receive=engines.receive,
                                devices=("cpu",) * len(urls))

    threads = [threading.Thread(target=one, args=(n, u)) for n, u in nodes.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10 * TIMEOUT_S)
        assert not t.is_alive(), "a member push must end within its timeouts"
    return out


@pytest.fixture(scope="module")
def state() -> tuple[dict[str, torch.Tensor], Manifest, str]:
    model, _ = tiny_model(4)
    sd = export_state_dict(model)
    return sd, manifest_of(sd).with_buckets(20_000), weights_checksum(sd)


def test_two_nodes_receive_bitwise_at_the_planned_ranks(state: tuple, tmp_path: Path) -> None:
    sd, manifest, checksum = state
    hosted = HostedGroups()
    port = hosted.open("run/v3/a1/x", TIMEOUT_S)
    assert hosted.open("run/v3/a1/x", TIMEOUT_S) == port  # a retried open: the same store
    group = hosted.take("run/v3/a1/x")
    assert group is not None and hosted.take("run/v3/a1/x") is None
    trainer = Trainer(group, 2, sd, manifest)
    trainer.start()
    engines = Engines()
    results = push_all(port, group.group_name, checksum, tmp_path, {0: ["e0", "e1"], 1: ["e2", "e3"]}, engines)
    trainer.join()
    group.close()
    assert trainer.error is None
    assert engines.ranks == {"e0": 1, "e1": 2, "e2": 3, "e3": 4}
    assert all(r.updated and not r.failed for r in results.values())
    for url in ("e0", "e1", "e2", "e3"):
        assert all(torch.equal(engines.got[url][k], sd[k]) for k in sd)


def test_a_node_that_declines_or_never_registers_is_left_out_and_the_rest_receive(state: tuple, tmp_path: Path) -> None:
    sd, manifest, checksum = state
    group = HostedGroup("run/v3/a1/y", TIMEOUT_S)
    trainer = Trainer(group, 3, sd, manifest, wait_s=1.5)  # node 2 never registers: waited for 1.5 s
    trainer.start()
    engines = Engines()
    t0 = time.monotonic()
    results = push_all(group.port, group.group_name, checksum, tmp_path, {0: ["e0"], 1: []}, engines)
    trainer.join()
    group.close()
    assert trainer.error is None and trainer.roster is not None
    assert trainer.roster.offsets == {0: 1} and trainer.roster.left_out(range(3)) == [1, 2]
    assert results[0].updated == ["e0"] and torch.equal(engines.got["e0"][manifest.names[0]], sd[manifest.names[0]])
    assert results[1].updated == [] and results[1].failed == {}  # declined: no engine to fail
    assert time.monotonic() - t0 < 3 * TIMEOUT_S


def test_a_member_that_dies_after_registering_fails_the_group_within_its_timeout(state: tuple, tmp_path: Path) -> None:
    sd, manifest, checksum = state
    group = HostedGroup("run/v3/a1/z", TIMEOUT_S)
    trainer = Trainer(group, 2, sd, manifest)
    trainer.start()
    engines = Engines(dead={"e1"})
    t0 = time.monotonic()
    results = push_all(group.port, group.group_name, checksum, tmp_path, {0: ["e0"], 1: ["e1"]}, engines)
    trainer.join(timeout=10 * TIMEOUT_S)
    group.close()
    assert not trainer.is_alive() and trainer.error is not None  # the trainer's join timed out
    assert results[0].failed and results[1].failed and not results[0].updated  # everyone falls back
    assert "connection refused" in results[1].failed["e1"]
    assert time.monotonic() - t0 < 5 * TIMEOUT_S


def test_a_store_that_is_gone_fails_the_member_within_its_timeout(tmp_path: Path) -> None:
    group = HostedGroup("run/v3/a1/gone", 1.0)
    port = group.port
    group.close()
    gone = GroupMember(Rendezvous("127.0.0.1", port, "run/v3/a1/gone", 1.0), 0, "3", "c", tmp_path,
                       materialize=lambda: tmp_path)
    res = member_push(["e0"], gone, receive=Engines().receive, devices=("cpu",))
    assert res.updated == [] and "cannot reach its store" in res.failed["e0"]
