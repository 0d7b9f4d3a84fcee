"""How an engine slot is launched: the in-repo torch engine or ``sglang.launch_server``.

Both speak SGLang's native HTTP API; only the command line differs. SGLang is never
imported here (it needs CUDA); ``SGLangEngineBackend.available()`` checks for it lazily.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from gpu_runtime.proc.devices import child_env


@runtime_checkable
class EngineBackend(Protocol):
    name: str
    supports_checksum: bool  # serves GET /weights_checksum

    def command(
        self, *, model_path: str, port: int, host: str = "127.0.0.1", weight_version: int | str | None = None
    ) -> list[str]: ...

    def env(self) -> dict[str, str]: ...

    def slot_args(self, slot: int) -> list[str]: ...  # per-slot placement flags


@dataclass
class TorchEngineBackend:
    threads: int = 1
    python: str = sys.executable
    step_delay_ms: float = 0.0  # fault-injection aid for tests: slows each decode step
    watch_parent: bool = True  # the engine exits if the launching process disappears
    devices: tuple[str, ...] = ("cpu",)  # slot i runs on devices[i % len]; "cuda:N": model + KV cache there
    name: str = "torch"
    supports_checksum: bool = True

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
    python: str = sys.executable
    name: str = "sglang"
    supports_checksum: bool = False

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
        return cmd + list(self.extra_args)

    def slot_args(self, slot: int) -> list[str]:
        return ["--base-gpu-id", str(self.gpus[slot % len(self.gpus)])] if self.gpus else []

    def env(self) -> dict[str, str]:
        root = str(Path(__file__).resolve().parents[2])  # keyed_launch must import from any cwd
        pp = os.environ.get("PYTHONPATH")
        return {**os.environ, "PYTHONPATH": root + (os.pathsep + pp if pp else "")}
