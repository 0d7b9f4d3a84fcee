"""``TrainingRun``: one per run. Owns the data cursor and the policy version and
advances them only after a step child (``RLStep``, in mode sft ``SFTStep``) commits
(exactly-once data ownership: ``RunState.commit``).

prepare the dataset -> place on a node (claim, SFT warm-up or restore, engines up) ->
held-out eval of v0 -> per step: wait while paused, continue-as-new when due, the step
as a child (re-placed when its node is lost, paused on a divergence), commit.
"""

from __future__ import annotations

import hashlib
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from spec.rollout import rl_sampling_conflicts
    from spec.engine import EngineSpec, EngineUpdate
    from spec.run import RunConfig
    from spec.event_text import event_text
    from spec.events import (
        Divergence, EnginesSet, EvalFailed, EvalSkipped, HParamsSet, NodeClaimed, NodeLost, RunEvent,
    )
    from spec.strict import format_validation_error
    from spec.train import HParamUpdate
    from spec.trainer_rpc import ForkPoint
    from workflows import cell_heal
    from workflows.contracts.placement import ClaimNodeInput, PrepareDataInput
    from workflows.run_details import hparam_update_refused, run_details
    from workflows.run_state import RunProgress, RunState, RunSummary, TrainingRunInput
    from workflows.contracts.step import RLStepInput, StepSummary
    from workflows.contracts.training import EvalResult
    from workflows.failures import Failure, failure, failure_details, failure_in
    from workflows.node_watch import NodeWatch
    from workflows.rollout_nodes import RolloutNodes
    from workflows.trainer_node import init_trainer_node
    from workflows.queues import CONTROL_QUEUE
    from workflows.rl_step import RLStep
    from workflows.sft_step import SFTStep
    from workflows.step_phases import evaluate
    from workflows.stubs import CLAIM_NODE, PREPARE_DATA

SA_STEP = SearchAttributeKey.for_int("RlStep")
SA_REWARD = SearchAttributeKey.for_float("RlReward")
SA_VERSION = SearchAttributeKey.for_int("RlPolicyVersion")
SA_STATUS = SearchAttributeKey.for_keyword("RlStatus")
MAX_NODE_REPLACEMENTS = 10


def config_hash(cfg: RunConfig) -> str:
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]


def _now() -> str:
    """An event's ``at``: the workflow's clock, the same on replay."""
    return workflow.now().isoformat()


