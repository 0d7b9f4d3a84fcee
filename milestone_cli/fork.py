"""``milestone fork RUN --from-step N [--set k=v ...] [--config NEW.yaml] --run-id NEW``.

A fork is a new run that starts from RUN's durable state after step N: its trainer
restores RUN's newest checkpoint at or before N and replays RUN's stored steps up to
N (as any restore does), then trains steps N+1.. under its own prefix. RUN's
artifacts are read, never written. Without a change the fork ends bitwise equal to
RUN; with one (a learning rate, a reward) it equals RUN up to step N and differs after.

A fork of a one_step_off or fully_async run also takes the batches RUN had sampled ahead
after step N (its buffer, read from the result of RUN's step-N workflow in Temporal),
when the fork samples and scores as RUN did; otherwise its first step samples afresh.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import yaml
from pydantic import ValidationError
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError

from gpu_runtime.store import artifacts as art, lineage as lin
from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.store.object_store import ObjectStore
from milestone_cli.resume import ResumeError, stored_dataset
from spec.rollout import OFF_POLICY_MODES, rl_sampling_conflicts
from spec.run import RunConfig
from spec.events import Forked, utc_now
from spec.strict import format_validation_error
from spec.train import TrainSpec
from spec.trainer_rpc import ForkPoint
from workflows.run_state import RunState, TrainingRunInput
from workflows.contracts.sampling import Sampled
from workflows.contracts.step import StepSummary

# what the steps up to N were trained with: a fork cannot change it
FIXED = ("seed", "model", "data", "sft", "store")
SA_STEP = SearchAttributeKey.for_int("RlStep")


class ForkError(ValueError):
    """The fork cannot start; the message says why (exit code 2)."""


async def parent_record(client: Client, run_id: str) -> tuple[TrainingRunInput | None, int | None]:
    """The parent's workflow input (config and lineage) and its last committed step,
    from Temporal; ``(None, None)`` when Temporal does not know the run (any more)."""
    handle = client.get_workflow_handle(run_id)
    try:
        desc = await handle.describe()
        async for event in handle.fetch_history_events():
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            [inp] = await client.data_converter.decode(payloads, [TrainingRunInput])
            break
        else:
            return None, None
    except RPCError:
        return None, None
    return inp, desc.typed_search_attributes.get(SA_STEP)


def apply_sets(cfg: RunConfig, train: TrainSpec, items: list[str]) -> tuple[RunConfig, TrainSpec]:
    """``KEY=VALUE`` (values read as YAML): a ``train`` field by its bare name (``lr=1e-5``,
    as in ``milestone set``), anything else by its config path (``steps=8``,
    ``reward.function=my.mod:fn``). Both are validated whole."""
    train_doc, cfg_doc = train.model_dump(), cfg.model_dump()
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ForkError(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ForkError(f"--set {key}: cannot read {value!r}: {err}") from None
        if key in TrainSpec.model_fields:
            train_doc[key] = parsed
            continue
        *path, leaf = key.split(".")
        node: Any = cfg_doc
        for part in path:
            if not isinstance(node.get(part), dict):
                raise ForkError(f"--set {key}: no such config key")
            node = node[part]
        node[leaf] = parsed
    try:
        forked, forked_train = RunConfig.model_validate(cfg_doc), TrainSpec.model_validate(train_doc)
    except ValidationError as err:
        raise ForkError("--set: " + format_validation_error(err).replace("\n", "; ")) from None
    if forked.mode == "rl" and (bad := rl_sampling_conflicts(forked.rollout)):
        raise ForkError("--set: " + "; ".join(f"{key}: {why}" for key, why in bad))
    return forked, forked_train


def check_compatible(parent: RunConfig, fork: RunConfig, train: TrainSpec) -> None:
    for field in FIXED:
        a, b = getattr(parent, field), getattr(fork, field)
        same = a.rstrip("/") == b.rstrip("/") if field == "store" else a == b
        if not same:
            raise ForkError(f"{field}: a fork cannot change it (the steps it shares with its parent were trained with it)")
    if train.kl_coef > 0 and parent.train.kl_coef == 0:
        raise ForkError("train.kl_coef: the parent ran with kl_coef 0 and keeps no reference model")


def _step_batch(store: ObjectStore, run_id: str, step: int) -> dict:
    key = art.step_batch_key(run_id, step)
    try:
        return json.loads(store.get_bytes(key))
    except KeyError:
        raise ForkError(f"step {step}: {key} is missing from the store (did that run train step {step}?)") from None


def cursor_after(store: ObjectStore, lineage: list[tuple[str, int]], step: int) -> int:
    """The data cursor after ``step``: the newest checkpoint at or before it in the
    lineage, plus the prompts of each later step (its stored rewards / group size)."""
    base_step, cursor = 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for run_id, last in lineage:
            ckpts = CheckpointStore(store, art.checkpoints_prefix(run_id), local_dir=tmp)
            for c in ckpts.list_durable():
                if base_step < c.step <= min(last, step) and "data_cursor" in c.meta:
                    base_step, cursor = c.step, int(c.meta["data_cursor"])
    for k in range(base_step + 1, step + 1):
        owner = lin.owner(lineage, "", k)
        cursor += _prompts_drawn(store, _step_batch(store, owner, k))
    return cursor


def _prompts_drawn(store: ObjectStore, batch: dict) -> int:
    """The prompts a step drew: its trained rewards / group size, or with dynamic
    sampling every round's, kept or filtered (docs/rewards.md): the rounds of its selection."""
    group_size, rewards_key = int(batch["group_size"]), batch["rewards_key"]
    if batch.get("selection"):
        return sum(len(art.get_model(store, r["rewards_key"], art.StepRewards).rewards) // group_size
                   for r in batch["selection"]["rounds"])
    return len(art.get_model(store, rewards_key, art.StepRewards).rewards) // group_size


