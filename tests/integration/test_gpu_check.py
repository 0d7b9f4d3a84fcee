"""``bench/gpu_check.sh`` in its CPU tiny mode: the same script and code the GPU run uses
(real engine processes in a fleet, the policy trainer, both weight pushes, a SIGKILLed
engine healed, the same-seed rerun), so the device run is rehearsed here. Its numbers
are not asserted (speed only in benchmarks); what must hold is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine_fixtures import REPO


@pytest.mark.long  # ~30 s; its sections are tested each on its own in `make test` (docs/testing.md)
def test_cpu_tiny_run_passes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run([str(REPO / "bench" / "gpu_check.sh"), "--cpu", "--tiny", "--out", str(out),
                           "--work-dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    s = data["sections"]
    assert data["verdict"] == "ok"
    for name in ("environment", "model_folder", "engines", "generation", "grpo", "grpo_same_seed",
                 "same_seed_bitwise", "heal_engine", "precision"):
        assert s[name]["status"] == "ok", (name, s[name])
    assert s["precision"]["bf16_same_seed_bitwise"] is True and s["precision"]["bf16_differs_from_fp32"] is True
    assert s["generation"]["same_seed_same_tokens"] is True and s["generation"]["tokens"] > 0
    assert s["grpo"]["final_checksum"] == s["grpo_same_seed"]["final_checksum"]
    assert len(s["grpo"]["train_step_s"]) == 2
    assert s["grpo"]["sync_dist_backend"] == "gloo"
    for k in ("sync_store_ms", "sync_shm_ms", "sync_dist_ms", "sync_store_gb_s", "sync_shm_gb_s", "sync_dist_gb_s"):
        assert s["grpo"][k] > 0, k
    assert s["heal_engine"]["serves_version"] == "2" and s["heal_engine"]["heal_s"] >= s["heal_engine"]["detect_s"]
    assert s["megatron"]["status"] in ("skipped", "ok") and s["sglang"]["status"] == "skipped"
    assert not list((tmp_path / "work").glob("*")), "the work dir is removed unless --keep"


def test_a_missing_package_is_reported_and_nothing_else_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(REPO))
    from bench import gpu_check

    monkeypatch.setattr(gpu_check, "have", lambda m: m not in ("pydantic", "megatron.core"))
    args = gpu_check.parse_args(["--cpu", "--tiny", "--out", str(tmp_path / "r.json"), "--work-dir", str(tmp_path / "w")])
    data = gpu_check.Check(args).run()
    assert list(data["sections"]) == ["environment"]
    assert data["sections"]["environment"]["missing"] == ["pydantic"]
    assert "cannot run: missing ['pydantic']" in data["verdict"]
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == data["verdict"]
