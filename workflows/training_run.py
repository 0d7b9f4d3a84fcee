"""``TrainingRun``: one per run. Owns the data cursor and the policy version and
advances them only after an ``RLStep`` child commits (exactly-once data ownership).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from workflows.config import HParamUpdate, RunConfig, TrainSpec, format_validation_error, mode_conflicts
    from workflows.trainer_config import megatron_train_conflicts
    from workflows.contracts.events import RunEvent
    from workflows.contracts.placement import (
        ClaimNodeInput,
        ForkPoint,
        InitPolicyInput,
        PrepareDataInput,
    )
    from workflows.contracts.run_state import RunProgress, RunState, RunSummary, TrainingRunInput
    from workflows.contracts.step import RLStepInput, StepSummary
    from workflows.contracts.training import EvalResult, UpdateWeightsInput
    from workflows.queues import CONTROL_QUEUE
    from workflows import cell_heal
    from workflows.failures import Failure, failure, failure_in
    from workflows.node_watch import NodeWatch
    from workflows.rl_step import RLStep, evaluate
    from workflows.stubs import CLAIM_NODE, INIT_POLICY, PREPARE_DATA, UPDATE_WEIGHTS

SA_STEP = SearchAttributeKey.for_int("RlStep")
SA_REWARD = SearchAttributeKey.for_float("RlReward")
SA_VERSION = SearchAttributeKey.for_int("RlPolicyVersion")
SA_STATUS = SearchAttributeKey.for_keyword("RlStatus")
HISTORY_KEEP = 200
EVAL_BEFORE_PATCH = "eval-before-rl"  # runs recorded before it replay without the v0 eval
SUMMARY_STEPS = 5  # the summary compares the mean reward of the first and last 5 steps
MAX_NODE_REPLACEMENTS = 10


def last_eval(history: list[StepSummary]) -> StepSummary | None:
    """The newest step that carries eval numbers."""
    return next((s for s in reversed(history) if s.eval_greedy is not None), None)


def config_hash(cfg: RunConfig) -> str:
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]


@workflow.defn(name="TrainingRun")
class TrainingRun:
    def __init__(self) -> None:
        self.cfg: RunConfig | None = None
        self.st = RunState()
        self.lineage: list[ForkPoint] = []
        self.watch = NodeWatch()
        self.status = "initializing"

    # ---- the RL loop -------------------------------------------------------------
    @workflow.run
    async def run(self, raw: Any = None) -> RunSummary:
        """``raw`` is the ``TrainingRunInput`` as decoded JSON, validated here: a bad
        field started from the Temporal CLI fails the run at once, naming the field,
        instead of failing the workflow task forever in the data converter."""
        try:
            inp = TrainingRunInput.model_validate(raw)
        except ValidationError as err:
            self.status = "failed"
            raise failure(Failure.INVALID_INPUT, "invalid TrainingRun input:\n" + format_validation_error(err)) from None
        self.cfg = cfg = inp.config
        self.st = st = inp.state or RunState(train=cfg.train)
        self.lineage = inp.lineage
        run_id = workflow.info().workflow_id
        chash = config_hash(cfg)
        steps_this_run = 0

        if not st.initialized:
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
                self._event("eval_skipped", f"no held-out split ({why}): the run is not evaluated")
            await self._place_on_node(run_id, chash, init=True)
            st.initialized = True
            if cfg.eval.enabled and st.dataset.eval_key and workflow.patched(EVAL_BEFORE_PATCH):
                st.eval_before = await self._eval_before_rl(run_id)
        elif st.node is None:
            await self._place_on_node(run_id, chash, init=False)

        while st.next_step <= cfg.steps:
            self.status = "paused" if st.paused else "running"
            self._publish()
            await workflow.wait_condition(lambda: not self.st.paused)
            self.status = "running"
            if steps_this_run >= cfg.steps_per_workflow_run or workflow.info().is_continue_as_new_suggested():
                await self.watch.finish()  # the next execution watches the node again
                workflow.continue_as_new(TrainingRunInput(config=cfg, state=st, lineage=self.lineage))
            summary = await self._run_step(run_id, chash)
            # commit: the only place the cursor and the version move
            st.policy_version = summary.policy_version
            st.data_cursor = summary.data_cursor
            # one_step_off / fully_async: the next steps' batches, already sampled (a summary recorded
            # before the buffer existed carries one_step_off's as next_sampled)
            st.buffer = summary.next_buffer or ([summary.next_sampled] if summary.next_sampled else [])
            st.prefetched = None
            st.history = [
                *st.history,
                summary.model_copy(update={"events": [], "engines": [], "cell": None, "next_sampled": None,
                                           "next_buffer": [], "dp": None}),
            ][-HISTORY_KEEP:]
            st.events = [*st.events, *summary.events][-100:]
            st.engines = summary.engines
            st.cells = [summary.cell] if summary.cell is not None else []
            if summary.dp is not None or summary.cell_restarts:  # trainer.cells > 1: schedule the lost cells' restarts
                st.dp = summary.dp or st.dp
                st.cell_heal = cell_heal.after_step(st.cell_heal, summary.dp, summary.cell_restarts, workflow.now(),
                                                    cfg.trainer)
            if len(st.first_rewards) < SUMMARY_STEPS:
                st.first_rewards.append(summary.reward_mean)
            st.next_step += 1
            steps_this_run += 1

        await self.watch.finish()
        self.status = "completed"
        self._publish()
        last = st.history[-SUMMARY_STEPS:]
        evaluated = last_eval(st.history)
        return RunSummary(
            run_id=run_id,
            steps=st.next_step - 1,
            policy_version=st.policy_version,
            data_cursor=st.data_cursor,
            first_reward_mean=sum(st.first_rewards) / max(1, len(st.first_rewards)),
            last_reward_mean=sum(s.reward_mean for s in last) / max(1, len(last)),
            final_weights_key=st.history[-1].weights_key if st.history else "",
            eval_before_greedy=st.eval_before.greedy_accuracy if st.eval_before else None,
            eval_before_pass_at_k=st.eval_before.pass_at_k if st.eval_before else None,
            eval_step=evaluated.step if evaluated else None,
            eval_greedy=evaluated.eval_greedy if evaluated else None,
            eval_pass_at_k=evaluated.eval_pass_at_k if evaluated else None,
            eval_k=evaluated.eval_k if evaluated else None,
        )

    async def _eval_before_rl(self, run_id: str) -> EvalResult | None:
        """The post-SFT policy (v0, served since placement) on the held-out split, so the
        summary shows before -> after. Observational: a failure is an event, and a lost
        node is found and replaced by the first step."""
        cfg, st = self.cfg, self.st
        assert cfg is not None and st.dataset is not None and st.node is not None and st.train is not None
        inp = RLStepInput(
            run_id=run_id, step=0, config=cfg, train=st.train, policy_version=0, data_cursor=0,
            dataset=st.dataset, node_queue=st.node.task_queue, epoch=st.node.epoch,
        )
        try:
            result, events = await evaluate(inp, 0)
        except (ActivityError, ApplicationError) as err:
            result, events = None, [RunEvent(at=workflow.now().isoformat(), kind="eval_failed",
                                             detail=f"step 0: {failure_in(err)[1]}")]
        st.events = [*st.events, *events][-100:]
        return result

    async def _run_step(self, run_id: str, chash: str) -> StepSummary:
        """Run the step as a child. A lost node is replaced and the step re-run; a
        divergence (NaN) pauses the run on its last good state until ``resume``."""
        cfg, st = self.cfg, self.st
        assert cfg is not None and st.dataset is not None and st.train is not None
        replacements = 0
        while True:
            assert st.node is not None
            child = workflow.execute_child_workflow(
                RLStep.run,
                RLStepInput(
                    run_id=run_id, step=st.next_step, config=cfg, train=st.train,
                    policy_version=st.policy_version, data_cursor=st.data_cursor,
                    dataset=st.dataset, node_queue=st.node.task_queue, epoch=st.node.epoch,
                    buffer=st.buffer or ([st.prefetched] if st.prefetched else []),
                    restart_cells=cell_heal.due(st.cell_heal, workflow.now()),
                ),
                id=f"{run_id}/step-{st.next_step}",
                task_queue=CONTROL_QUEUE,
                static_summary=f"RL step {st.next_step} of {cfg.steps}",
            )
            try:
                return await self.watch.on_live_node(run_id, st.node.task_queue, cfg.node, child)
            except (ChildWorkflowError, ApplicationError) as err:  # ApplicationError: NodeLost from the watch
                kind, message = failure_in(err)
                if kind == Failure.DIVERGENCE:
                    self._event("divergence", f"step {st.next_step}: {message}; paused (fix with `milestone set`, then resume)")
                    st.paused = True
                    self.status = "paused"
                    self._publish()
                    await workflow.wait_condition(lambda: not self.st.paused)
                    self.status = "running"
                    continue
                if kind != Failure.NODE_LOST:
                    raise
                replacements += 1
                self._event("node_lost", f"{st.node.task_queue} during step {st.next_step}: {message}")
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
                ClaimNodeInput(run_id=run_id, exclude_queues=exclude, store_uri=cfg.store), summary="claim a node",
            )
            self._event("node_claimed", st.node.task_queue)
            try:
                await self.watch.on_live_node(run_id, st.node.task_queue, cfg.node, self._init_node(run_id, chash, init))
                return
            except (ActivityError, ApplicationError) as err:  # NodeLost: a timeout, said by the activity or the watch
                if failure_in(err)[0] != Failure.NODE_LOST:
                    raise
                exclude = [st.node.task_queue]
                self._event("node_lost", f"{st.node.task_queue}: {failure_in(err)[1]}")

    async def _init_node(self, run_id: str, chash: str, init: bool) -> None:
        """The claimed node's trainer to the committed version, its engines up."""
        cfg, st = self.cfg, self.st
        assert cfg is not None and st.dataset is not None and st.train is not None and st.node is not None
        policy = await INIT_POLICY.run(
            InitPolicyInput(
                run_id=run_id, store_uri=cfg.store, seed=cfg.seed, model=cfg.model, sft=cfg.sft,
                train=st.train, dataset=st.dataset, checkpoint=cfg.checkpoint, config_hash=chash,
                policy_version=st.policy_version, lineage=self.lineage, epoch=st.node.epoch, distill=cfg.distill,
                trainer=cfg.trainer,
            ),
            queue=st.node.task_queue,
            summary="SFT warm-up -> v0" if init else f"restore policy v{st.policy_version}",
        )
        st.events = [*st.events, *policy.node_events][-100:]
        st.cells = [policy.cell] if policy.cell is not None else []
        if policy.dp is not None:  # trainer.cells > 1: cells this trainer lost are scheduled for a restart
            st.dp = policy.dp
            st.cell_heal = cell_heal.after_step(st.cell_heal, policy.dp, {}, workflow.now(), cfg.trainer)
        synced = await UPDATE_WEIGHTS.run(
            UpdateWeightsInput(
                run_id=run_id, store_uri=cfg.store, policy_version=policy.policy_version,
                weights_key=policy.weights_key, checksum=policy.checksum, engines=cfg.engines,
            ),
            queue=st.node.task_queue,
            summary=f"start engines @ v{policy.policy_version}",
        )
        st.events = [*st.events, *synced.node_events][-100:]
        st.engines = synced.engines

    # ---- observability -----------------------------------------------------------
    def _event(self, kind: str, detail: str) -> None:
        ev = RunEvent(at=workflow.now().isoformat(), kind=kind, detail=detail)
        self.st.events = [*self.st.events, ev][-100:]
        workflow.logger.info("run event %s: %s", kind, detail)

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
        lines = [
            f"**{self.status}** — step {st.next_step - 1}/{self.cfg.steps if self.cfg else '?'}, "
            f"policy v{st.policy_version}, data cursor {st.data_cursor}",
        ]
        if last:
            lines.append(
                f"last step: reward {last.reward_mean:.3f} (acc {last.accuracy:.2f}), loss {last.loss:.4f}, "
                f"{last.step_seconds:.1f}s"
            )
        evaluated = last_eval(st.history)
        if evaluated:
            lines.append(
                f"held-out eval after step {evaluated.step}: greedy {evaluated.eval_greedy:.3f}, "
                f"pass@{evaluated.eval_k} {evaluated.eval_pass_at_k:.3f} ({evaluated.eval_n} prompts)"
            )
        if st.node:
            lines.append(f"node: `{st.node.task_queue}`")
        if st.dp is not None:  # trainer.cells > 1
            alive = sum(c.state == "alive" for c in st.dp.cells)
            lost = ", ".join(f"cell {i} restarts after {h.failures} failed restart(s)" if h.failures else f"cell {i} lost"
                             for i, h in sorted(st.cell_heal.items()))
            lines.append(f"DP cells: {alive}/{len(st.dp.cells)} alive" + (f" ({lost})" if lost else ""))
        if self.lineage:
            lines.append(f"forked from `{self.lineage[-1].run_id}` at step {self.lineage[-1].step}")
        workflow.set_current_details("\n\n".join(lines))

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
        self.st.events = [*self.st.events, event][-100:]
        workflow.logger.warning("node event %s: %s", event.kind, event.detail)

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
        self._event("hparams_set", json.dumps(update.given()))
        return self.st.train.model_dump()

    @set_hparams.validator
    def _validate_hparams(self, update: HParamUpdate) -> None:
        if not update.given():
            raise ValueError(f"set_hparams: no field given (any of {', '.join(TrainSpec.model_fields)})")
        if update.kl_coef and self.cfg is not None and self.cfg.train.kl_coef == 0:
            raise ValueError("set_hparams: kl_coef: the run started with kl_coef 0 and keeps no reference model")
        assert self.st.train is not None
        try:
            train = update.apply(self.st.train)
        except ValidationError as err:
            raise ValueError(f"set_hparams: {err}") from None
        bad = mode_conflicts(self.cfg.mode, train) if self.cfg is not None else []
        if bad:
            raise ValueError(f"set_hparams: {', '.join(bad)}: RL loss knobs, unused in mode {self.cfg.mode}")
        if self.cfg is not None and self.cfg.trainer.backend == "megatron" and (bad := megatron_train_conflicts(train)):
            raise ValueError(f"set_hparams: trainer.backend megatron does not support {'; '.join(bad)}")