def fork_input(
    store: ObjectStore, parent_id: str, step: int, cfg: RunConfig, parent: TrainingRunInput | None,
    sets: list[str], *, train_from_config: bool,
) -> TrainingRunInput:
    """The fork's ``TrainingRunInput``: ``cfg`` (the parent's, or ``--config``) with
    ``sets`` applied, and a state after ``step``. The train settings are the ones the
    parent trained step ``step`` with (``milestone set`` changes included), unless
    ``train_from_config``."""
    parent_lineage = [(a.run_id, a.step) for a in parent.lineage] if parent else []
    lineage = lin.fork_lineage(parent_lineage, parent_id, step)
    owner = lineage[-1][0]
    if step > 0 and not store.exists(f"{art.step_prefix(owner, step)}/train_result.json"):
        raise ForkError(f"run {owner} has no trained step {step} in {cfg.store}")
    train = cfg.train
    if step > 0 and not train_from_config:
        train = TrainSpec.model_validate(_step_batch(store, owner, step)["hparams"])
    cfg, train = apply_sets(cfg, train, sets)
    if parent is not None:
        check_compatible(parent.config, cfg, train)
    if cfg.steps <= step:
        raise ForkError(f"steps: {cfg.steps} leaves nothing to train after step {step} (--set steps=N)")
    try:
        dataset = stored_dataset(store, lineage[0][0], cfg)
    except ResumeError as err:
        raise ForkError(str(err)) from None
    forked = Forked(at=utc_now(), parent=parent_id, step=step)
    state = RunState(
        next_step=step + 1, policy_version=step, data_cursor=cursor_after(store, lineage, step),
        initialized=True, dataset=dataset, train=train, events=[forked],
    )
    return TrainingRunInput(config=cfg, state=state, lineage=[ForkPoint(run_id=r, step=s) for r, s in lineage])


def buffers_ahead(cfg: RunConfig, step: int) -> bool:
    """Whether a run of ``cfg`` continuing after ``step`` starts with batches sampled ahead
    (one_step_off, fully_async; none before step 1)."""
    return cfg.mode == "rl" and cfg.rollout.mode in OFF_POLICY_MODES and step > 0


