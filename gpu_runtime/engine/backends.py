"""How an engine slot is launched: the in-repo torch engine or ``sglang.launch_server``.

Both speak SGLang's native HTTP API; the command line and two request details differ:
a chunk's sampling params (one dict whose ``sampling_seed`` the torch engine derives per
row, or SGLang's list of one dict per sample with that row's seed) and whether released
memory keeps the weights. SGLang is never imported here (it needs CUDA);
``SGLangEngineBackend.available()`` checks for it lazily.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpu_runtime.proc.devices import child_env
from gpu_runtime.store.artifacts import row_seed

SamplingParams = dict[str, Any]


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

    def slot_args(self, slot: int) -> list[str]:
        """The slot's device (``--device cuda:N``); nothing on CPU."""
        device = self.devices[slot % len(self.devices)]
        return [] if device == "cpu" else ["--device", device]

    def env(self) -> dict[str, str]:
        n = str(self.threads)
        # the engine must import gpu_runtime whatever the launcher's working directory
        root = str(Path(__file__).resolve().parents[2])
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

    def env(self) -> dict[str, str]:
        root = str(Path(__file__).resolve().parents[2])  # keyed_launch must import from any cwd
        pp = os.environ.get("PYTHONPATH")
        # GET /health answers without generating a token (GET /health_generate still does): the
        # router's probe every second and the fleet's probe while the memory is released use it
        return {**os.environ, "PYTHONPATH": root + (os.pathsep + pp if pp else ""),
                "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
