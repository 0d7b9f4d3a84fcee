"""A sharded trainer cell: N ranks of one FSDP2 group, placed by Ray, driven by one process.

The driver (the trainer process) owns a local Ray instance (``ray_runtime.RayRuntime``): it reserves
one bundle per rank in a placement group (``STRICT_PACK``: all ranks on one node), starts
one ``_Rank`` actor per bundle, and the ranks join a ``torch.distributed`` group over TCP
at rank 0's node address: gloo on the CPU; on CUDA (the trainer process's ``--device``) each rank
takes one GPU of the placement group and the group is NCCL (``fsdp2.device``). Every
driver call runs the same method on all ranks at once (FSDP's collectives need every
rank) and answers rank 0's result; the calls of the ranks' trainers are declared in
``rank_methods``. Ray is imported lazily: the ``cells`` extra is optional.

With ``trainer.placement: spread`` over a cluster of several machines the ranks sit on
different Ray nodes: the group's rendezvous is rank 0's node address, each rank's gloo
uses the interface holding its own node address (``network.py``), and a rank on another
node than the driver gets the folders a call names through Ray instead of the driver's
filesystem (``folders.py``: no shared filesystem is assumed).
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from gpu_runtime.proc.processes import reachable
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.fsdp2.device import cell_kind, prepare_rank, rank_bundle, this_rank
from gpu_runtime.trainer.fsdp2 import rank_methods
from gpu_runtime.trainer.fsdp2.errors import CellFailed, CellPlacementFailed, CellRankDied, CellRankHung, RayUnavailable
from gpu_runtime.trainer.fsdp2.folders import Tree, read_tree, write_tree
from gpu_runtime.trainer.fsdp2.network import pin_gloo_interface
from gpu_runtime.trainer.fsdp2.rank import CellRankTrainer
from gpu_runtime.trainer.fsdp2.rank_methods import RankMethod
from gpu_runtime.trainer.protocol import ALIVE, Alive, Dead, Health, TrainerDefaults
from spec.train import TrainSpec

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # a placement group not ready by then cannot be satisfied here
P = ParamSpec("P")
R = TypeVar("R")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class _Rank:
    """One rank's process (a Ray actor): joins the cell's group, then hosts a ``CellRankTrainer``."""

    def __init__(self, rank: int, threads: int, kind: str = "cpu") -> None:
        self.placement = this_rank(kind, rank)  # gloo on the CPU; NCCL on the GPU Ray assigned this actor
        prepare_rank(self.placement, threads)  # the single trainer process's determinism settings
        self.rank = rank
        self.trainer: Any = None

    def where(self) -> dict[str, Any]:
        """This rank's pid and Ray node (``milestone status`` lists them)."""
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(),
                "device": self.placement.device}

    def rendezvous(self) -> str:
        """The group's TCP rendezvous on this rank's node (rank 0's): ``ip:port``."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{_free_port()}"

    def join(self, master: str, world: int, timeout_s: float) -> None:
        """Join the cell's group; every collective waiting longer than ``timeout_s`` raises.
        Gloo binds the interface of this rank's Ray node address (``network.py``)."""
        import ray
        import torch.distributed as dist

        if self.placement.backend == "gloo":
            pin_gloo_interface(ray.util.get_node_ip_address())
        dist.init_process_group(self.placement.backend, init_method=f"tcp://{master}", rank=self.rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))

    def pid(self) -> int:
        return os.getpid()

    def peak_rss_mib(self) -> float:
        """This rank's peak resident memory (bench/bench_trainer_cell.py)."""
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def build(self, base_folder: str, hparams: TrainSpec, seed: int) -> None:
        self.trainer = CellRankTrainer.create_rank(base_folder, hparams, seed)

    def build_away(self, files: Tree, hparams: TrainSpec, seed: int) -> None:
        """``build`` on a rank that does not see the driver's files: the model folder's
        ``files`` written to a stage of this rank first (``folders.py``)."""
        with tempfile.TemporaryDirectory(prefix="cell-rank-") as stage:
            folder = Path(stage) / "model"
            write_tree(folder, files)
            self.build(str(folder), hparams, seed)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A declared method of the rank's trainer (``rank_methods.RANK_METHODS``), by name."""
        return rank_methods.serve(self.trainer, method, *args, **kwargs)

    def call_away(self, method: str, files: Tree | None, *args: Any, **kwargs: Any) -> tuple[Any, Tree]:
        """``call`` of a method that names a folder, on a rank that does not see the driver's
        files: the method runs on a stage of this rank (``files`` written there first when it
        reads the folder); its result, and the files it wrote there when it writes it."""
        use = rank_methods.declared(method).folder
        if use is None:
            raise ValueError(f"rank method {method!r} names no folder: call it with call()")
        with tempfile.TemporaryDirectory(prefix="cell-rank-") as stage:
            folder = Path(stage) / "folder"
            if use == "reads":
                write_tree(folder, files or {})
            out = self.call(method, str(folder), *args, **kwargs)
            return out, read_tree(folder) if use == "writes" else {}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


