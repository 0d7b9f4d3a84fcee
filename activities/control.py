"""Light CPU activities on the control queue: dataset preparation, and for steps recorded
before the ``samples-on-node`` patch (``workflows.sampling``) their rewards and the trained
batch of a step with dynamic sampling (since, the run's node scores the samples it generated
and the trainer takes the kept groups from the rounds' chunks)."""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import rewards
from gpu_runtime.store import artifacts as art
from gpu_runtime.proc import metrics
from gpu_runtime.data import reasoning_gym
from gpu_runtime.data.arithmetic import generate_heldout_arithmetic
from gpu_runtime.data.datasets import generate_arithmetic, load_jsonl, write_jsonl
from gpu_runtime.data.tool_arithmetic import generate_tool_arithmetic
from gpu_runtime.data.readers import iter_rows, read_rows
from gpu_runtime.data.dynamic_sampling import assemble_groups
from gpu_runtime.store.fence import FencedStore, StaleEpoch
from gpu_runtime.store.object_store import ObjectStore
from gpu_runtime.store.uri import open_store
from workflows.failures import Failure, failure
from workflows.stubs import ASSEMBLE_BATCH, COMPUTE_REWARDS, PREPARE_DATA
from workflows.contracts.placement import DatasetInfo, PrepareDataInput
from workflows.contracts.sampling import AssembleBatchInput, BatchResult, RewardInput, RewardResult


@activity.defn(name=PREPARE_DATA.name)
def prepare_data(inp: PrepareDataInput) -> DatasetInfo:
    """Write the run's dataset once, as normalized rows (``gpu_runtime.data.rows``), and
    with ``eval.enabled`` its held-out split next to it: for ``arithmetic`` unseen
    prompts of the same generator, for jsonl / parquet the first ``eval.n`` rows of
    ``data.eval_path`` (none without it). A bad row or a missing file fails the run
    (``InvalidInput``, not retried)."""
    store = open_store(inp.store_uri)
    key = art.dataset_key(inp.run_id, "train")
    d = inp.data
    if d.kind == "arithmetic":
        _put_once(store, key, "data.path", lambda: generate_arithmetic(
            d.num_train, inp.seed, d.max_operand, d.ops, min_operand=d.min_operand))
    elif d.kind == "tool_arithmetic":
        _put_once(store, key, "data.path", lambda: generate_tool_arithmetic(
            d.num_train, inp.seed, d.max_operand, d.ops, min_operand=d.min_operand))
    elif d.kind == "reasoning_gym":
        assert d.dataset is not None
        _put_once(store, key, "data.dataset", lambda: reasoning_gym.generate_rows(
            d.dataset, d.dataset_config, d.num_train, inp.seed))
    else:
        require_int = inp.mode == "rl" and "math_answer" in inp.reward.kinds()
        _put_once(store, key, "data.path", lambda: iter_rows(d, require_int_answer=require_int))
    data = store.get_bytes(key)
    info = DatasetInfo(key=key, n_rows=data.count(b"\n"), sha256=hashlib.sha256(data).hexdigest())
    if not inp.eval.enabled or d.kind == "tool_arithmetic":  # agent runs have no single-turn eval
        return info
    eval_key = art.dataset_key(inp.run_id, "eval")
    if d.kind in ("arithmetic", "reasoning_gym"):
        train_prompts = {json.loads(line).get("prompt") for line in data.splitlines() if line.strip()}
        if d.kind == "arithmetic":
            _put_once(store, eval_key, "eval.n", lambda: generate_heldout_arithmetic(
                inp.eval.n, inp.seed, d.max_operand, d.ops, exclude=train_prompts, min_operand=d.min_operand))
        else:
            assert d.dataset is not None
            _put_once(store, eval_key, "data.dataset", lambda: reasoning_gym.generate_heldout(
                d.dataset, d.dataset_config, inp.eval.n, inp.seed, exclude=train_prompts))
    else:
        source = d.eval_source()
        if source is None:
            return info
        # read whole (every row is checked), then cut: the eval scores with the math rule
        _put_once(store, eval_key, "data.eval_path", lambda: read_rows(source, require_int_answer=True)[: inp.eval.n])
    n_eval = store.get_bytes(eval_key).count(b"\n") if store.exists(eval_key) else 0
    return info.model_copy(update={"eval_key": eval_key, "n_eval": n_eval}) if n_eval else info