@workflow.defn(name="TrainingRun")
class TrainingRun:
    def __init__(self) -> None:
        self.cfg: RunConfig | None = None
        self.st = RunState()
        self.lineage: list[ForkPoint] = []
        self.watch = NodeWatch()
        self.rollout = RolloutNodes(self._event)  # engines.nodes > 0: the run's rollout nodes
        self.status = "initializing"

    # ---- the loop ----------------------------------------------------------------
    @workflow.run
    async def run(self, raw: Any = None) -> RunSummary:
        """``raw`` is the ``TrainingRunInput`` as decoded JSON, validated here: a bad
        field started from the Temporal CLI fails the run at once, naming the field,
        instead of failing the workflow task forever in the data converter."""
        inp = self._validated(raw)
        self.cfg = cfg = inp.config
        self.st = inp.state or RunState(train=cfg.train)
        self.lineage = inp.lineage
        run_id, chash = workflow.info().workflow_id, config_hash(cfg)
        await self._set_up(run_id, chash)
        steps_this_run = 0
        while self.st.next_step <= cfg.steps:
            await self._between_steps(steps_this_run)
            summary = await self._run_step(run_id, chash)
            self.st = self.st.commit(summary, workflow.now(), cfg.trainer)
            self.rollout.record_engines(self.st, summary.engines)
            steps_this_run += 1
        await self.watch.finish()
        await self.rollout.finish()
        self.status = "completed"
        self._publish()
        return self.st.summary(run_id)

    def _validated(self, raw: Any) -> TrainingRunInput:
        try:
            return TrainingRunInput.model_validate(raw)
        except ValidationError as err:
            self.status = "failed"
            raise failure(Failure.INVALID_INPUT, "invalid TrainingRun input:\n" + format_validation_error(err)) from None

    async def _set_up(self, run_id: str, chash: str) -> None:
        """A new run: its dataset, a node, v0 and its held-out eval. A continued one: a node
        when it has none (it continued as new while re-placing)."""
        cfg, st = self.cfg, self.st
        assert cfg is not None
        if st.initialized:
            if st.node is None:
                await self._place_on_node(run_id, chash, init=False)
            return
        self._refuse_untrainable_sampling()
        st.dataset = await PREPARE_DATA.run(
            PrepareDataInput(
                run_id=run_id, store_uri=cfg.store, seed=cfg.seed, data=cfg.data, reward=cfg.reward, eval=cfg.eval,
                mode=cfg.mode,
            ),
            summary="prepare dataset",
        )
        if cfg.eval.enabled and st.dataset.eval_key is None:
            arithmetic = cfg.data.kind in ("arithmetic", "reasoning_gym")  # generated
            why = "every prompt is in the train set" if arithmetic else "data.eval_path is not set"
            self._event(EvalSkipped(at=_now(), why=why))
        await self._place_on_node(run_id, chash, init=True)
        st.initialized = True
        if cfg.eval.enabled and st.dataset.eval_key:
            st.eval_before = await self._eval_before_rl(run_id)

    def _refuse_untrainable_sampling(self) -> None:
        """A new RL run whose rollout samples a distribution the trainer cannot train (greedy,
        top-p, top-k: ``spec.rollout.rl_sampling_conflicts``) fails at once, naming the field."""
        cfg = self.cfg
        assert cfg is not None
        if cfg.mode == "rl" and (bad := rl_sampling_conflicts(cfg.rollout)):
            self.status = "failed"
            raise failure(Failure.INVALID_INPUT, "invalid TrainingRun input:\n" + "\n".join(
                f"{key}: {why}" for key, why in bad))

    async def _between_steps(self, steps_this_run: int) -> None:
        """Wait while paused; continue as new when this execution has run its share of steps
        (or its history grew large)."""
        cfg = self.cfg
        assert cfg is not None
        self.status = "paused" if self.st.paused else "running"
        self._publish()
        await workflow.wait_condition(lambda: not self.st.paused)
        self.status = "running"
        if steps_this_run >= cfg.steps_per_workflow_run or workflow.info().is_continue_as_new_suggested():
            await self.watch.finish()  # the next execution watches the nodes again
            await self.rollout.finish()
            workflow.continue_as_new(TrainingRunInput(config=cfg, state=self.st, lineage=self.lineage))

    async def _eval_before_rl(self, run_id: str) -> EvalResult | None:
        """The post-SFT policy (v0, served since placement) on the held-out split, so the
        summary shows before -> after. Observational: a failure is an event, and a lost
        node is found and replaced by the first step."""
        cfg, st = self.cfg, self.st
        assert cfg is not None and st.dataset is not None and st.node is not None and st.train is not None
        inp = RLStepInput(
            run_id=run_id, step=0, config=cfg, train=st.train, policy_version=0, data_cursor=0,
            dataset=st.dataset, node_queue=st.node.task_queue, epoch=st.node.epoch,
            rollout_queues=self.rollout.queues(st),
        )
        try:
            result, events = await evaluate(inp, 0)
        except (ActivityError, ApplicationError) as err:
            result, events = None, [EvalFailed(at=_now(), step=0, message=failure_in(err)[1])]
        st.add_events(events)
        return result

    def _engines(self) -> EngineSpec:
        """The ``engines`` section now: the config's, with ``set_engines``'s count once one was set."""
        assert self.cfg is not None
        n = self.st.num_engines
        return self.cfg.engines if n is None else self.cfg.engines.model_copy(update={"num_engines": n})

    def _step_input(self, run_id: str) -> RLStepInput:
        cfg, st = self.cfg, self.st
        assert cfg is not None and st.dataset is not None and st.train is not None and st.node is not None
        if st.num_engines is not None:  # set_engines: the step's engines (a config without it is the run's own)
            cfg = cfg.model_copy(update={"engines": self._engines()})
        return RLStepInput(
            run_id=run_id, step=st.next_step, config=cfg, train=st.train,
            policy_version=st.policy_version, data_cursor=st.data_cursor,
            dataset=st.dataset, node_queue=st.node.task_queue, epoch=st.node.epoch,
            buffer=st.buffer,
            restart_cells=cell_heal.due(st.cell_heal, workflow.now()),
            rollout_queues=self.rollout.queues(st), weights_url=st.node.weights_url,
        )

    async def _run_step(self, run_id: str, chash: str) -> StepSummary:
        """Run the step as a child. A lost node is replaced and the step re-run; a
        divergence (NaN) pauses the run on its last good state until ``resume``."""
        cfg, st = self.cfg, self.st
        assert cfg is not None
        replacements = 0
        lost = st.history[-1].lost_rollout_queues if st.history else []
        while True:
            assert st.node is not None
            if self.rollout.target(cfg, st) or st.rollout_nodes:  # engines.nodes > 0: lost ones replaced, joins
                await self.rollout.ensure(run_id, cfg, st, self._engines(), lost=lost, trainer_placed=False)
            sft = cfg.mode == "sft"
            child = workflow.execute_child_workflow(
                SFTStep.run if sft else RLStep.run,
                self._step_input(run_id),
                id=f"{run_id}/step-{st.next_step}",
                task_queue=CONTROL_QUEUE,
                static_summary=f"{'SFT' if sft else 'RL'} step {st.next_step} of {cfg.steps}",
            )
            try:
                return await self.watch.on_live_node(run_id, st.node.task_queue, cfg.node, child)
            except (ChildWorkflowError, ApplicationError) as err:  # ApplicationError: NodeLost from the watch
                kind, message = failure_in(err)
                if kind == Failure.ROLLOUT_NODES_LOST:  # every rollout node lost: replaced above, the step re-run
                    lost = [*lost, *(failure_details(err, kind)[0] if failure_details(err, kind) else [])]
                    continue
                if kind == Failure.DIVERGENCE:
                    self._event(Divergence(at=_now(), step=st.next_step, message=message))
                    st.paused = True
                    self.status = "paused"
                    self._publish()
                    await workflow.wait_condition(lambda: not self.st.paused)
                    self.status = "running"
                    continue
                if kind != Failure.NODE_LOST:
                    raise
                replacements += 1
                self._event(NodeLost(at=_now(), queue=st.node.task_queue, step=st.next_step, message=message))
                if replacements > MAX_NODE_REPLACEMENTS:
                    raise failure(Failure.NODE_LOST, f"gave up after {MAX_NODE_REPLACEMENTS} node replacements") from err
                await self._place_on_node(run_id, chash, init=False)

    async def _place_on_node(self, run_id: str, chash: str, *, init: bool) -> None:
        """Claim a node, bring its trainer to the committed version and its engines up."""
        cfg, st = self.cfg, self.st
        assert cfg is not None and st.dataset is not None and st.train is not None
        exclude = [st.node.task_queue] if st.node else []
        while True:
            st.node = await CLAIM_NODE.run(
                ClaimNodeInput(run_id=run_id, exclude_queues=exclude, store_uri=cfg.store,
                               held_queues=self.rollout.queues(st)),  # never one of the run's rollout nodes
                summary="claim a node",
            )
            self._event(NodeClaimed(at=_now(), queue=st.node.task_queue))
            try:
                await self.watch.on_live_node(run_id, st.node.task_queue, cfg.node, self._init_node(run_id, chash, init))
                return
            except (ActivityError, ApplicationError) as err:  # NodeLost: a timeout, said by the activity or the watch
                if failure_in(err)[0] != Failure.NODE_LOST:
                    raise
                exclude = [st.node.task_queue]
                self._event(NodeLost(at=_now(), queue=st.node.task_queue, message=failure_in(err)[1]))

    async def _init_node(self, run_id: str, chash: str, init: bool) -> None:
        """The claimed node's trainer to the committed version, the run's engines up."""
        assert self.cfg is not None
        await init_trainer_node(run_id, chash, init, self.cfg, self.st, self.lineage, self._engines(), self.rollout)

    # ---- observability -----------------------------------------------------------
    def _event(self, event: RunEvent) -> None:
        self.st.add_events([event])
        workflow.logger.info("run event %s: %s", event.kind, event_text(event))

    def _publish(self) -> None:
        st = self.st
        last = st.history[-1] if st.history else None
        workflow.upsert_search_attributes(
            [
                SA_STEP.value_set(st.next_step - 1),
                SA_VERSION.value_set(st.policy_version),
                SA_STATUS.value_set(self.status),
                *([SA_REWARD.value_set(last.reward_mean)] if last else []),
            ]
        )
        workflow.set_current_details(run_details(self.status, st, self.cfg.steps if self.cfg else None, self.lineage))

    # ---- control -----------------------------------------------------------------
    @workflow.query
    def progress(self) -> RunProgress:
        st = self.st
        return RunProgress(
            run_id=workflow.info().workflow_id,
            state="paused" if st.paused and self.status == "running" else self.status,
            step=st.next_step - 1,
            total_steps=self.cfg.steps if self.cfg else 0,
            policy_version=st.policy_version,
            data_cursor=st.data_cursor,
            node_queue=st.node.task_queue if st.node else None,
            trainer_node=st.node,
            rollout_nodes=st.rollout_nodes,
            lineage=self.lineage,
            steps=st.history,
            events=st.events,
            engines=st.engines,
            cells=st.cells,
            dp=st.dp,
            cell_heal=st.cell_heal,
            mode=self.cfg.mode if self.cfg else "rl",
        )

    @workflow.signal
    def node_event(self, event: RunEvent) -> None:
        """An event a node reports outside any activity result (``stale_write_refused``
        from a node the run has left behind: its results are no longer awaited)."""
        self.st.add_events([event])
        workflow.logger.warning("node event %s: %s", event.kind, event_text(event))

    @workflow.signal
    def pause(self) -> None:
        self.st.paused = True

    @workflow.signal
    def resume(self) -> None:
        self.st.paused = False

    @workflow.update
    def set_hparams(self, update: HParamUpdate) -> dict:
        assert self.st.train is not None
        self.st.train = update.apply(self.st.train)
        self._event(HParamsSet(at=_now(), values=update.given()))
        return self.st.train.model_dump()

    @workflow.update
    def set_engines(self, update: EngineUpdate) -> dict:
        """The engine count per node, or the rollout nodes, from the next step on (the fleets grow or
        shrink then; a new rollout node joins once it serves the run's version)."""
        assert self.cfg is not None
        if update.num_engines is not None:
            self._event(EnginesSet(at=_now(), before=self._engines().num_engines, after=update.num_engines))
            self.st.num_engines = update.num_engines
        if update.nodes is not None:
            before = RolloutNodes.target(self.cfg, self.st)
            self._event(EnginesSet(at=_now(), before=before, after=update.nodes, setting="nodes"))
            self.st.num_nodes = update.nodes
        return update.model_dump(exclude_none=True)

    @set_engines.validator
    def _validate_engines(self, update: EngineUpdate) -> None:
        if self.cfg is not None and self.cfg.mode != "rl":
            raise ValueError(f"set_engines: mode {self.cfg.mode} runs no engines between steps")
        if self.cfg is not None and update.nodes is not None:
            try:  # the config's rules for engines.nodes (weight_sync, release_memory) hold for a set value too
                EngineSpec.model_validate(self._engines().model_dump() | {"nodes": update.nodes})
            except ValidationError as err:
                raise ValueError(f"set_engines: {format_validation_error(err)}") from None

    @set_hparams.validator
    def _validate_hparams(self, update: HParamUpdate) -> None:
        assert self.st.train is not None
        if why := hparam_update_refused(self.cfg, self.st.train, update):
            raise ValueError(f"set_hparams: {why}")


RUN_WORKFLOWS = [TrainingRun, RLStep, SFTStep]  # a run and its step children: what the control worker runs
