"""A real torch engine subprocess: every route, weight update, and routing through sglang-router."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_runtime.engine.backends import SGLangEngineBackend, TorchEngineBackend
from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.generate import generate_batch
from gpu_runtime.engine.router import RouterError, RouterProcess
from gpu_runtime.models.model_folder import load_model_folder
from tests.engine_fixtures import free_port, model_dirs_fixture, procs_fixture, start_engine, started_engine, stop_pid, wait_for  # noqa: F401

BATCH = [[1, 5, 6, 7, 8], [1, 9], [1, 10, 11]]
SP = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.95, "top_k": 40, "sampling_seed": 1234}


@pytest.fixture
def engine(model_dirs, procs, tmp_path) -> Iterator[EngineClient]:
    client = started_engine(procs, model_dirs["v1"], tmp_path / "engine.log", timeout_s=60, up_within_s=60,
                            what="engine /health")
    yield client
    client.close()


def test_every_route(engine, model_dirs) -> None:
    assert engine.health_generate(10)
    info = engine.model_info()
    assert info["is_generation"] and info["model_path"] == str(Path(model_dirs["v1"]).resolve())
    assert engine._request("GET", "/model_info") == info
    server = engine.server_info()
    assert server["pid"] > 0 and server["checksum"] == model_dirs["c1"] and server["weight_version"] == "1"
    assert server["model_config"]["hidden_size"] == 64
    assert engine._request("GET", "/server_info")["pid"] == server["pid"]
    assert engine.weights_checksum() == (model_dirs["c1"], "1")
    engine.flush_cache()

    out = engine.generate(BATCH, SP)
    assert len(out) == len(BATCH)
    for prompt, r in zip(BATCH, out):
        meta = r["meta_info"]
        assert meta["prompt_tokens"] == len(prompt)
        assert meta["completion_tokens"] == len(r["output_ids"]) == len(meta["output_token_logprobs"])
        assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"] == "1"
        assert [t for _, t, _ in meta["output_token_logprobs"]] == r["output_ids"]
        assert isinstance(r["text"], str)
    # a single (non-batch) prompt gives one object, equal to sample 0 of a batch
    single = engine._request("POST", "/generate", json={"input_ids": BATCH[0], "sampling_params": SP,
                                                         "return_logprob": True})
    assert isinstance(single, dict) and single["output_ids"] == engine.generate(BATCH[:1], SP)[0]["output_ids"]
    # deterministic: same batch twice, and equal to generating in-process with the same weights
    again = engine.generate(BATCH, SP)
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in out]
    assert [r["meta_info"]["output_token_logprobs"] for r in again] == [r["meta_info"]["output_token_logprobs"] for r in out]
    torch.set_num_threads(1)
    model, tok, _ = load_model_folder(model_dirs["v1"])
    direct = generate_batch(model, BATCH, max_new_tokens=10, temperature=1.0, top_p=0.95, top_k=40, seed=1234,
                            eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    assert [d.output_ids for d in direct] == [r["output_ids"] for r in out]
    assert [d.logprobs for d in direct] == [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in out]
    # errors are typed and carry the URL
    with pytest.raises(EngineError) as ei:
        engine._request("POST", "/generate", json={"input_ids": [[1, 10_000]], "sampling_params": SP})
    assert ei.value.status == 400 and engine.base_url in ei.value.url
    with pytest.raises(EngineError):
        engine._request("GET", "/nope")
    dead = EngineClient(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    with pytest.raises(EngineError) as ei:
        dead.generate(BATCH, SP)
    assert ei.value.url.startswith(dead.base_url) and not dead.health()


def test_update_weights_from_disk_changes_checksum(engine, model_dirs) -> None:
    before = engine.generate(BATCH, SP)
    res = engine.update_weights_from_disk(str(model_dirs["v2"]), 2)
    assert res["success"] is True and res["message"]
    assert engine.weights_checksum() == (model_dirs["c2"], "2")
    assert engine.model_info()["weight_version"] == "2"
    after = engine.generate(BATCH, SP)
    assert after[0]["meta_info"]["weight_version"] == "2"
    assert [r["output_ids"] for r in after] != [r["output_ids"] for r in before]
    with pytest.raises(EngineError):
        engine.update_weights_from_disk("/nonexistent/folder", 3)
    assert engine.weights_checksum() == (model_dirs["c2"], "2")  # a failed update keeps the old weights
    engine.update_weights_from_disk(str(model_dirs["v1"]), 1)
    assert [r["output_ids"] for r in engine.generate(BATCH, SP)] == [r["output_ids"] for r in before]


def test_generation_through_sglang_router_equals_direct(model_dirs, procs, tmp_path) -> None:
    ports = [free_port(), free_port()]
    for p in ports:
        procs.append(start_engine(model_dirs["v1"], p, tmp_path / f"engine-{p}.log"))
    clients = [EngineClient(f"http://127.0.0.1:{p}", timeout_s=60) for p in ports]
    for c in clients:
        wait_for(c.health, 60, f"{c.base_url} /health")
    router = RouterProcess(free_port(), [c.base_url for c in clients], log_path=tmp_path / "router.log")
    try:
        router.start()
        assert router.worker_urls() == {c.base_url for c in clients}
        via = EngineClient(router.url, timeout_s=60)
        direct = clients[0].generate(BATCH, SP)
        for _ in range(4):  # round robin: both engines serve, all answers equal
            assert [r["output_ids"] for r in via.generate(BATCH, SP)] == [r["output_ids"] for r in direct]
        assert all(c.server_info()["num_generate_requests"] >= 2 for c in clients)
        # sampling_seed survives the router: another seed changes the tokens
        other = via.generate(BATCH, {**SP, "sampling_seed": 99})
        assert [r["output_ids"] for r in other] != [r["output_ids"] for r in direct]
        # membership: remove, re-add, sync
        assert router.remove_worker(clients[1].base_url)
        assert router.worker_urls() == {clients[0].base_url}
        router.add_worker(clients[1].base_url)
        router.sync([clients[1].base_url])
        assert router.worker_urls() == {clients[1].base_url}
        assert [r["output_ids"] for r in via.generate(BATCH, SP)] == [r["output_ids"] for r in direct]
        via.close()
    finally:
        router.stop()


def test_router_add_worker_waits_for_a_late_engine_and_names_the_failed_probe(model_dirs, procs, tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = RouterProcess(free_port(), [], log_path=tmp_path / "router.log")
    try:
        router.start()
        # nothing listens yet: the router's background job keeps failing its health probe,
        # and the error quotes the router's own warning about it
        with pytest.raises(RouterError, match=r"(?s)not listed by the router within 6.0s; router log .*health"):
            router.add_worker(url, timeout_s=6.0)
        # the router keeps retrying that job: once an engine answers there, it is listed
        procs.append(start_engine(model_dirs["v1"], port, tmp_path / "engine.log"))
        wait_for(lambda: router.worker_urls() == {url}, 120, "the late engine listed")
        assert [w["url"] for w in router.list_workers()] == [url]
        assert router.remove_worker(url) and router.worker_urls() == set()
    finally:
        router.stop()


def test_backend_command_lines(tmp_path) -> None:
    t = TorchEngineBackend(threads=2).command(model_path="/m", port=31000, weight_version=4)
    assert t[1:3] == ["-m", "gpu_runtime.engine.server"]
    assert t[t.index("--threads") + 1] == "2" and t[t.index("--weight-version") + 1] == "4"
    s = SGLangEngineBackend(model_path="/m", tp_size=2, mem_fraction_static=0.7, extra_args=["--dtype", "bfloat16"])
    cmd = s.command(port=30001)
    assert cmd[1:4] == ["-m", "gpu_runtime.engine.keyed_launch", "sglang.launch_server"]  # --api-key from env
    for flag, val in (("--model-path", "/m"), ("--tp-size", "2"), ("--port", "30001"),
                      ("--host", "127.0.0.1"), ("--mem-fraction-static", "0.7"), ("--dtype", "bfloat16")):
        assert cmd[cmd.index(flag) + 1] == val
    assert s.command(model_path="/newer", port=1)[s.command(model_path="/newer", port=1).index("--model-path") + 1] == "/newer"


@pytest.mark.gpu
def test_sglang_server_generates(model_dirs, tmp_path) -> None:
    if not torch.cuda.is_available() or not SGLangEngineBackend.available():
        pytest.skip("needs CUDA and sglang")
    port = free_port()
    backend = SGLangEngineBackend(model_path=str(model_dirs["v1"]), mem_fraction_static=0.3)
    log = open(tmp_path / "sglang.log", "ab")
    proc = subprocess.Popen(backend.command(port=port), stdout=log, stderr=subprocess.STDOUT,
                            env=backend.env(), start_new_session=True)
    try:
        c = EngineClient(f"http://127.0.0.1:{port}", timeout_s=120)
        wait_for(lambda: proc.poll() is not None or c.health_generate(10), 600, "sglang server")
        assert proc.poll() is None, (tmp_path / "sglang.log").read_text()[-3000:]
        out = c.generate(BATCH, {**SP, "temperature": 0.0})
        assert len(out) == len(BATCH) and all(r["output_ids"] for r in out)
        c.update_weights_from_disk(str(model_dirs["v2"]), 2)
    finally:
        stop_pid(proc)
        log.close()


def test_stop_strings_and_tokens_through_the_server_and_the_rollout(engine, model_dirs) -> None:
    """SGLang's ``stop`` / ``stop_token_ids`` on a real engine process: a sample ends at the
    token that completes a stop string (kept, and reported as ``matched``), the tokens before
    it are those of the run without stops, and the rollout passes ``rollout.stop`` through."""
    from gpu_runtime.data.datasets import generate_arithmetic
    from gpu_runtime.rollout.chunks import ChunkPlan
    from gpu_runtime.rollout.request import RolloutRequest
    from gpu_runtime.rollout.single_turn import generate_chunk
    from spec.rollout import RolloutSpec

    _, tok, _ = load_model_folder(model_dirs["v1"])
    free = engine.generate(BATCH, SP)
    ids = next(r["output_ids"] for r in free if len(r["output_ids"]) >= 4)
    before, text = tok.decode(ids[:2]), tok.decode(ids[:3])
    stop = next(text[-n:] for n in range(1, len(text) + 1) if text[-n:] not in before)
    for given in (stop, [stop, "never-produced-zzz"]):  # one string or a list, as SGLang takes them
        cut = engine.generate(BATCH, {**SP, "stop": given})
        for a, b in zip(free, cut):
            n = len(b["output_ids"])
            assert b["output_ids"] == a["output_ids"][:n]
            if b["meta_info"]["finish_reason"]["type"] == "stop" and b["output_ids"] != a["output_ids"]:
                assert b["meta_info"]["finish_reason"]["matched"] == stop and stop in b["text"]
                assert stop not in tok.decode(b["output_ids"][:-1])
        assert any(b["meta_info"]["finish_reason"].get("matched") == stop for b in cut)
    token = ids[1]
    by_token = engine.generate(BATCH, {**SP, "stop_token_ids": [token]})
    hit = [b for b in by_token if b["meta_info"]["finish_reason"].get("matched") == token]
    assert hit and all(b["output_ids"][-1] == token and token not in b["output_ids"][:-1] for b in hit)
    with pytest.raises(EngineError) as ei:
        engine.generate(BATCH, {**SP, "stop": [""]})
    assert ei.value.status == 400

    # the rollout's request carries rollout.stop / stop_token_ids to the engine
    rows = generate_arithmetic(4, seed=0, max_operand=20)
    req = RolloutRequest(run_id="r", step=1, seed=3, policy_version=1, data_cursor=0, n_rows=4, rollout=RolloutSpec(
        prompts_per_step=4, group_size=1, chunk_size=4, max_new_tokens=10, temperature=1.0, top_p=1.0, top_k=-1))
    plan = ChunkPlan(chunk=0, seed=1234, members=[(i, 0) for i in range(4)])
    sent: list[dict] = []

    def gen(batch: list[list[int]], params: dict) -> tuple[list[dict], str]:
        sent.append(params)
        return engine.generate(batch, params), engine.base_url

    plain = generate_chunk(req, plan, rows, tok, gen)
    assert "stop" not in sent[-1] and "stop_token_ids" not in sent[-1]
    first = plain.samples[0]
    stop_tok = first.response_ids[1]
    stops = req.rollout.model_copy(update={"stop": ["zzz-never"], "stop_token_ids": [stop_tok]})
    stopped = generate_chunk(dataclasses.replace(req, rollout=stops), plan, rows, tok, gen)
    assert sent[-1]["stop"] == ["zzz-never"] and sent[-1]["stop_token_ids"] == [stop_tok]
    s = stopped.samples[0]
    assert s.response_ids == first.response_ids[: first.response_ids.index(stop_tok) + 1]
    assert s.finish_reason == "stop" and len(s.logprobs) == len(s.response_ids)