def _put_once(store: ObjectStore, key: str, field: str, rows: Callable[[], Iterable[dict]]) -> None:
    """Write ``rows()`` as JSONL under ``key`` unless it is there (no rows: nothing written).
    A bad row (``DatasetError``, one line per row naming file:line / file:row) or an
    unreadable file (named by its config ``field``) is ``InvalidInput``."""
    if store.exists(key):
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        try:
            n = write_jsonl(rows(), path)
        except ValueError as err:
            raise failure(Failure.INVALID_INPUT, str(err)) from err
        except (FileNotFoundError, IsADirectoryError, PermissionError) as err:
            raise failure(Failure.INVALID_INPUT, f"{field}: {err}") from err
        if n:
            store.put_file(key, path)


# parsed datasets by (store, key, sha256): parsing and validating a 2000-row split on every
# compute_rewards cost ~20 ms of the step (bench.step_timeline); a split never changes under its hash
_ROWS: dict[tuple[str, str, str], list[dict]] = {}
_ROWS_LOCK = threading.Lock()
_ROWS_KEPT = 4


def _load_rows(store_uri: str, dataset: DatasetInfo) -> list[dict]:
    """The split's rows, parsed once per worker process while their bytes hash to ``dataset.sha256``."""
    cache_key = (store_uri, dataset.key, dataset.sha256)
    with _ROWS_LOCK:
        if cache_key in _ROWS:
            return _ROWS[cache_key]
    store = open_store(store_uri)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        store.get_file(dataset.key, path)
        rows = load_jsonl(path)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if dataset.sha256 and digest == dataset.sha256:
        with _ROWS_LOCK:
            while len(_ROWS) >= _ROWS_KEPT:
                _ROWS.pop(next(iter(_ROWS)))
            _ROWS[cache_key] = rows
    return rows


@activity.defn(name=COMPUTE_REWARDS.name)
def compute_rewards(inp: RewardInput) -> RewardResult:
    """The reward activity of steps recorded before the ``samples-on-node`` patch (since, the
    run's node scores the samples it holds): the chunks read from the store, scored by
    ``activities.rewards.score``."""
    t0 = time.perf_counter()
    store = open_store(inp.store_uri)
    rows = _load_rows(inp.store_uri, inp.dataset)
    samples = rewards.stored_samples(store, inp.chunk_keys)
    return rewards.score(inp, store, samples, rows, "control", _stale, t0)


def _stale(err: StaleEpoch) -> ApplicationError:
    return failure(Failure.NODE_LOST, f"stale placement: {err}")


@activity.defn(name=ASSEMBLE_BATCH.name)
def assemble_batch(inp: AssembleBatchInput) -> BatchResult:
    """Write the trained batch of a step with dynamic sampling: the samples and rewards of the
    groups the workflow kept, in its order, under the step's ``batch/`` keys (the same bytes
    on every attempt)."""
    t0 = time.perf_counter()
    store = open_store(inp.store_uri)
    rounds = [
        (rewards.stored_samples(store, r.chunk_keys), art.get_model(store, r.rewards_key, art.StepRewards).rewards)
        for r in inp.rounds
    ]
    try:
        samples, kept = assemble_groups(rounds, inp.groups, inp.group_size)
    except ValueError as err:
        raise failure(Failure.INVALID_INPUT, f"assemble_batch step {inp.step}: {err}") from err
    fenced = FencedStore(store, inp.run_id, inp.epoch, "control")  # at the step's placement epoch
    keys = []
    try:  # a step the run has left behind writes no batch
        for c, start in enumerate(range(0, len(samples), inp.chunk_size)):
            part = samples[start : start + inp.chunk_size]
            key = art.batch_chunk_key(inp.run_id, inp.step, c)
            art.put_model(fenced, key, art.RolloutChunk(
                run_id=inp.run_id, step=inp.step, chunk=c, seed=0, weight_version=part[0].weight_version,
                engine_url="", samples=part,
            ))
            keys.append(key)
        rewards_key = art.batch_rewards_key(inp.run_id, inp.step)
        art.put_model(fenced, rewards_key, art.StepRewards(run_id=inp.run_id, step=inp.step, rewards=kept))
    except StaleEpoch as err:
        raise failure(Failure.NODE_LOST, f"stale placement: {err}") from err
    metrics.record_sampling(inp.sampling.model_dump())
    return BatchResult(
        chunk_keys=keys, rewards_key=rewards_key, n_samples=len(samples),
        reward_mean=statistics.fmean(r.reward for r in kept) if kept else 0.0,
        accuracy=sum(r.correct for r in kept) / max(1, len(kept)),
        seconds=time.perf_counter() - t0,
    )

