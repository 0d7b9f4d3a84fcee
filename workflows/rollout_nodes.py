"""The rollout nodes a run holds (``engines.nodes`` = R > 0), as ``TrainingRun`` keeps them
between steps: claimed from the rollout pool, watched for liveness like the trainer's
node, given the run's current version before they serve anything, and replaced at a step
boundary when lost (``ensure``).

A node lost during a step was dropped by the step (``workflows.step_nodes``); one lost
between steps is found by its liveness watch. Either way the run moves its fence to a new
epoch before it claims a replacement, so the lost node, should it come back, writes
nothing. A node that joins (a replacement, or ``milestone set engines.nodes=R``) pulls the
committed version from the trainer's node and is given to the next step only once its
engines serve it.

Deterministic: only workflow APIs and the state it is given.
"""

from __future__ import annotations

from collections.abc import Callable

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from spec.engine import EngineSpec
    from spec.events import NodeClaimed, NodeLost, RunEvent
    from spec.run import RunConfig
    from spec.status import EngineSlotInfo
    from workflows.contracts.placement import ClaimNodeInput, FencePlacementInput, NodeClaim
    from workflows.contracts.training import UpdateWeightsInput, UpdateWeightsResult
    from workflows.failures import Failure, failure_in
    from workflows.node_watch import NodeWatch
    from workflows.run_state import RunState
    from workflows.stubs import CLAIM_ROLLOUT_NODE, FENCE_PLACEMENT, UPDATE_WEIGHTS


def _now() -> str:
    return workflow.now().isoformat()


