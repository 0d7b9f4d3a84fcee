"""Light CPU activities on the control queue: dataset preparation and rule rewards."""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from pathlib import Path

from temporalio import activity

from activities import translate
from activities.heartbeat import with_heartbeat
from gpu_runtime.store import artifacts as art
from gpu_runtime.node import metrics
from gpu_runtime.data.datasets import generate_arithmetic, load_jsonl, write_jsonl
from gpu_runtime.data.readers import iter_rows
from gpu_runtime.data.rewards import RewardError, RewardFunctionNotFound, score_samples
from gpu_runtime.store.uri import open_store
from workflows.failures import Failure, failure
from workflows.contracts import DatasetInfo, PrepareDataInput, RewardInput, RewardResult


@activity.defn(name="prepare_data")
def prepare_data(inp: PrepareDataInput) -> DatasetInfo:
    """Write the run's dataset once, as normalized rows (``gpu_runtime.data.rows``).
    A bad row or a missing file fails the run (``InvalidInput``, not retried)."""
    store = open_store(inp.store_uri)
    key = art.dataset_key(inp.run_id, "train")
    if not store.exists(key):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "train.jsonl"
            d = inp.data
            if d.kind == "arithmetic":
                write_jsonl(generate_arithmetic(d.num_train, inp.seed, d.max_operand, d.ops), path)
            else:
                rows = iter_rows(translate.data_source(d), require_int_answer=inp.reward.kind == "math_answer")
                try:
                    write_jsonl(rows, path)
                except ValueError as err:  # a DatasetError: one line per bad row, naming file:line / file:row
                    raise failure(Failure.INVALID_INPUT, str(err)) from err
                except (FileNotFoundError, IsADirectoryError, PermissionError) as err:
                    raise failure(Failure.INVALID_INPUT, f"data.path: {err}") from err
            store.put_file(key, path)
    data = store.get_bytes(key)
    return DatasetInfo(key=key, n_rows=data.count(b"\n"), sha256=hashlib.sha256(data).hexdigest())


def _load_rows(store_uri: str, key: str) -> list[dict]:
    store = open_store(store_uri)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        store.get_file(key, path)
        return load_jsonl(path)


@activity.defn(name="compute_rewards")
def compute_rewards(inp: RewardInput) -> RewardResult:
    t0 = time.perf_counter()
    store = open_store(inp.store_uri)
    rows = _load_rows(inp.store_uri, inp.dataset.key)
    samples: list[art.Sample] = []
    for key in inp.chunk_keys:
        samples.extend(art.get_model(store, key, art.RolloutChunk).samples)
    spec = translate.reward_settings(inp.reward)
    try:
        rewards = with_heartbeat(
            lambda: score_samples(samples, dict(enumerate(rows)), spec)
        )
    except RewardFunctionNotFound as err:  # the same on every attempt: fail the run, naming the field
        raise failure(Failure.INVALID_INPUT, f"reward.function: {err}") from err
    except RewardError as err:  # the function raised, timed out or returned junk: retried
        raise failure(Failure.REWARD_ERROR, str(err)) from err
    key = art.rewards_key(inp.run_id, inp.step)
    art.put_model(store, key, art.StepRewards(run_id=inp.run_id, step=inp.step, rewards=rewards))
    values = [r.reward for r in rewards]
    result = RewardResult(
        rewards_key=key,
        reward_mean=statistics.fmean(values) if values else 0.0,
        reward_std=statistics.pstdev(values) if len(values) > 1 else 0.0,
        accuracy=sum(r.correct for r in rewards) / max(1, len(rewards)),
        n=len(rewards),
        seconds=time.perf_counter() - t0,
    )
    metrics.REWARD_MEAN.set(result.reward_mean)
    metrics.REWARD_STD.set(result.reward_std)
    metrics.PHASE_SECONDS.labels("reward").observe(result.seconds)
    return result
