"""Light CPU activities on the control queue: dataset preparation and rule rewards."""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from temporalio import activity

from activities import translate
from activities.heartbeat import with_heartbeat
from gpu_runtime.store import artifacts as art
from gpu_runtime.node import metrics
from gpu_runtime.data.arithmetic import generate_heldout_arithmetic
from gpu_runtime.data.datasets import generate_arithmetic, load_jsonl, write_jsonl
from gpu_runtime.data.readers import iter_rows, read_rows
from gpu_runtime.data.rewards import RewardError, RewardFunctionNotFound, score_samples
from gpu_runtime.store.fence import FencedStore, StaleEpoch
from gpu_runtime.store.object_store import ObjectStore
from gpu_runtime.store.uri import open_store
from workflows.failures import Failure, failure
from workflows.contracts import DatasetInfo, PrepareDataInput, RewardInput, RewardResult


@activity.defn(name="prepare_data")
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
        _put_once(store, key, "data.path", lambda: generate_arithmetic(d.num_train, inp.seed, d.max_operand, d.ops))
    else:
        require_int = inp.reward.kind == "math_answer"
        _put_once(store, key, "data.path", lambda: iter_rows(translate.data_source(d), require_int_answer=require_int))
    data = store.get_bytes(key)
    info = DatasetInfo(key=key, n_rows=data.count(b"\n"), sha256=hashlib.sha256(data).hexdigest())
    if not inp.eval.enabled:
        return info
    eval_key = art.dataset_key(inp.run_id, "eval")
    if d.kind == "arithmetic":
        train_prompts = {json.loads(line).get("prompt") for line in data.splitlines() if line.strip()}
        _put_once(store, eval_key, "eval.n", lambda: generate_heldout_arithmetic(
            inp.eval.n, inp.seed, d.max_operand, d.ops, exclude=train_prompts))
    else:
        source = translate.data_source(d).eval_source()
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
    try:  # at the step's placement epoch: a step the run has left behind writes nothing
        art.put_model(FencedStore(store, inp.run_id, inp.epoch, "control"), key,
                      art.StepRewards(run_id=inp.run_id, step=inp.step, rewards=rewards))
    except StaleEpoch as err:
        raise failure(Failure.NODE_LOST, f"stale placement: {err}") from err
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