class RolloutNodes:
    """``on_event``: the run's event log (``TrainingRun._event``)."""

    def __init__(self, on_event: Callable[[RunEvent], None]) -> None:
        self.watches: dict[str, NodeWatch] = {}  # rollout node queue -> its liveness watch
        self.on_event = on_event
        self.engines: dict[str, list[EngineSlotInfo]] = {}  # queue -> its engines, as last pushed to

    @staticmethod
    def target(cfg: RunConfig, st: RunState) -> int:
        """How many rollout nodes the run wants now (``set_engines`` wins over the config)."""
        return cfg.engines.nodes if st.num_nodes is None else st.num_nodes

    def queues(self, st: RunState) -> list[str]:
        return [n.task_queue for n in st.rollout_nodes]

    def all_engines(self, st: RunState) -> list[EngineSlotInfo]:
        return [e for q in self.queues(st) for e in self.engines.get(q, [])]

    async def finish(self) -> None:
        """Stop every watch (the run ends or continues as new) and wait until each has ended."""
        watches, self.watches = list(self.watches.values()), {}
        for watch in watches:
            await watch.finish()

    def _watch(self, run_id: str, cfg: RunConfig, queue: str) -> NodeWatch:
        watch = self.watches.get(queue)
        if watch is None:
            watch = self.watches[queue] = NodeWatch()
        watch.start(run_id, queue, cfg.node)
        return watch

    def _forget(self, queue: str) -> None:
        watch = self.watches.pop(queue, None)
        if watch is not None:
            watch.stop()
        self.engines.pop(queue, None)

    async def ensure(
        self, run_id: str, cfg: RunConfig, st: RunState, engines: EngineSpec, *, lost: list[str],
        trainer_placed: bool, push_all: bool = False,
    ) -> None:
        """At a step boundary (or at placement): drop the lost rollout nodes (``lost``: those the
        last step dropped, plus any whose watch ended), move the fence past them unless the
        trainer's placement just did (``trainer_placed``), shrink or fill up to the target, and
        bring every new node (every node: ``push_all``, after the trainer moved) to the run's
        committed version, pulled from the trainer's node."""
        assert st.node is not None
        for held in st.rollout_nodes:  # watched again after a continue-as-new
            self._watch(run_id, cfg, held.task_queue)
        gone = set(lost) | {q for q, w in self.watches.items() if w.ended()}
        dropped = [n for n in st.rollout_nodes if n.task_queue in gone]
        for node in dropped:
            self.on_event(NodeLost(at=_now(), queue=node.task_queue, message="rollout node lost",
                                   step=st.next_step - 1 if st.next_step > 1 else None, role="rollout"))
            self._forget(node.task_queue)
        st.rollout_nodes = [n for n in st.rollout_nodes if n.task_queue not in gone]
        if dropped and not trainer_placed:
            await self._raise_fence(run_id, cfg, st)
        target = self.target(cfg, st)
        while len(st.rollout_nodes) > target:  # set engines.nodes lower: the newest nodes leave
            self._forget(st.rollout_nodes.pop().task_queue)
        pending = list(st.rollout_nodes) if push_all else []
        excluded = sorted(gone)
        while pending or len(st.rollout_nodes) < target:
            if not pending:
                claim = await self._claim(run_id, cfg, st, excluded)
                st.rollout_nodes.append(claim)
                pending.append(claim)
            node = pending.pop(0)
            try:
                await self._bring_up(run_id, cfg, st, engines, node)
            except (ActivityError, ApplicationError) as err:
                kind, message = failure_in(err)
                if kind != Failure.NODE_LOST:
                    raise
                self.on_event(NodeLost(at=_now(), queue=node.task_queue, message=message, role="rollout"))
                self._forget(node.task_queue)
                st.rollout_nodes = [n for n in st.rollout_nodes if n.task_queue != node.task_queue]
                excluded.append(node.task_queue)
                if not trainer_placed:
                    await self._raise_fence(run_id, cfg, st)
        st.engines = self.all_engines(st)

    async def _claim(self, run_id: str, cfg: RunConfig, st: RunState, excluded: list[str]) -> NodeClaim:
        assert st.node is not None
        claim = await CLAIM_ROLLOUT_NODE.run(
            ClaimNodeInput(run_id=run_id, exclude_queues=excluded, store_uri=cfg.store,
                           held_queues=[st.node.task_queue, *self.queues(st)]),
            summary=f"claim a rollout node ({len(st.rollout_nodes) + 1} of {self.target(cfg, st)})",
        )
        self.on_event(NodeClaimed(at=_now(), queue=claim.task_queue, role="rollout"))
        return claim

    async def _bring_up(self, run_id: str, cfg: RunConfig, st: RunState, engines: EngineSpec,
                        node: NodeClaim) -> None:
        """``node``'s engines serving the committed version (pulled from the trainer's node)."""
        assert st.node is not None
        watch = self._watch(run_id, cfg, node.task_queue)
        synced: UpdateWeightsResult = await watch.on_live_node(run_id, node.task_queue, cfg.node, UPDATE_WEIGHTS.run(
            UpdateWeightsInput(
                run_id=run_id, store_uri=cfg.store, policy_version=st.policy_version, checksum=st.checksum,
                engines=engines, source_url=st.node.weights_url,
            ),
            queue=node.task_queue, summary=f"start engines @ v{st.policy_version} on rollout node {node.node_id}",
        ))
        st.add_events(synced.node_events)
        self.engines[node.task_queue] = synced.engines

    async def _raise_fence(self, run_id: str, cfg: RunConfig, st: RunState) -> None:
        """A new epoch for the run's placement: the nodes it left behind write nothing from now on."""
        assert st.node is not None
        epoch = st.node.epoch + 1
        if cfg.store:
            await FENCE_PLACEMENT.run(
                FencePlacementInput(run_id=run_id, store_uri=cfg.store, epoch=epoch, node=st.node.node_id,
                                    from_step=st.next_step),
                summary=f"fence epoch {epoch}: rollout nodes changed",
            )
        st.node = st.node.model_copy(update={"epoch": epoch})

    def record_engines(self, st: RunState, engines: list[EngineSlotInfo]) -> None:
        """A step's engines (each stamped with its node id) as the rollout nodes' latest."""
        for node in st.rollout_nodes:
            mine = [e for e in engines if e.node == node.node_id]
            if mine:
                self.engines[node.task_queue] = mine
