"""The fleet on ``engines.backend: sglang`` against stand-ins that answer as SGLang 0.5.23 does
(tests/sglang_fake.py; SGLang needs CUDA), and every request it sends checked against SGLang's own
request classes, routes and flags (tests/sglang_contract_check.py, on the pinned wheel that
``make sglang-contract`` unpacks). One test per defect of issue #22 (1, 2, 3, 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.node_engines import EngineActivities
from gpu_runtime.engine.backends import SGLangEngineBackend
from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.fleet_types import HealthConfig, WeightMismatch
from gpu_runtime.engine.router import RouterProcess
from gpu_runtime.models.model_folder import save_model_folder
from gpu_runtime.store.artifacts import row_seed
from spec.engine import EngineSpec
from tests.engine_fixtures import REPO, free_port, free_port_block, tiny_model, wait_for
from tests.sglang_fake import FLUSHED, FakeSGLang
from workflows.contracts.training import UpdateWeightsInput
from workflows.failures import Failure

HEALTH = HealthConfig(interval_s=60.0, timeout_s=5.0, first_wait_s=10.0, failure_threshold=1)
CONTRACT_DIR = REPO / ".sglang_contract"
SP = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 1234}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Llama folders v1 and v2 (SGLang reads their parameters back) and a Qwen2 one (it cannot)."""
    root = tmp_path_factory.mktemp("sglang-models")
    out: dict[str, object] = {}
    for name, seed, arch, version in (("v1", 1, "llama", 1), ("v2", 2, "llama", 2), ("qwen2", 3, "qwen2", 2)):
        model, tok = tiny_model(seed, arch=arch)
        out["c" + name] = save_model_folder(model, tok, root / name, weight_version=version)
        out[name] = root / name
    return out


class SGLangFleet:
    """An ``EngineFleet`` with the SGLang backend whose slots are ``FakeSGLang`` servers."""

    def __init__(self, folder: Path, tmp: Path, n: int = 2, *, deterministic: bool = False, **fake: object) -> None:
        self.backend = SGLangEngineBackend(model_path=str(folder), deterministic=deterministic)
        self.fakes = [FakeSGLang(folder, "1", env=self.backend.env(), deterministic=deterministic, **fake)
                      for _ in range(n)]
        self.fleet = EngineFleet(self.backend, n, folder, free_port_block(n), tmp / "logs", health=HEALTH,
                                 weight_version=1)
        for s, f in zip(self.fleet.slots, self.fakes):
            s.url, s.state, s.weight_version = f.url, "healthy", "1"

    def requests(self, since: list[int] | None = None) -> list[tuple[str, str, object]]:
        """Every fake's requests (from ``since``, a ``mark()``, on)."""
        return [r for i, f in enumerate(self.fakes) for r in f.requests[(since[i] if since else 0):]]

    def mark(self) -> list[int]:
        return [len(f.requests) for f in self.fakes]

    def violations(self) -> list[str]:
        return [v for f in self.fakes for v in f.violations]

    def close(self) -> None:
        self.fleet.stop()
        for f in self.fakes:
            f.close()