STRATEGIES = {"strict_pack": "STRICT_PACK", "spread": "SPREAD"}  # trainer.placement -> Ray's strategy
PEER_DEATH_GRACE_S = 10.0  # after a rank raised, how long Ray gets to report a peer's death (see _lost_peer)
STRAGGLER_GRACE_S = 30.0  # after the first rank answers, the others get the collective timeout plus this


class TrainerCell(TrainerDefaults):
    """N FSDP2 ranks as Ray actors in one placement group; the calls ``TrainerService`` makes
    of a ``PolicyTrainer`` (train_step, save_state, load_state, checksum, export) on all ranks.
    ``ray.init`` must have run in this process (``RayRuntime``).

    No call waits forever on a rank: a dead rank ends the wait at once (``CellRankDied``);
    a stopped one makes its peers' collectives time out after ``collective_timeout_s``, and
    once one rank has answered the others get that long again (``CellRankHung``)."""

    def __init__(self, ranks: int, base_folder: str | Path, hparams: TrainSpec, seed: int, *,
                 placement: str = "strict_pack", cpus_per_rank: float = 1.0, threads: int = 1,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S, collective_timeout_s: float = 120.0,
                 device: str = "cpu") -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if ranks < 1:
            raise ValueError(f"trainer.ranks_per_cell must be >= 1, got {ranks}")
        if placement not in STRATEGIES:
            raise ValueError(f"trainer.placement must be one of {sorted(STRATEGIES)}, got {placement!r}")
        self.ranks = ranks
        self.placement = placement
        self.kind = cell_kind(device)  # cpu | cuda: one GPU per rank, NCCL
        self.collective_timeout_s = collective_timeout_s
        self.actors: list[Any] = []
        self.away = [False] * ranks  # per rank: on another Ray node than this driver (set once placed)
        strategy = STRATEGIES[placement]
        try:
            self.pg = placement_group([rank_bundle(self.kind, cpus_per_rank)] * ranks, strategy=strategy)
            ray.get(self.pg.ready(), timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            resources = ray.cluster_resources()
            remove_placement_group(self.pg)
            _wait_released(self.pg)
            raise CellPlacementFailed(
                f"the cell's placement group ({ranks} bundles of {rank_bundle(self.kind, cpus_per_rank)}, "
                f"{strategy}) was not "
                f"satisfied within {placement_timeout_s:.0f} s: the Ray cluster has {resources}"
            ) from None
        except (ray.exceptions.RaySystemError, ConnectionError) as err:
            raise RayUnavailable(f"placing the cell: the Ray cluster is unreachable: {err}") from None
        # Dead once a rank failed: the cell cannot take another step (its failure: why, when it
        # was the cell, not a rank's Python error)
        self.health: Health = ALIVE
        actor = ray.remote(_Rank)
        on_gpu: dict[str, Any] = {} if self.kind == "cpu" else {"num_gpus": 1}  # Ray sets its CUDA_VISIBLE_DEVICES
        self.actors = [
            actor.options(num_cpus=cpus_per_rank, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=i), **on_gpu).remote(i, threads, self.kind)
            for i in range(ranks)
        ]
        try:
            master = ray.get(self.actors[0].rendezvous.remote(), timeout=placement_timeout_s)
            self._all(_Rank.join, master, ranks, collective_timeout_s)
            self.where = self._all(_Rank.where)
            # ranks on another Ray node than this driver do not see its files (folders.py)
            here = ray.get_runtime_context().get_node_id()
            self.away = [str(w["node_id"]) != here for w in self.where]
            model = ray.put(read_tree(base_folder)) if any(self.away) else None
            self._each([("build_away", (model, hparams, seed), {}) if away else
                        ("build", (str(base_folder), hparams, seed), {}) for away in self.away])
        except BaseException:
            self.close()
            raise

    def _all(self, fn: Callable[Concatenate[_Rank, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """``fn`` (a method of ``_Rank``) on every rank, with the same arguments (``_each``)."""
        return self._each([(fn.__name__, args, kwargs)] * len(self.actors))

    def _each(self, calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """On rank ``i``, its ``calls[i]`` = (method of ``_Rank``, args, kwargs). The first rank
        that fails ends the wait (its peers may be blocked in a collective with it, and are
        killed when the cell is closed); once one rank has answered, the others have
        ``collective_timeout_s`` plus a grace to follow."""
        import ray

        method = calls[0][0]
        refs = [getattr(a, name).remote(*args, **kwargs) for a, (name, args, kwargs) in zip(self.actors, calls)]
        pending = list(refs)
        first_done = False
        while pending:
            timeout = self.collective_timeout_s + STRAGGLER_GRACE_S if first_done else None
            try:
                done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            except (ray.exceptions.RaySystemError, ConnectionError) as err:
                raise self._fail(RayUnavailable(f"{method}: the Ray cluster is unreachable: {err}")) from None
            if not done:
                late = [refs.index(r) for r in pending]
                raise self._fail(CellRankHung(
                    f"ranks {late} of the cell did not finish {method} within {timeout:.0f} s of their peers "
                    "(a rank hung or stopped)"
                ))
            first_done = True
            try:
                ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
                raise self._lost(refs.index(done[0]), method, err) from None
            except ray.exceptions.RayTaskError as err:
                self.health = Dead()  # a rank raised: its peers may wait in a collective forever
                timed_out = _collective_timed_out(err)
                lost = None if timed_out else self._lost_peer(refs, pending, method)
                if lost is not None:  # its error was a dead peer's connection, seen first
                    raise lost from None
                cause = err.as_instanceof_cause()
                if timed_out:
                    raise self._fail(CellRankHung(
                        f"rank {refs.index(done[0])} of the cell: a collective timed out after "
                        f"{self.collective_timeout_s:.0f} s during {method} (trainer.collective_timeout_s: a peer "
                        f"rank hung or stopped): {str(err.cause).splitlines()[0] if err.cause else err}"
                    )) from None
                raise cause from None
        return ray.get(refs)

    def _lost_peer(self, refs: list[Any], pending: list[Any], method: str) -> CellFailed | None:
        """When a rank raised, whether a peer rank died (None: none did within a short grace).
        A SIGKILLed rank's peers blocked in a collective with it fail at once with gloo's
        "Connection reset by peer", often before Ray has noticed the actor's death; the
        cell's failure is then the lost rank (``CellRankDied``), not its peer's error."""
        import ray

        if not pending:
            return None
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_GRACE_S)
        for ref in done:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
                return self._lost(refs.index(ref), method, err)
            except Exception:  # noqa: BLE001 - another rank's own error: the first one is reported
                continue
        return None

    def _fail(self, err: CellFailed) -> CellFailed:
        """The cell cannot take another step: remember why (``CellHost`` reports it)."""
        self.health = Dead(err)
        return err

    def _lost(self, rank: int, method: str, err: Exception) -> CellFailed:
        """A rank's actor is gone: the rank died, or the whole Ray cluster did (its GCS no
        longer answers: the head stopped or restarted, taking every actor with it)."""
        gcs = _gcs_address()
        if gcs and not reachable(gcs):
            return self._fail(RayUnavailable(
                f"the Ray cluster's head ({gcs}) is unreachable: rank {rank} of the cell was lost during {method} "
                "(the head stopped or restarted; the next call reconnects)"))
        return self._fail(CellRankDied(f"rank {rank} of the cell died during {method}: {err}"))

    def _call(self, method: RankMethod[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``method`` of every rank's trainer: rank 0's result. A method that names a folder
        (its first argument) runs on a stage on the ranks away from this driver's files: the
        folder sent to them first, or what they wrote there written into it after."""
        if method.folder is None or not any(self.away):
            return self._all(_Rank.call, method.name, *args, **kwargs)[0]
        import ray

        folder, rest = str(args[0]), args[1:]
        files = ray.put(read_tree(folder)) if method.folder == "reads" else None
        results = self._each([("call_away", (method.name, files, *rest), kwargs) if away else
                              ("call", (method.name, folder, *rest), kwargs) for away in self.away])
        out = []
        for away, result in zip(self.away, results):
            if away:
                result, written = result
                write_tree(folder, written)
            out.append(result)
        return out[0]

    # ---- what the trainer service calls
    def train_step(self, samples: list[Sample], rewards: list[float], group_size: int,
                   hparams: TrainSpec, temperature: float = 1.0) -> dict[str, float]:
        return self._call(rank_methods.TRAIN_STEP, samples, rewards, group_size, hparams, temperature)

    def save_state(self, folder: str | Path) -> None:
        self._call(rank_methods.SAVE_STATE, str(folder))

    def load_state(self, folder: str | Path) -> None:
        self._call(rank_methods.LOAD_STATE, str(folder))

    def checksum(self) -> str:
        return str(self._call(rank_methods.CHECKSUM))

    def sft_step(self, rows: list[dict], hparams: TrainSpec) -> dict[str, float]:
        raise ValueError("trainer.backend fsdp2 does not support mode sft (the cell trains the RL step only)")

    def export_adapter_folder(self, folder: str | Path, base_model: str) -> None:
        raise ValueError("export_adapter_folder: trainer.backend fsdp2 trains no LoRA adapters")

    def broadcast_tensors(self, exported: Path) -> dict[str, torch.Tensor]:
        """The full weights, gathered from the ranks (``published_state``)."""
        return self.published_state()

    def published_state(self) -> dict[str, torch.Tensor]:
        """The full weights (gathered on rank 0 and sent here)."""
        return self._call(rank_methods.PUBLISHED_STATE)

    def export_model_folder(self, folder: str | Path) -> str:
        return str(self._call(rank_methods.EXPORT_MODEL_FOLDER, str(folder)))

    @property
    def policy_version(self) -> int:
        import ray

        try:
            return int(ray.get(self.actors[0].call.remote(rank_methods.POLICY_VERSION.name),
                               timeout=self.collective_timeout_s))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
            raise self._lost(0, "policy_version", err) from None
        except ray.exceptions.GetTimeoutError:
            raise self._fail(CellRankHung(f"rank 0 did not answer within {self.collective_timeout_s:.0f} s")) from None

    def pids(self) -> list[int]:
        return [int(w["pid"]) for w in self.where]

    def close(self) -> None:
        """Leave the group, end the actors and free the placement group (on an existing
        cluster: only this cell's actors and placement group)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        gcs = _gcs_address()
        if gcs and not reachable(gcs):  # the cluster is gone and took the actors with it (Ray calls would hang)
            log.warning("closing the cell: the Ray cluster's head %s is unreachable, nothing to end", gcs)
            return
        try:
            if isinstance(self.health, Alive) and self.actors:
                self._all(_Rank.close)
        except Exception as err:  # noqa: BLE001 - a dead rank: the actors are killed below anyway
            log.warning("closing the cell: %s", err)
        finally:
            for a in self.actors:
                try:
                    ray.kill(a)
                except Exception as err:  # noqa: BLE001 - a lost cluster took them already
                    log.warning("ending a rank: %s", err)
            try:
                remove_placement_group(self.pg)
                _wait_released(self.pg)
            except Exception as err:  # noqa: BLE001
                log.warning("removing the placement group: %s", err)


def _wait_released(pg: Any, timeout_s: float = 15.0) -> None:
    """Until the Ray cluster's resource view no longer holds any of ``pg``'s bundles on a node
    that can still give them back: the next cell's group is placed against that view.

    ``remove_placement_group`` only asks. The group's table state reads ``REMOVED`` within a
    few ms, but the GCS gets a node's CPUs back only when that node's raylet reports the
    returned bundle: 20-95 ms later on a quiet machine (measured, Ray 2.60), longer under load.
    A ``spread`` cell placed in between finds the other node's CPUs still held and puts every
    bundle on this one (SPREAD is best effort): seen in CI twice, the second time after a wait
    for ``REMOVED`` alone. A bundle shows in a node's resources as ``<resource>_group_<pg id>``
    entries, which leave together with the CPUs' return.

    A node whose raylet no longer answers (its host was lost) keeps its bundle in the view until
    Ray counts the node dead; it is not waited for: a heal goes on with the nodes that are left."""
    from ray._private.state import total_resources_per_node

    suffix = f"_{pg.id.hex()}"
    deadline = time.monotonic() + timeout_s
    while True:
        held = {node for node, resources in total_resources_per_node().items()
                if any(name.endswith(suffix) for name in resources)}
        waiting = [n for n in _raylets(held) if reachable(n, timeout_s=0.5)]
        if not waiting:
            return
        if time.monotonic() >= deadline:
            log.warning("the cell's placement group still holds resources on %s after %.0f s",
                        ", ".join(waiting), timeout_s)
            return
        time.sleep(0.02)


def _raylets(node_ids: set[str]) -> list[str]:
    """``HOST:PORT`` of the raylets of those of ``node_ids`` Ray counts alive."""
    import ray

    return [f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}" for n in ray.nodes()
            if n["NodeID"] in node_ids and n["Alive"]]


def _gcs_address() -> str | None:
    import ray

    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # noqa: BLE001 - not connected
        return None


def _collective_timed_out(err: Exception) -> bool:
    """A gloo/NCCL collective that gave up waiting for a peer (``collective_timeout_s``)."""
    text = str(getattr(err, "cause", None) or err)
    return "Timed out" in text or "timed out" in text or "Timeout" in text


__all__ = ["CellFailed", "CellPlacementFailed", "CellRankDied", "CellRankHung", "RayUnavailable", "TrainerCell"]
