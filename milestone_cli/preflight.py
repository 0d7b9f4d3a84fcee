"""What ``milestone start`` checks before it contacts Temporal.

The config (file:line per bad key), a ``jsonl`` / ``parquet`` dataset and its
``eval_path`` (read whole: file:line / file:row N per bad row),
a custom reward function (imported here, as the node agents will; also as a term of a
weighted reward), the math-verify package for ``math_verify``, and that a
new run id names no run whose artifacts are already in the store.
"""

from __future__ import annotations

import importlib
import inspect
import json

import os
import sys
from pathlib import Path

from gpu_runtime.data import reasoning_gym
from gpu_runtime.data.readers import DatasetError, check_source
from gpu_runtime.data.rewards import RewardFunctionNotFound, load_reward_function, mathverify
from gpu_runtime.rollout.agent.tools import BUILTIN, ToolNotFound, load_environment_factory, load_tools
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import StoreError
from gpu_runtime.store.s3 import S3Store
from gpu_runtime.store.uri import open_store
from milestone_cli.config_file import ConfigError, load_run_config
from spec.data import DataSpec
from spec.run import RunConfig


class PreflightError(ValueError):
    """``milestone start`` refuses to start; the message says why (exit code 2)."""


def check_config(path: str | Path) -> RunConfig:
    """The validated config, or PreflightError naming the file:line / field."""
    try:
        cfg = load_run_config(path)
    except ConfigError as err:
        raise PreflightError(str(err)) from None
    check_model(cfg)
    if cfg.data.kind == "reasoning_gym":
        check_reasoning_gym(cfg)
    elif cfg.data.kind not in ("arithmetic", "tool_arithmetic"):
        check_dataset(cfg)
    if cfg.mode == "rl":
        check_reward(cfg)
    if cfg.rollout.agent is not None:
        check_agent(cfg)
    return cfg


def check_model(cfg: RunConfig) -> None:
    """``model.path`` is a Hugging Face folder (``config.json`` in it); chat prompts (``data.chat``, a
    ``messages_key``) need its tokenizer to carry a chat template. A GGUF is imported first."""
    path = cfg.model.path
    if path is None:
        return
    folder = Path(path)
    if not (folder / "config.json").is_file():
        source = path if folder.suffix == ".gguf" else "FILE.gguf"
        hint = f" (from a GGUF: milestone model import-gguf {source} --out FOLDER; docs/real-model.md)"
        what = "no such folder" if not folder.exists() else "not a Hugging Face model folder (no config.json)"
        raise PreflightError(f"model.path {path}: {what}{hint}")
    chat = cfg.data.chat or cfg.data.messages_key is not None or cfg.data.kind == "tool_arithmetic"
    if chat and not _has_chat_template(folder):
        raise PreflightError(f"model.path {path}: the tokenizer has no chat template, which chat prompts need "
                             f"(data.chat / data.messages_key / tool_arithmetic)")


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def check_agent(cfg: RunConfig) -> None:
    """Each custom tool imports and its factory returns a tool; a custom environment imports; an
    OpenAI-kind agent's entrypoint imports and takes (base_url, api_key, row)."""
    agent = cfg.rollout.agent
    assert agent is not None
    try:
        if agent.kind == "openai":
            assert agent.entrypoint is not None
            check_agent_entrypoint(agent.entrypoint)
        elif agent.environment is not None:
            load_environment_factory(agent.environment)
        else:
            load_tools([t for t in agent.tools if t not in BUILTIN], agent.tool_timeout_s)
    except ToolNotFound as err:
        raise PreflightError(f"rollout.{err}") from None


def check_agent_entrypoint(spec: str) -> None:
    """``rollout.agent.entrypoint`` imports here (the node agents import it in each episode's
    process) and is a callable taking three positional arguments."""
    mod_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    try:
        run = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError, ValueError, SyntaxError) as e:
        raise PreflightError(f"rollout.agent.entrypoint: cannot import {spec!r}: {type(e).__name__}: {e}") from None
    try:
        inspect.signature(run).bind("http://127.0.0.1:1/v1", "key", {})
    except (TypeError, ValueError) as e:
        raise PreflightError(
            f"rollout.agent.entrypoint: {spec!r} must take (base_url, api_key, row): {type(e).__name__}: {e}") from None


def check_reward(cfg: RunConfig) -> None:
    """What the node agents will need to score: each custom function imports, and the
    math-verify package is installed when a term uses it."""
    reward = cfg.reward
    for where, spec in [("reward", reward), *((f"reward.terms.{i}", t) for i, t in enumerate(reward.terms or []))]:
        if spec.kind == "custom":
            assert spec.function is not None
            check_reward_function(spec.function, f"{where}.function")
        if spec.kind == "math_verify" and not mathverify.available():
            raise PreflightError(f"{where}.kind: {mathverify.MISSING}")


def check_reasoning_gym(cfg: RunConfig) -> None:
    """The package is installed and the generator makes a row with the given settings."""
    assert cfg.data.dataset is not None
    try:
        reasoning_gym.generate_rows(cfg.data.dataset, cfg.data.dataset_config, 1, cfg.seed)
    except ValueError as err:
        raise PreflightError(str(err)) from None


def check_dataset(cfg: RunConfig) -> int:
    """Read and validate the whole dataset as ``prepare_data`` will; its row count."""
    source = cfg.data
    n = _check(source, "data.path", require_int_answer=cfg.mode == "rl" and "math_answer" in cfg.reward.kinds())
    held_out = source.eval_source()
    if held_out is not None and cfg.eval.enabled:  # the eval scores with the math rule whatever the reward
        _check(held_out, "data.eval_path", require_int_answer=True)
    return n


def _check(source: DataSpec, field: str, *, require_int_answer: bool) -> int:
    try:
        return check_source(source, require_int_answer=require_int_answer)
    except DatasetError as err:  # one line per bad row, each naming its file:line / file:row
        raise PreflightError(str(err)) from None
    except (ValueError, OSError) as err:
        raise PreflightError(f"{field}: {err}") from None


def check_reward_function(path: str, field: str = "reward.function") -> None:
    """Import the function as a node agent will (it runs from its working
    directory, which ``python -m`` puts on ``sys.path``: do the same here)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        load_reward_function(path)
    except RewardFunctionNotFound as err:
        raise PreflightError(f"{field}: {err}") from None


def check_new_run_id(cfg: RunConfig, run_id: str) -> None:
    """A run id names one run forever: refuse one whose prefix in the store holds
    artifacts (Temporal forgets closed runs after its retention; the store does not)."""
    try:
        prefix = art.run_prefix(run_id)
    except ValueError as err:
        raise PreflightError(f"--run-id: {err}") from None
    if cfg.store.startswith("file://") and not Path(cfg.store.removeprefix("file://")).is_dir():
        return  # a new store (opening a LocalStore would create its folder)
    try:
        store = S3Store.from_uri(cfg.store, create_bucket=False) if cfg.store.startswith("s3://") else open_store(cfg.store)
        keys = store.list(prefix)
    except StoreError as err:
        if "NoSuchBucket" in str(err):  # a new S3 store: the workers create the bucket
            return
        raise PreflightError(f"store {cfg.store}: cannot check run id {run_id!r}: {err}") from None
    except (OSError, ValueError) as err:
        raise PreflightError(f"store {cfg.store}: cannot check run id {run_id!r}: {err}") from None
    if keys:
        raise PreflightError(
            f"run id {run_id!r} is taken: {cfg.store.rstrip('/')}/{prefix}/ already holds {len(keys)} artifact(s). "
            f"Choose another --run-id, or continue that run with --resume-from {run_id}"
        )
