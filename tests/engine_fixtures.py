"""Shared helpers for engine tests: tiny model folders, free ports, subprocess cleanup."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from gpu_runtime.proc.processes import free_port, free_port_block  # noqa: F401  (re-exported for tests)
from tests.stack import wait_for as stack_wait_for

import tempfile
from functools import cache

from transformers import PreTrainedModel

from gpu_runtime.data.datasets import generate_arithmetic, prompt_text, sft_target
from gpu_runtime.engine.client import EngineClient
from gpu_runtime.models.hf_factory import init_model_folder, train_bpe_tokenizer
from gpu_runtime.models.model_folder import load_model_folder, save_model_folder
from gpu_runtime.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
TEXTS = [prompt_text(r) + sft_target(r) for r in generate_arithmetic(300, 0, 99, "+-*")] + [
    "What is the answer? The answer is 42.", "hello world", "(9-2)*3=21",
]


@cache
def _tokenizer() -> Tokenizer:
    return Tokenizer(train_bpe_tokenizer(TEXTS, 300))


def tiny_model(
    seed: int, *, arch: str = "qwen2", tie: bool = True, hidden_size: int = 64, num_attention_heads: int = 4,
) -> tuple[PreTrainedModel, Tokenizer]:
    """A real random-init ``transformers`` model (2 layers, hidden 64: head_dim 16) and a BPE
    tokenizer trained here. A large init makes logits peaked, so greedy ties (and float-order
    flips) are unlikely. vLLM's CPU attention needs head_dim 64: hidden 128, 2 heads."""
    folder = Path(tempfile.mkdtemp(prefix="tiny-model-"))
    init_model_folder(
        folder / "m", arch=arch, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=2, max_position_embeddings=512, tokenizer=_tokenizer().hf, seed=seed,
        tie_word_embeddings=tie, initializer_range=0.3,
    )
    model, tok, _ = load_model_folder(folder / "m")
    return model, tok


def make_model_folder(folder: Path, *, seed: int, weight_version: int, **shape: int) -> str:
    """Save a tiny random model as a versioned model folder; returns its checksum.
    ``shape``: ``tiny_model``'s hidden_size and num_attention_heads."""
    model, tok = tiny_model(seed, **shape)
    return save_model_folder(model, tok, folder, weight_version=weight_version)


def wait_for(cond: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Poll cond() until it returns a truthy value; fail the test after timeout_s."""
    return stack_wait_for(cond, timeout_s, interval_s=interval_s, what=what)


def stop_pid(proc: subprocess.Popen) -> None:
    """SIGKILL a child by pid (continuing it first in case it was SIGSTOPped) and reap it."""
    if proc.poll() is None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                break
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        log.error("pid %d did not exit", proc.pid)


def start_engine(model_path: Path, port: int, log_path: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gpu_runtime.engine.server", "--model-path", str(model_path),
           "--port", str(port), "--threads", "1", "--parent-pid", str(os.getpid()), *extra]
    logf = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=logf, start_new_session=True)
    finally:
        logf.close()


def started_engine(procs: list[subprocess.Popen], model_path: Path, log_path: Path, *extra: str, timeout_s: float,
                   up_within_s: float, what: str = "engine up") -> EngineClient:
    """An engine server on a free port (stopped with ``procs``), up (``/health``) within
    ``up_within_s``; its client, with request timeout ``timeout_s``."""
    port = free_port()
    procs.append(start_engine(model_path, port, log_path, *extra))
    client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=timeout_s)
    wait_for(client.health, up_within_s, what)
    return client


@pytest.fixture(name="procs")
def procs_fixture() -> Iterator[list[subprocess.Popen]]:
    """Append every Popen you start; all are stopped by pid at teardown, even on failure."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        stop_pid(p)


@pytest.fixture(scope="module", name="model_dirs")
def model_dirs_fixture(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Two tiny model folders (v1, v2 with different weights) and their checksums."""
    root = tmp_path_factory.mktemp("models")
    v1, v2 = root / "v1", root / "v2"
    c1 = make_model_folder(v1, seed=1, weight_version=1)
    c2 = make_model_folder(v2, seed=2, weight_version=2)
    return {"v1": v1, "v2": v2, "c1": c1, "c2": c2}