@pytest.fixture
def make_fleet(tmp_path: Path) -> Iterator:
    made: list[SGLangFleet] = []

    def make(folder: Path, **kw: object) -> SGLangFleet:
        made.append(SGLangFleet(folder, tmp_path, **kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


def _update_weights(fleet: SGLangFleet, folder: Path, checksum: str, monkeypatch: pytest.MonkeyPatch):
    """The node's ``update_weights`` activity with the runtime reduced to this fleet."""
    monkeypatch.setattr(SGLangEngineBackend, "available", staticmethod(lambda: True))
    rt = SimpleNamespace(
        local_weights=SimpleNamespace(folder=lambda *a, **k: folder), engines=SimpleNamespace(fleet=fleet.fleet),
        drain_events=lambda: [], ensure_engines=lambda *a, **k: (fleet.fleet.update_weights(folder, 2), [])[1],
        node_id="node0",
    )
    acts = EngineActivities(rt, exporter=lambda run_id, version: lambda: None)
    inp = UpdateWeightsInput(run_id="r", store_uri="file:///unused", policy_version=2,
                             checksum=checksum, engines=EngineSpec(backend="sglang", num_engines=2))
    return ActivityEnvironment().run(acts.update_weights, inp)


# ---- defect 1: the checksum gate ------------------------------------------------------
def test_update_weights_on_sglang_engines_passes_the_gate_when_their_weights_are_verified(
    folders, make_fleet, monkeypatch,
) -> None:
    """SGLang reports no checksum: an engine whose sampled parameters (``/get_weights_by_name``)
    are the folder's stands for the folder's checksum, so the activity's gate compares the
    trainer's checksum with a verified one instead of ``{None}`` (which failed every push)."""
    f = make_fleet(folders["v1"])
    res = _update_weights(f, folders["v2"], folders["cv2"], monkeypatch)
    assert {e.checksum for e in res.engines} == {folders["cv2"]} and {e.weight_version for e in res.engines} == {2}
    asked = [r[2]["name"] for r in f.requests() if r[1] == "/get_weights_by_name"]
    assert "model.layers.0.self_attn.q_proj.weight" in asked and len(asked) == 2 * 4  # 4 parameters per engine


def test_an_sglang_engine_that_kept_other_weights_fails_the_push(folders, make_fleet) -> None:
    """The check is real: an engine that answers success but serves other weights is caught."""
    f = make_fleet(folders["v1"])
    f.fakes[1].keep_old_weights = True
    f.fakes[1].weight_version = "2"  # it even reports the right version
    with pytest.raises(WeightMismatch) as err:
        f.fleet.update_weights(folders["v2"], 2)
    assert err.value.slots == [1]
    assert [s.checksum for s in f.fleet.snapshot()] == [folders["cv2"], None]


def test_a_qwen2_model_on_sglang_is_refused_rather_than_served_unchecked(folders, make_fleet, monkeypatch) -> None:
    """SGLang's Qwen2ForCausalLM has no ``get_weights_by_name``: no weight check is possible,
    so the push is refused (not retried) with the reason."""
    f = make_fleet(folders["qwen2"])
    with pytest.raises(ApplicationError) as err:
        _update_weights(f, folders["qwen2"], folders["cqwen2"], monkeypatch)
    assert err.value.type == Failure.INVALID_INPUT.value and err.value.non_retryable
    assert "SGLang cannot read back the parameters of Qwen2ForCausalLM" in err.value.message
    assert not f.requests()  # refused before any engine was asked anything


# ---- defect 2: one seed per sample ----------------------------------------------------
def test_each_sample_has_its_own_seed_and_a_resent_chunk_is_the_same(folders, make_fleet) -> None:
    """One ``sampling_params`` per sample, seeded as the torch engine seeds its rows; with
    ``--enable-deterministic-inference`` (engines.deterministic) SGLang honours them: the G samples
    of a group differ and a chunk sent again comes back the same."""
    f = make_fleet(folders["v1"], deterministic=True)
    group = [[1, 5, 6]] * 4
    first, _ = f.fleet.generate_chunk(group, dict(SP))
    again, _ = f.fleet.generate_chunk(group, dict(SP))
    body = next(r[2] for r in f.requests() if r[1] == "/generate")
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [row_seed(1234, i) for i in range(4)]
    assert len({tuple(r["output_ids"]) for r in first}) > 1
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again]
    assert "--enable-deterministic-inference" in f.backend.command(port=1)
    assert "--enable-deterministic-inference" not in SGLangEngineBackend(model_path="m").command(port=1)


# ---- defect 3: released memory --------------------------------------------------------
def test_no_generating_probe_while_released_and_a_resume_is_pushed_before_serving(folders, make_fleet) -> None:
    """While released the fleet's probe asks ``/health`` (which, with the backend's environment,
    generates nothing); a resume is followed by a push of the served version (the memory saver
    gives the weights' memory back uninitialised), also when the caller defers it."""
    f = make_fleet(folders["v1"])
    f.fleet.update_weights(folders["v2"], 2)
    released = f.mark()
    f.fleet.release_memory()
    f.fleet.check_now()
    assert [s.state for s in f.fleet.snapshot()] == ["healthy"] * 2 and not f.violations()
    assert [r[1] for r in f.requests(released)] == ["/release_memory_occupation", "/health"] * 2
    resumed = f.mark()
    f.fleet.resume_memory()
    pushed = [r[2] for r in f.requests(resumed) if r[1] == "/update_weights_from_disk"]
    assert pushed == [{"model_path": str(folders["v2"]), "weight_version": "2"}] * 2
    f.fleet.generate_chunk([[1, 5]], dict(SP))
    f.fleet.release_memory()
    f.fleet.resume_memory(push=False)  # update_weights pushes the new version next; a chunk first still waits
    f.fleet.generate_chunk([[1, 5]], dict(SP))
    assert not f.violations()


def test_the_router_probes_sglang_engines_without_generating(folders, make_fleet, tmp_path) -> None:
    """sglang-router (0.3.2, real) probes a worker's ``/health`` every second, released or not,
    which with the backend's environment generates nothing. It refuses a list of sampling params
    (HTTP 422), so the fleet sends an SGLang chunk to an engine directly, not through it."""
    f = make_fleet(folders["v1"], n=1)
    router = RouterProcess(free_port(), [f.fakes[0].url], log_path=tmp_path / "router.log")
    router.start()
    try:
        f.fleet.release_memory()
        seen = f.mark()
        # the router probes every second: wait for two of its probes (and the fleet's) to arrive
        wait_for(lambda: len([r for r in f.requests(seen) if r[1] == "/health"]) >= 2, 30, what="probes while released")
        assert {r[1] for r in f.requests(seen)} == {"/health"} and not f.violations()
        f.fleet.resume_memory()
        params = f.backend.batch_sampling_params(dict(SP), 2)
        with pytest.raises(EngineError) as err:
            EngineClient(router.url).generate([[1, 5], [1, 6]], params)
        assert err.value.status == 422
        f.fleet.router = router
        _, url = f.fleet.generate_chunk([[1, 5], [1, 6]], dict(SP))
        assert url == f.fakes[0].url
        body = [r[2] for r in f.requests() if r[1] == "/generate"][-1]
        assert [p["sampling_seed"] for p in body["sampling_params"]] == [row_seed(1234, 0), row_seed(1234, 1)]
    finally:
        f.fleet.router = None
        router.stop()


# ---- defect 5: answers as SGLang sends them ------------------------------------------
def test_health_and_flush_cache_answers_are_read_as_sglang_sends_them(folders, make_fleet) -> None:
    """``/health`` and ``/health_generate`` answer an empty 200 (a starting engine was never seen
    healthy), ``/flush_cache`` plain text."""
    f = make_fleet(folders["v1"], n=1)
    c = EngineClient(f.fakes[0].url)
    assert c.health()
    c.check_health_generate(5.0)
    assert c.flush_cache() == FLUSHED


# ---- every request against SGLang's own classes --------------------------------------
def _check(requests: list, launch_args: list[str], tmp_path: Path) -> dict:
    if not (CONTRACT_DIR / ".installed").exists():
        pytest.fail(f"{CONTRACT_DIR} is missing: run `make sglang-contract` (make test does)")
    path = tmp_path / "requests.json"
    path.write_text(json.dumps({"requests": requests, "launch_args": launch_args}))
    out = subprocess.run(
        [sys.executable, str(REPO / "tests" / "sglang_contract_check.py"), str(CONTRACT_DIR / "sglang"), str(path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(CONTRACT_DIR)},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_request_the_fleet_sends_matches_sglangs_own_classes(folders, make_fleet, tmp_path) -> None:
    from gpu_runtime.engine.weight_push import receive_broadcast
    from gpu_runtime.weight_sync.distributed import GroupSpec, folder_manifest

    f = make_fleet(folders["v1"], deterministic=True)
    f.fleet.update_weights(folders["v2"], 2)
    f.fleet.generate_chunk([[1, 5], [1, 6]], {**SP, "stop": ["\n"], "stop_token_ids": [2]})
    f.fleet.generate_chunk([[1, 5]], {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": -1})
    f.fleet.check_now()
    f.fleet.release_memory()
    f.fleet.check_now()
    f.fleet.resume_memory()
    EngineClient(f.fakes[0].url).flush_cache()
    receive_broadcast(f.fakes[0].url, 1, spec=GroupSpec("127.0.0.1", 1, 3, "g", "nccl"), manifest=folder_manifest(folders["v2"]),
             version="2", checksum=None, request_timeout_s=5.0, group_timeout_s=None)  # the push's SGLang settings
    backend = SGLangEngineBackend(gpus=(1,), extra_args=["--enable-memory-saver"], deterministic=True)
    cmd = backend.command(model_path="m", port=30000, weight_version=2) + backend.slot_args(0)
    launch = cmd[cmd.index("sglang.launch_server") + 1:]
    report = _check(f.requests(), launch, tmp_path)
    assert report["problems"] == []
    assert set(report["checked"]) >= {
        "GET /health", "GET /health_generate", "POST /generate", "GET /get_model_info", "POST /get_weights_by_name",
        "POST /update_weights_from_disk", "POST /release_memory_occupation", "POST /resume_memory_occupation",
        "POST /flush_cache", "POST /init_weights_update_group", "POST /update_weights_from_distributed",
        "POST /destroy_weights_update_group", "launch_server arguments",
    }


def test_the_contract_check_catches_what_sglang_would_drop_or_refuse(tmp_path) -> None:
    """Not vacuous: one dict for a batch, a field SGLang does not have, a route it does not serve."""
    report = _check([
        ["POST", "/generate", {"input_ids": [[1], [2]], "sampling_params": {"sampling_seed": 1}}],
        ["POST", "/update_weights_from_disk", {"model_path": "/m", "checksum": "abc"}],
        ["GET", "/weights_checksum", None],
    ], ["--tp-size", "1", "--no-such-flag"], tmp_path)
    assert len(report["problems"]) == 4, report