def _afresh(cfg: RunConfig, step: int, why: str) -> tuple[list[Sampled], str]:
    """No batches carried, and the line saying why (none when the run buffers nothing)."""
    return [], (f"the first step samples its batch afresh ({why})" if buffers_ahead(cfg, step) else "")


async def sampled_ahead(client: Client, cfg: RunConfig, step: int, data_cursor: int, owner: str,
                        sampler: RunConfig | None) -> tuple[list[Sampled], str]:
    """The batches ``owner`` had sampled ahead after ``step`` (one_step_off, fully_async),
    read from its step workflow's result in Temporal, for a run of ``cfg`` continuing at
    ``data_cursor``; and a line saying what was carried or why not. Carried only when the
    run samples and scores as ``sampler`` (the config that sampled them) did: then its next
    steps train the batches the original trained, bitwise."""
    if not buffers_ahead(cfg, step):
        return [], ""
    if sampler is None or (sampler.rollout, sampler.reward) != (cfg.rollout, cfg.reward):
        return _afresh(cfg, step, f"rollout or reward differ from {owner}'s")
    try:
        summary = await client.get_workflow_handle(f"{owner}/step-{step}", result_type=StepSummary).result()
    except Exception as err:  # noqa: BLE001  the step's workflow is gone (retention) or failed: sample afresh
        return _afresh(cfg, step, f"{owner}/step-{step}: {type(err).__name__}")
    buffer = summary.next_buffer
    buffer = buffer[: cfg.steps - step]  # batch k is step step+1+k's
    if not buffer:
        return [], ""
    if buffer[0].data_cursor != data_cursor:  # the step would refuse it: say so here instead
        return _afresh(cfg, step, f"the buffered batch starts at cursor {buffer[0].data_cursor}, "
                       f"the run continues at {data_cursor}")
    return buffer, f"carries {len(buffer)} batch(es) {owner} sampled ahead after step {step}"


async def parent_buffer(client: Client, inp: TrainingRunInput, parent: TrainingRunInput | None) -> tuple[list[Sampled], str]:
    """The batches the run owning the fork point had sampled ahead after it, for the fork's
    state (``sampled_ahead``): a fork without change stays bitwise equal to the parent."""
    assert inp.state is not None
    step = inp.state.next_step - 1
    owner = inp.lineage[-1].run_id if inp.lineage else ""
    if parent is not None and [(a.run_id, a.step) for a in parent.lineage] != [(a.run_id, a.step) for a in inp.lineage[:-1]]:
        # the step belongs to an ancestor of the parent, whose config this fork was not checked against
        return _afresh(inp.config, step, f"step {step} is {owner}'s, an ancestor of the parent")
    return await sampled_ahead(client, inp.config, step, inp.state.data_cursor, owner,
                               parent.config if parent is not None else None)


async def with_parent_buffer(
    client: Client, inp: TrainingRunInput, parent: TrainingRunInput | None,
) -> tuple[TrainingRunInput, str]:
    """``inp`` with the parent's buffer in its state (``parent_buffer``)."""
    assert inp.state is not None
    buffer, note = await parent_buffer(client, inp, parent)
    if buffer:
        inp = inp.model_copy(update={"state": inp.state.model_copy(update={"buffer": buffer})})
    return inp, note


async def resumed_buffer(client: Client, run_id: str, cfg: RunConfig, state: RunState,
                         previous: TrainingRunInput | None) -> tuple[RunState, str]:
    """A ``--resume-from`` of ``run_id``'s checkpoint at step k: ``state`` with the batches
    the run had sampled ahead after step k (``sampled_ahead``, the previous execution's
    config as the sampler), and the line saying so. A checkpoint at or below a fork point
    is an ancestor's step: its batches are sampled afresh."""
    step = state.next_step - 1
    lineage = previous.lineage if previous is not None else []
    if lineage and step <= lineage[-1].step:
        return state, _afresh(cfg, step, f"step {step} is {lineage[-1].run_id}'s, before the fork")[1]
    buffer, note = await sampled_ahead(client, cfg, step, state.data_cursor, run_id,
                                       previous.config if previous is not None else None)
    return (state.model_copy(update={"buffer": buffer}) if buffer else state), note
