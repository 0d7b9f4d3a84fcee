"""Light CPU activities on the control queue: dataset preparation (the run's node scores the
samples it generated, and the trainer takes dynamic sampling's kept groups from the rounds'
chunks)."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from temporalio import activity

from gpu_runtime.store import artifacts as art
from gpu_runtime.data import reasoning_gym
from gpu_runtime.data.arithmetic import expression, generate_heldout_arithmetic
from gpu_runtime.data.datasets import generate_arithmetic, write_jsonl
from gpu_runtime.data.tool_arithmetic import generate_tool_arithmetic
from gpu_runtime.data.readers import iter_rows, read_rows
from gpu_runtime.store.object_store import ObjectStore
from gpu_runtime.store.uri import open_store
from workflows.failures import Failure, failure
from gpu_runtime.store.fence import StaleEpoch, raise_fence
from workflows.stubs import FENCE_PLACEMENT, PREPARE_DATA
from workflows.contracts.placement import DatasetInfo, FencePlacementInput, PrepareDataInput


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
            d.num_train, inp.seed, d.max_operand, d.ops, min_operand=d.min_operand, chat=d.chat))
    elif d.kind == "tool_arithmetic":
        _put_once(store, key, "data.path", lambda: generate_tool_arithmetic(
            d.num_train, inp.seed, d.max_operand, d.ops, min_operand=d.min_operand, terms=d.terms,
            tool_format=d.tool_format))
    elif d.kind == "reasoning_gym":
        assert d.dataset is not None
        name = d.dataset
        _put_once(store, key, "data.dataset", lambda: reasoning_gym.generate_rows(
            name, d.dataset_config, d.num_train, inp.seed))
    else:
        require_int = inp.mode == "rl" and "math_answer" in inp.reward.kinds()
        _put_once(store, key, "data.path", lambda: iter_rows(d, require_int_answer=require_int))
    data = store.get_bytes(key)
    info = DatasetInfo(key=key, n_rows=data.count(b"\n"), sha256=hashlib.sha256(data).hexdigest())
    if not inp.eval.enabled or d.kind == "tool_arithmetic":  # agent runs have no single-turn eval
        return info
    eval_key = art.dataset_key(inp.run_id, "eval")
    if d.kind in ("arithmetic", "reasoning_gym"):
        train_prompts = {e for line in data.splitlines() if line.strip() and (e := expression(json.loads(line)))}
        if d.kind == "arithmetic":
            _put_once(store, eval_key, "eval.n", lambda: generate_heldout_arithmetic(
                inp.eval.n, inp.seed, d.max_operand, d.ops, exclude=train_prompts, min_operand=d.min_operand,
                chat=d.chat))
        else:
            assert d.dataset is not None
            name = d.dataset
            _put_once(store, eval_key, "data.dataset", lambda: reasoning_gym.generate_heldout(
                name, d.dataset_config, inp.eval.n, inp.seed, exclude=train_prompts))
    else:
        source = d.eval_source()
        if source is None:
            return info
        # read whole (every row is checked), then cut: the eval scores with the math rule
        _put_once(store, eval_key, "data.eval_path", lambda: read_rows(source, require_int_answer=True)[: inp.eval.n])
    n_eval = store.get_bytes(eval_key).count(b"\n") if store.exists(eval_key) else 0
    return info.model_copy(update={"eval_key": eval_key, "n_eval": n_eval}) if n_eval else info


@activity.defn(name=FENCE_PLACEMENT.name)
def fence_placement(inp: FencePlacementInput) -> None:
    """The run's fence to ``inp.epoch`` (a rollout node replaced or added at a step boundary): the
    nodes the run left behind write nothing from now on. A fence already past it is a placement
    newer than this workflow knows: not retried."""
    try:
        raise_fence(open_store(inp.store_uri), inp.run_id, inp.epoch, inp.node, inp.from_step)
    except StaleEpoch as err:
        raise failure(Failure.NODE_LOST, str(err)) from err


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
