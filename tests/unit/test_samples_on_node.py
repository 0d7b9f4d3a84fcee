"""Samples don't make a round trip: the node agent scores the chunks its rollout left in
memory (reading the store only for chunks it does not hold), a judge reward retried on the
node asks only for the samples it has no record of, and the trainer takes a dynamic-sampling
step's kept groups from the rounds' chunks, reading each once, in the workflow's order. Real
local store, the real node activity in Temporal's activity environment; reads counted by a
store wrapper."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

import activities.node_rollout
from activities.node import NodeActivities
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.rollout.held import HeldChunks
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import ForwardingStore, ObjectStore
from gpu_runtime.store.uri import open_store
from gpu_runtime.trainer.common.step_samples import step_samples
from tests.reward_servers import Behaviour, reward_server
from spec.reward import RewardSpec
from spec.train import TrainSpec
from spec.trainer_rpc import BatchSelection, SampledRound, StepBatch
from workflows.contracts.placement import DatasetInfo
from workflows.contracts.sampling import RewardInput
from workflows.failures import Failure

ROWS = [{"id": f"r{i}", "prompt": f"{i}+1=", "messages": None, "answer": str(i + 1), "metadata": {}} for i in range(4)]
GROUP = 2


class CountingStore(ForwardingStore):
    """The store, counting the reads of each key."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.reads: Counter[str] = Counter()

    def get_bytes(self, key: str) -> bytes:
        self.reads[key] += 1
        return super().get_bytes(key)


def chunk(step: int, c: int, round_: int = 0, prompts: tuple[int, ...] = (0, 1)) -> art.RolloutChunk:
    """A stored rollout chunk: ``GROUP`` samples of each prompt, some right, some not."""
    tag = f"s{step}-r{round_}" if round_ else f"s{step}"
    samples = [
        art.Sample(sample_id=f"{tag}-p{p}-g{g}", prompt_index=p, group_index=g, prompt_ids=[1, 2], response_ids=[3],
                   logprobs=[-0.5], weight_version=0, finish_reason="stop", prompt_text=ROWS[p]["prompt"],
                   response_text=f"{p + 1 + (g + c + round_) % 2}")
        for p in prompts for g in range(GROUP)
    ]
    return art.RolloutChunk(run_id="run", step=step, chunk=c, seed=c, weight_version=0, samples=samples)


@pytest.fixture
def store_uri(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


@pytest.fixture
def dataset(store_uri: str) -> DatasetInfo:
    data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    key = art.dataset_key("run", "train")
    open_store(store_uri).put_bytes(key, data)
    return DatasetInfo(key=key, n_rows=len(ROWS), sha256=hashlib.sha256(data).hexdigest())


@pytest.fixture
def rollout(store_uri: str) -> dict[str, art.RolloutChunk]:
    """Step 1's two chunks, stored as the rollout stores them."""
    chunks = {art.rollout_chunk_key("run", 1, c): chunk(1, c, prompts=(2 * c, 2 * c + 1)) for c in range(2)}
    for key, ch in chunks.items():
        art.put_model(open_store(store_uri), key, ch)
    return chunks


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[NodeActivities, list[CountingStore]]]:
    """The node's real activities on a runtime that starts nothing (no trainer, no engines),
    with every store it opens counting reads."""
    opened: list[CountingStore] = []

    def counting(uri: str) -> CountingStore:
        opened.append(CountingStore(open_store(uri)))
        return opened[-1]

    monkeypatch.setattr(activities.node_rollout, "open_store", counting)
    yield NodeActivities(NodeRuntime("node0", "boot", tmp_path / "node")), opened


def reward_input(store_uri: str, dataset: DatasetInfo, keys: list[str], epoch: int = 0, **reward: object) -> RewardInput:
    return RewardInput(run_id="run", step=1, store_uri=store_uri, chunk_keys=keys, dataset=dataset,
                       reward=RewardSpec(**reward), group_size=GROUP, epoch=epoch)


def chunk_reads(opened: list[CountingStore]) -> Counter[str]:
    return Counter({k: n for s in opened for k, n in s.reads.items() if "/rollout/" in k})


def test_the_node_scores_the_chunks_it_holds_without_reading_them(
    store_uri: str, dataset: DatasetInfo, rollout: dict[str, art.RolloutChunk],
    node: tuple[NodeActivities, list[CountingStore]],
) -> None:
    """Same rewards, same stored bytes as a node that holds none of them (and reads them from
    the store); no read of the chunks the rollout left on the node, which it then releases."""
    acts, opened = node
    inp = reward_input(store_uri, dataset, list(rollout))
    elsewhere = NodeActivities(NodeRuntime("node1", "boot", Path(store_uri.removeprefix("file://")).parent / "node1"))
    on_control = ActivityEnvironment().run(elsewhere.rollout.compute_rewards_on_node, inp)
    assert chunk_reads(opened) == Counter({k: 1 for k in rollout})
    opened.clear()
    stored = open_store(store_uri).get_bytes(on_control.rewards_key)
    open_store(store_uri).delete(on_control.rewards_key)

    acts.rollout.rt.held.keep((store_uri, 0), rollout)  # what the rollout activity does
    on_node = ActivityEnvironment().run(acts.rollout.compute_rewards_on_node, inp)
    assert chunk_reads(opened) == Counter()
    assert on_node.model_dump(exclude={"seconds"}) == on_control.model_dump(exclude={"seconds"})
    assert open_store(store_uri).get_bytes(on_node.rewards_key) == stored
    assert on_node.groups == 4 and on_node.group_means == [0.5] * 4  # one of each pair right
    assert len(acts.rollout.rt.held) == 0  # scored: released


