"""engines.backend vllm without a server: the command line, the interpreter lookup, the request each
sample becomes, a vLLM answer read back into the engine contract, the checksum of vLLM's fused
parameters, and the config checks. The real server: tests/integration/test_engine_vllm.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from gpu_runtime.engine.backends import VLLM_PYTHON_ENV, VLLMEngineBackend, vllm_python
from gpu_runtime.engine.client import EngineError
from gpu_runtime.engine.vllm_client import to_contract, vllm_sampling
from gpu_runtime.engine.vllm_worker import hf_tensors
from gpu_runtime.models.model_folder import model_checksum, save_model_folder, weights_checksum
from spec.engine import EngineSpec
from tests.engine_fixtures import tiny_model


def test_the_interpreter_is_found_by_field_then_env_else_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert vllm_python(str(exe)) == str(exe)
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(exe))
    assert vllm_python() == str(exe)
    with pytest.raises(ValueError, match="engines.vllm_python"):
        vllm_python(str(tmp_path / "missing"))


def test_the_command_chooses_the_logprob_kind_and_the_routes(tmp_path: Path) -> None:
    model, tok = tiny_model(1, hidden_size=128, num_attention_heads=2)
    save_model_folder(model, tok, tmp_path / "v1", weight_version=1)
    b = VLLMEngineBackend(python="/venv/bin/python")
    cmd = b.command(model_path=str(tmp_path / "v1"), port=8100)
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--dtype"] == "float32"
    assert flags["--max-model-len"] == str(model.config.max_position_embeddings)
    assert "--enable-scale-out" in cmd
    env = b.env()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_each_sample_gets_its_own_seed_and_vllms_names() -> None:
    sp = {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "sampling_seed": 5,
          "stop": "\n", "stop_token_ids": [3]}
    out = vllm_sampling(sp, 11, True)
    assert out == {"max_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "logprobs": 0, "seed": 11,
                   "stop": ["\n"], "include_stop_str_in_output": True, "detokenize": True, "stop_token_ids": [3]}
    assert "seed" not in vllm_sampling({**sp, "temperature": 0.0}, 11, True)  # greedy: no seed


def test_a_vllm_choice_reads_as_the_engine_contract() -> None:
    choice = {"token_ids": [4, 9, 2], "finish_reason": "stop", "stop_reason": None,
              "logprobs": {"content": [{"token_id": t, "logprob": -0.5 * i} for i, t in enumerate([4, 9, 2])]},
              "weight_versions": [{"version": "3", "start": 0, "end": 3}]}
    out = to_contract(choice, "http://e")
    assert out["output_ids"] == [4, 9, 2]
    assert out["meta_info"]["weight_version"] == "3"
    assert out["meta_info"]["finish_reason"] == {"type": "stop"}
    assert out["meta_info"]["output_token_logprobs"] == [[0.0, 4, None], [-0.5, 9, None], [-1.0, 2, None]]
    choice["weight_versions"].append({"version": "4", "start": 3, "end": 3})
    with pytest.raises(EngineError, match="weight versions"):
        to_contract(choice, "http://e")


def _fused(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as vLLM's Qwen2 holds them: q/k/v and gate/up stacked, a tied head once."""
    sd = dict(model.named_parameters())  # a tied lm_head is listed once, as vLLM does
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if ".q_proj." in name:
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [t, sd[name.replace("q_proj", "k_proj")], sd[name.replace("q_proj", "v_proj")]]).detach()
        elif ".gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, sd[name.replace("gate_proj", "up_proj")]])
        elif not any(k in name for k in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = t.detach()
    return out


def test_vllms_fused_parameters_hash_as_the_trainers_weights() -> None:
    model, _ = tiny_model(1, hidden_size=128, num_attention_heads=2)
    fused = _fused(model)
    assert any(".qkv_proj." in n for n in fused)
    assert weights_checksum(hf_tensors(fused, model.config)) == model_checksum(model)
    fused["model.layers.1.mlp.gate_up_proj.weight"][0, 0] += 1.0
    assert weights_checksum(hf_tensors(fused, model.config)) != model_checksum(model)


def test_the_config_refuses_what_vllm_engines_cannot_do() -> None:
    assert EngineSpec(backend="vllm").backend == "vllm"
    with pytest.raises(ValidationError, match="weight_sync store"):
        EngineSpec(backend="vllm", weight_sync="distributed")
    with pytest.raises(ValidationError, match="release_memory"):
        EngineSpec(backend="vllm", release_memory="on")
