"""The policy trainer of one data-parallel cell (``trainer.cells: K``).

The loss code is ``PolicyTrainer.train_step`` itself; this class overrides three hooks:

- ``micro_batch_share``: the step's quorum has ``n`` participating cells and this one is
  participant ``r``; it trains micro-batches ``r, r+n, r+2n, ...``. The share follows the
  quorum of the attempt, so a step retried with fewer cells gives each more.
- ``reduce_over_cell``: the metric sums, allreduced (SUM) through the torchft manager.
- ``take_optimizer_step``: the grads, flattened into one buffer and allreduced (SUM: each
  micro-batch's loss is already weighted by its share of the *global* batch, so the sum is
  the global gradient), then torchft's commit vote. A failed vote (a peer died or hung
  mid-allreduce) raises ``NotCommitted`` before anything changed, and ``train_step`` runs
  the step again in a new quorum of the cells still alive.

A cell restarted after a loss starts at torchft step 0; its first quorum sees peers ahead
of it and copies their state (``heal_state`` / ``load_heal_state``: weights, reference,
AdamW state, schedule position, RNGs, version) over torchft's HTTP checkpoint transport
before the step, so it trains the step as a full participant. The manager's step is the
policy version at all times.

Only one optimizer step per train step (``train.ppo_epochs: 1``): a retry re-runs the
whole step, which a second epoch's failure could not do after the first had committed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from datetime import timedelta
from typing import Any

import httpx
import torch

from gpu_runtime.proc import faults
from gpu_runtime.proc.http_client import http_client
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.common import lora as lora_lib
from gpu_runtime.trainer.common.batches import cell_reduced
from gpu_runtime.trainer.common.state_io import python_rng_state, set_python_rng_state
from gpu_runtime.trainer.dp.lighthouse import lighthouse_status
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from spec.train import TrainSpec
from spec.trainer import train_conflicts

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 20  # quorums one step may take before the cell gives up (each failed one is a peer lost)
# every live cell asks for the step's quorum at its start, so one forms within the lighthouse's
# join timeout (1 s) or heartbeat timeout (1 s); a request that waits this long fails, and
# ``train_step`` asks again (its connection to a restarted lighthouse may be stale). torchft's
# own retries stay off: they asked a just restarted lighthouse past ``_wait_until_peers_heard``
QUORUM_TIMEOUT_S = 15.0
QUORUM_RETRIES = 0
# after a failed quorum request (a dead or restarting lighthouse) a cell pauses this long
# before asking again
QUORUM_RETRY_PAUSE_S = 1.0
# a restarted lighthouse forms a quorum of the cells it has heard from: a cell asks it only once
# it hears as many cells as the cell's last quorum had, or after this long (a peer died meanwhile)
PEERS_HEARD_TIMEOUT_S = 20.0


class NotCommitted(RuntimeError):
    """torchft's vote failed: the step's grads are discarded and it is tried again."""


class NotHealed(RuntimeError):
    """A cell's quorum gave it no peer to copy from, and it does not hold the version the step
    trains from (a restarted cell whose peers' heartbeats the lighthouse has lost): it must
    not train the step on its own stale state."""


class StepNotCommitted(RuntimeError):
    """The step failed its commit vote ``MAX_ATTEMPTS`` times in a row."""


class DPCellTrainer(PolicyTrainer):
    """``PolicyTrainer`` of one DP cell; ``attach`` gives it its torchft manager."""

    manager: Any = None
    index: int = 0
    healed_from_step: int | None = None  # set when this cell's state came from a peer
    attempts: int = 0  # quorums the last step took
    participants: int = 0  # cells that trained the last step
    forced_participants: int | None = None  # a replay of a step that committed with fewer cells
    from_version: int | None = None  # the version the step trains from (set by the group for each call)
    _share: tuple[int, int] = (0, 1)
    lighthouse: str = ""  # its address: the cell reads its /status page before asking a restarted one
    _lighthouse_http: httpx.Client | None = None

    def attach(self, manager: Any, index: int, lighthouse: str = "") -> None:
        self.manager, self.index, self.lighthouse = manager, index, lighthouse
        manager.register_state_dict_fn("policy", self.load_heal_state, self.heal_state)
        self.sync_manager_step()

    def sync_manager_step(self) -> None:
        """The manager's step is the policy version (it decides who heals whom)."""
        self.manager.load_state_dict({"step": self.policy_version, "batches_committed": 0})

    # ---------------------------------------------------------------- the step
    def train_step(self, samples: list[Sample], rewards: list[float], group_size: int,
                   hparams: TrainSpec, temperature: float = 1.0) -> dict[str, float]:
        if bad := train_conflicts("cells", hparams):  # ``set_hparams`` may change ``train`` mid-run
            raise ValueError(f"trainer.cells > 1 does not support {'; '.join(bad)}")
        self.healed_from_step = None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            before = self.policy_version
            if attempt == 1:
                faults.cell_delay(self.index, before + 1, "quorum")
            self._wait_until_peers_heard()
            try:
                self.manager.start_quorum()  # synchronous: a healing cell has its peer's state after this
            except Exception as err:  # noqa: BLE001 - e.g. the lighthouse restarted under the request
                log.warning("cell %d: quorum for v%d failed (attempt %d): %s", self.index, before + 1, attempt, err)
                self.manager._quorum_future = None  # torchft re-raises a failed quorum at the next start_quorum
                time.sleep(QUORUM_RETRY_PAUSE_S)
                continue
            if self.policy_version != before:
                self.healed_from_step = before
                log.info("cell %d healed from a peer: v%d -> v%d", self.index, before, self.policy_version)
            if self.from_version is not None and self.policy_version != self.from_version:
                raise NotHealed(f"cell {self.index} holds v{self.policy_version} after quorum "
                                f"{self.manager._quorum_id}, the step trains from v{self.from_version}")
            rank, n = self.manager.participating_rank(), self.manager.num_participants()
            if rank is None:
                raise RuntimeError(f"cell {self.index}: not a participant of quorum {self.manager._quorum_id}")
            self._share = (rank, n)
            try:
                metrics = super().train_step(samples, rewards, group_size, hparams, temperature)
            except NotCommitted as err:
                log.warning("cell %d: step v%d attempt %d not committed (%s); new quorum", self.index,
                            self.policy_version + 1, attempt, err)
                continue
            self.attempts, self.participants = attempt, self._participating()[1]
            return {**metrics, "dp_cells": float(self.participants), "dp_attempts": float(attempt)}
        raise StepNotCommitted(f"cell {self.index}: step v{self.policy_version + 1} failed its commit vote "
                               f"{MAX_ATTEMPTS} times")

    def _wait_until_peers_heard(self) -> None:
        """Before asking a restarted lighthouse (its last quorum id behind this cell's) for a
        quorum, wait until it answers and hears as many cells as this cell's last quorum had.
        Asked earlier, while only this cell's heartbeat had reached it, it formed a quorum of
        this cell alone; the peer's own request then waited for a quorum its idle neighbour
        never joined, and the peer was lost (CI: a 1 s pause after the failed request, and
        torchft's own quorum retries, which bypassed any pause, were the only guards). After
        ``PEERS_HEARD_TIMEOUT_S`` it asks anyway (a peer that died meanwhile is not waited for)."""
        if not self.lighthouse or self.participants <= 1:
            return
        if self._lighthouse_http is None:
            self._lighthouse_http = http_client(timeout=2.0)
        deadline = time.monotonic() + PEERS_HEARD_TIMEOUT_S
        said: set[str] = set()
        while time.monotonic() < deadline:
            st = lighthouse_status(self.lighthouse, self._lighthouse_http)
            if st is not None and (st.quorum_id >= self.manager._quorum_id or st.heartbeating >= self.participants):
                return
            why = ("the lighthouse does not answer: waiting for its restart before asking it" if st is None else
                   f"the restarted lighthouse hears {st.heartbeating} of the {self.participants} cells of the last "
                   "quorum: waiting for their heartbeats before asking it")
            if why.split(":")[0] not in said:
                log.warning("cell %d: %s", self.index, why)
                said.add(why.split(":")[0])
            time.sleep(0.05)
        log.warning("cell %d: the lighthouse hears fewer cells than the last quorum had after %.0f s; asking it anyway",
                    self.index, PEERS_HEARD_TIMEOUT_S)

    def _participating(self) -> tuple[int, int]:
        rank, n = self._share
        f = self.forced_participants
        if f is not None and f <= n:  # replaying a step that fewer cells trained: the first f split it
            return (rank if rank < f else -1), f
        return rank, n

    def micro_batch_share(self, n: int) -> list[int]:
        rank, cells = self._participating()
        return [] if rank < 0 else list(range(rank, n, cells))

    def reduce_over_cell(self, sums: dict[str, float]) -> dict[str, float]:
        from torch.distributed import ReduceOp

        def allreduce_sum(t: torch.Tensor) -> None:
            self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()

        slot, slots = self._share  # this cell's rank in the step's quorum, and the quorum's size
        return cell_reduced(sums, slot, slots, allreduce_sum)

    def take_optimizer_step(self, hp: TrainSpec, what: str) -> float:
        from torch.distributed import ReduceOp

        faults.cell_delay(self.index, self.policy_version + 1)
        params = list(lora_lib.trainable_parameters(self.model))
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        if not self.manager.should_commit():
            self.optimizer.zero_grad(set_to_none=True)
            raise NotCommitted(str(self.manager.errored() or "the quorum voted not to commit"))
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        return super().take_optimizer_step(hp, what)

    # ---------------------------------------------------------------- state
    def heal_state(self) -> dict[str, Any]:
        """What a peer sends a healing cell (torchft's HTTP transport, torch serialization)."""
        tensors, groups = self.optimizer_state()
        ref = self.reference_state()
        return {
            "weights": {k: v.detach().clone() for k, v in self.trained_state().items()},
            "ref": {k: v.detach().clone() for k, v in ref.items()} if ref is not None else None,
            "optimizer": tensors, "param_groups": groups,
            "opt_steps": self.opt_steps, "policy_version": self.policy_version,
            "hparams": self.hparams.model_dump(mode="json"),
            "rng": torch.get_rng_state(), "py_random": python_rng_state(),
        }

    def load_heal_state(self, st: dict[str, Any]) -> None:
        self.load_trained_state(st["weights"])
        self.load_reference_state(st["ref"])
        self.hparams = TrainSpec.model_validate(st["hparams"])
        self.load_optimizer_state(self.hparams, st["optimizer"], st["param_groups"])
        torch.set_rng_state(st["rng"])
        set_python_rng_state(st["py_random"])
        self.opt_steps = int(st["opt_steps"])
        self.policy_version = int(st["policy_version"])
        self.model.train()

    def state_checksum(self) -> str:
        """Weights + AdamW state + schedule position + version: equal on every cell after a
        step, or the cells have diverged."""
        h = hashlib.sha256(self.checksum().encode())
        tensors, _ = self.optimizer_state()
        for k in sorted(tensors):
            h.update(k.encode())
            h.update(tensors[k].numpy().tobytes())
        h.update(f"{self.opt_steps}:{self.policy_version}".encode())
        return h.hexdigest()


def communicator_id(quorum_id: int, handles: list[str]) -> int:
    """The id of a quorum's gloo communicator, the prefix of its rendezvous keys on the first
    cell's store. torchft uses the quorum id, which a restarted lighthouse hands out from 1
    again: a quorum with a number the old lighthouse had used read that one's rendezvous (a
    dead listener's address: the healing cell failed to connect and its peer waited out the
    collective timeout). Each handle carries its cell's request count, so this differs for
    every quorum and is the same on each of its cells."""
    digest = hashlib.sha256(json.dumps([quorum_id, handles]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class _QuorumGuard:
    """The manager's client, as torchft's manager sees it, with one fix to its quorums.

    torchft rebuilds its process group only when the quorum id changes. A restarted
    lighthouse numbers its quorums from 1 again, so its first quorum can carry the id of the
    last one the cell configured for while holding other members (a peer lost meanwhile, or
    restarted): the cell kept the old group and its allreduce waited for a member that was
    not there (the collective timeout, then a new quorum). When the id repeats with other
    replicas, the guard makes the manager reconfigure."""

    def __init__(self, manager: Any) -> None:
        self._inner = manager._client
        self._manager = manager
        self._ids: list[str] = []

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        q = self._inner._quorum(*args, **kwargs)
        ids = list(q.replica_ids)
        if q.quorum_id == self._manager._quorum_id and ids != self._ids:
            log.warning("quorum %d repeats the last quorum's id with other replicas (a restarted lighthouse): "
                        "reconfiguring", q.quorum_id)
            self._manager._quorum_id = -1
        self._ids = ids
        return q

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _gloo(timeout: timedelta) -> Any:
    """torchft's gloo process group, its communicators named by ``communicator_id``."""
    from torchft.process_group import ProcessGroupGloo

    class Gloo(ProcessGroupGloo):
        requests = 0

        def get_reconfigure_handle(self) -> str:
            self.requests += 1
            return json.dumps({**json.loads(super().get_reconfigure_handle()), "request": self.requests})

        def reconfigure(self, opts: Any) -> Any:
            opts.uuid = communicator_id(opts.uuid, list(opts.handles))
            return super().reconfigure(opts)

    return Gloo(timeout=timeout)


def new_manager(trainer: DPCellTrainer, index: int, lighthouse_addr: str, timeout_s: float) -> Any:
    """The cell's torchft manager: a one-rank replica group (its own TCPStore), gloo across
    cells, synchronous quorum (a healing cell trains the step it healed in)."""
    from torch.distributed import TCPStore
    from torchft import Manager

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=_gloo(timeout), load_state_dict=None, state_dict=None, min_replica_size=1,
        use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
        quorum_retries=QUORUM_RETRIES, connect_timeout=timedelta(seconds=30), rank=0, world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port, lighthouse_addr=lighthouse_addr, replica_id=f"cell{index}",
        hostname="127.0.0.1", init_sync=False,
    )
    manager._milestone_store = store  # the store must outlive the manager
    manager._client = _QuorumGuard(manager)
    trainer.attach(manager, index, lighthouse_addr)
    return manager