def test_chunks_the_node_does_not_hold_are_read_from_the_store(
    store_uri: str, dataset: DatasetInfo, rollout: dict[str, art.RolloutChunk],
    node: tuple[NodeActivities, list[CountingStore]],
) -> None:
    """Chunk 1 is not held for this placement (a re-placement's, or another epoch's): read
    once from the store; chunk 0 comes from memory. The rewards are the same."""
    acts, opened = node
    first, second = rollout
    acts.rollout.rt.held.keep((store_uri, 3), {first: rollout[first]})
    acts.rollout.rt.held.keep((store_uri, 2), {second: rollout[second]})  # an older placement's
    got = ActivityEnvironment().run(acts.rollout.compute_rewards_on_node, reward_input(store_uri, dataset, list(rollout), 3))
    assert chunk_reads(opened) == Counter({second: 1})
    assert got.n == 8 and got.accuracy == 0.5
    assert len(acts.rollout.rt.held) == 1  # the older placement's chunk stays until evicted


def test_held_chunks_are_evicted_oldest_first_past_the_limit() -> None:
    held = HeldChunks(max_samples=8)
    chunks = {f"k{c}": chunk(1, c) for c in range(3)}  # 4 samples each
    held.keep(("s", 0), chunks)
    assert len(held) == 2
    samples, read = held.samples(_MissingStore(), ("s", 0), ["k1", "k2"])
    assert read == 0 and [s.sample_id for s in samples] == [s.sample_id for k in ("k1", "k2") for s in chunks[k].samples]


class _MissingStore(ForwardingStore):
    def __init__(self) -> None:
        pass

    def get_bytes(self, key: str) -> bytes:
        raise AssertionError(f"{key} was read")


def test_a_reward_retry_after_a_judge_failure_asks_only_for_the_unjudged_samples(
    store_uri: str, dataset: DatasetInfo, rollout: dict[str, art.RolloutChunk],
    node: tuple[NodeActivities, list[CountingStore]],
) -> None:
    """The judge fails once after 3 judgements and allows no in-process retry: the node's first
    attempt fails retryably (RewardError), its chunks still held; the retry scores from memory
    and asks only for the samples without a durable record: each sample judged once."""
    acts, opened = node
    acts.rollout.rt.held.keep((store_uri, 0), rollout)
    with reward_server(Behaviour(fail_once_after=3)) as judge:
        inp = reward_input(store_uri, dataset, list(rollout), kind="judge", url=judge.url, concurrency=1, max_retries=0)
        with pytest.raises(ApplicationError) as err:
            ActivityEnvironment().run(acts.rollout.compute_rewards_on_node, inp)
        assert err.value.type == Failure.REWARD_ERROR.value and not err.value.non_retryable
        assert len(acts.rollout.rt.held) == 2
        got = ActivityEnvironment().run(acts.rollout.compute_rewards_on_node, inp)
    ids = [s.sample_id for c in rollout.values() for s in c.samples]
    assert judge.log.judged == {i: 1 for i in ids} and judge.log.failed == 1
    assert got.n == len(ids) and chunk_reads(opened) == Counter()
    records = open_store(store_uri).list(art.judge_prefix("run", 1) + "/judge/")
    assert len(records) == len(ids)


# ---- the trainer's side -----------------------------------------------------------------------------------
def two_rounds(store: ObjectStore) -> list[SampledRound]:
    """Step 2's two rounds of two chunks (two prompts each), with their rewards."""
    rounds = []
    for r in range(2):
        keys = []
        for c in range(2):
            key = art.rollout_chunk_key("run", 2, c, r)
            art.put_model(store, key, chunk(2, c, r, prompts=(2 * c, 2 * c + 1)))
            keys.append(key)
        samples = [s for k in keys for s in art.get_model(store, k, art.RolloutChunk).samples]
        rewards_key = art.rewards_key("run", 2, r)
        art.put_model(store, rewards_key, art.StepRewards(run_id="run", step=2, rewards=[
            art.SampleReward(sample_id=s.sample_id, reward=float(i % 3), correct=i % 3 > 0)
            for i, s in enumerate(samples)]))
        rounds.append(SampledRound(chunk_keys=keys, rewards_key=rewards_key))
    return rounds


def step_batch(selection: BatchSelection) -> StepBatch:
    return StepBatch(step=2, policy_version=1, chunk_keys=[], rewards_key="", group_size=GROUP,
                     hparams=TrainSpec(lr=1e-4), selection=selection)


GROUPS = [(1, 3), (0, 0), (1, 1), (0, 2)]  # (round, group) in training order, across chunks and rounds


def test_the_trainer_reads_each_chunk_of_a_selection_once_and_trains_the_groups_in_order(
    store_uri: str,
) -> None:
    store = open_store(store_uri)
    rounds = two_rounds(store)
    counting = CountingStore(store)
    batch = StepBatch.model_validate_json(step_batch(BatchSelection(rounds=rounds, groups=GROUPS)).model_dump_json())
    samples, rewards = step_samples(counting, batch)
    assert counting.reads == Counter({k: 1 for r in rounds for k in [*r.chunk_keys, r.rewards_key]})
    assert [s.sample_id for s in samples] == ["s2-r1-p3-g0", "s2-r1-p3-g1", "s2-p0-g0", "s2-p0-g1",
                                              "s2-r1-p1-g0", "s2-r1-p1-g1", "s2-p2-g0", "s2-p2-g1"]
    assert [r.sample_id for r in rewards] == [s.sample_id for s in samples]  # each sample with its own reward

    with pytest.raises(ValueError, match="step 2: group \\(1, 4\\): round 1 has 4 groups"):
        step_samples(store, batch.model_copy(update={"selection": batch.selection.model_copy(update={"groups": [(1, 4)]})}))
