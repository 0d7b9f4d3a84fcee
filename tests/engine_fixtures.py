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

from gpu_runtime.node.proc import free_port, free_port_block  # noqa: F401  (re-exported for tests)
from tests.stack import wait_for as stack_wait_for

from gpu_runtime.models.causal_lm import ModelConfig, build_model
from gpu_runtime.models.model_folder import save_model_folder
from gpu_runtime.models.tokenizer import CharTokenizer

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def tiny_config(vocab_size: int) -> ModelConfig:
    # a large init makes logits peaked, so greedy ties (and float-order flips) are unlikely
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
    )


def make_model_folder(folder: Path, *, seed: int, weight_version: int) -> str:
    """Save a tiny random model; returns its checksum."""
    tok = CharTokenizer()
    model = build_model(tiny_config(tok.vocab_size), seed)
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


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Append every Popen you start; all are stopped by pid at teardown, even on failure."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        stop_pid(p)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Two tiny model folders (v1, v2 with different weights) and their checksums."""
    root = tmp_path_factory.mktemp("models")
    v1, v2 = root / "v1", root / "v2"
    c1 = make_model_folder(v1, seed=1, weight_version=1)
    c2 = make_model_folder(v2, seed=2, weight_version=2)
    return {"v1": v1, "v2": v2, "c1": c1, "c2": c2}
