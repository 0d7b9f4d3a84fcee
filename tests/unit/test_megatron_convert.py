"""HF <-> Megatron-core weights and config for Qwen2 / Llama (``trainer.backend: megatron``
groundwork). The layout code needs no megatron-core and is always tested; building a
real GPTModel on CPU (names and shapes checked against it) needs megatron-core and is
skipped where it is not installed (CI: it is in the ``[gpu]`` extra only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_runtime.models.causal_lm import export_state_dict
from gpu_runtime.models.model_folder import save_model_folder
from gpu_runtime.trainer.megatron import config as mconfig
from gpu_runtime.trainer.megatron.convert import Shape, fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv
from tests.engine_fixtures import REPO, tiny_model
from tests.megatron_fixtures import HFAsGPT


@pytest.mark.parametrize("arch,tie", [("qwen2", True), ("qwen2", False), ("llama", True)])
def test_round_trip_is_bitwise(arch: str, tie: bool) -> None:
    model, _ = tiny_model(3, arch=arch, tie=tie)
    hf = export_state_dict(model)
    s = Shape.of(model.config)
    mg = hf_to_megatron(hf, s)
    assert ("output_layer.weight" in mg) == (not tie)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mg) == (arch == "qwen2")
    back = megatron_to_hf(mg, s)
    assert set(back) == set(hf)
    for k in hf:
        assert back[k].dtype == hf[k].dtype and torch.equal(back[k], hf[k]), k


def test_qkv_rows_are_grouped_per_query_group() -> None:
    """The plain reference: group g's rows are its query heads, its key head, its value head."""
    s = Shape(num_layers=1, hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=2, tied=True)
    q = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)  # 4 heads x 2 rows
    k = 1000 + torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8)  # 2 heads x 2 rows
    v = 2000 + torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8)
    expected = torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]])
    fused = fuse_qkv(q, k, v, s)
    assert torch.equal(fused, expected)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, s), (q, k, v)))
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], s)  # a bias [rows]: the same row order
    assert torch.equal(bias, expected[:, 0])


def test_fc1_is_gate_then_up_and_names_map() -> None:
    model, _ = tiny_model(4)
    hf = export_state_dict(model)
    mg = hf_to_megatron(hf, Shape.of(model.config))
    fc1 = mg["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]]))
    assert torch.equal(mg["decoder.layers.1.pre_mlp_layernorm.weight"], hf["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(mg["decoder.final_layernorm.weight"], hf["model.norm.weight"])
    assert torch.equal(mg["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"])


def test_unknown_and_missing_names_are_named() -> None:
    model, _ = tiny_model(4)
    hf = export_state_dict(model)
    s = Shape.of(model.config)
    with pytest.raises(ValueError, match="no Megatron place.*q_norm"):
        hf_to_megatron({**hf, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, s)
    del hf["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="no model.layers.1.mlp.down_proj.weight"):
        hf_to_megatron(hf, s)


def test_config_mapping() -> None:
    model, _ = tiny_model(5)
    c = model.config
    kw = mconfig.transformer_config_kwargs(c)
    assert (kw["num_layers"], kw["hidden_size"], kw["ffn_hidden_size"]) == (2, 64, 128)
    assert (kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"]) == (4, 2, 16)
    assert kw["normalization"] == "RMSNorm" and kw["gated_linear_unit"] and kw["add_qkv_bias"]
    assert kw["activation_func"] is torch.nn.functional.silu and not kw["add_bias_linear"]
    assert kw["layernorm_epsilon"] == c.rms_norm_eps
    g = mconfig.gpt_model_kwargs(c)
    assert g["vocab_size"] == c.vocab_size and g["share_embeddings_and_output_weights"] is True
    assert g["rotary_base"] == int(mconfig.rope_theta(c)) and g["position_embedding_type"] == "rope"
    llama, _ = tiny_model(5, arch="llama")
    assert mconfig.transformer_config_kwargs(llama.config)["add_qkv_bias"] is False


@pytest.mark.parametrize("field,value,needle", [
    ("model_type", "gemma", "model_type 'gemma'"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}, "rope_scaling"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("mlp_bias", True, "mlp_bias"),
])
def test_config_mapping_refuses_what_it_would_get_wrong(field: str, value: object, needle: str) -> None:
    model, _ = tiny_model(5)
    d = model.config.to_dict() | {field: value}
    with pytest.raises(ValueError, match=needle):
        mconfig.transformer_config_kwargs(d)


@pytest.mark.parametrize("arch,tie", [("qwen2", True), ("llama", False)])
def test_a_real_gpt_model_takes_the_weights_and_gives_them_back(arch: str, tie: bool, tmp_path: Path) -> None:
    """A megatron-core GPTModel (local spec, built on CPU in its own process: a world of
    one) accepts the converted weights strictly and exports them back bitwise."""
    model, tok = tiny_model(6, arch=arch, tie=tie)
    save_model_folder(model, tok, tmp_path / "m", weight_version=0)
    out = subprocess.run([sys.executable, "-m", "tests.scripts.megatron_round_trip", str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stderr[-3000:]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_megatron_grpo_loss_is_the_single_trainers(tmp_path: Path, temperature: float) -> None:
    """The loss plumbing of ``megatron.train`` (batches, advantages, per-token loss,
    aggregation, causal-only attention on right-padded batches, logits / the rollout
    temperature) against the plain reference, ``PolicyTrainer.train_step``, on CPU: the same
    loss, grad norm, entropy, logprob gap and updated weights from the same start. (The GPTModel forward itself needs CUDA: tests/integration/test_cuda_paths.py.)"""
    import copy

    from gpu_runtime.store.artifacts import Sample
    from gpu_runtime.trainer.megatron.train import grpo_step
    from gpu_runtime.trainer.policy.trainer import PolicyTrainer
    from spec.train import TrainSpec
    from spec.trainer import megatron_train_conflicts

    model, tok = tiny_model(7)
    save_model_folder(model, tok, tmp_path / "m", weight_version=0)
    hp = TrainSpec(lr=1e-3, micro_batch_size=3, loss_agg="seq_mean_token_mean")
    assert megatron_train_conflicts(hp) == []
    samples = [Sample(sample_id=f"s1-p{p}-g{g}", prompt_index=p, group_index=g, prompt_ids=[1, 5 + p, 6],
                      response_ids=[7, 8, 9 + g][: 1 + (g + p) % 3], logprobs=[-1.0] * (1 + (g + p) % 3),
                      weight_version=0, finish_reason="length") for p in range(2) for g in range(4)]
    rewards = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25]
    ref = PolicyTrainer.create(tmp_path / "m", hp, 0)
    start = copy.deepcopy(ref.model)
    want = ref.train_step(samples, rewards, 4, hp, temperature)
    gpt = HFAsGPT(start)
    opt = torch.optim.AdamW(start.parameters(), lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
                            foreach=False)
    got = grpo_step(gpt, opt, samples, rewards, 4, hp, tok.pad_token_id, temperature)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    for mine, theirs in (("loss", "loss"), ("entropy", "entropy"), ("gap_max", "rollout_logprob_abs_diff_max")):
        assert got[mine] == pytest.approx(want[theirs], rel=1e-5, abs=1e-7), mine
    for (name, a), b in zip(start.state_dict().items(), ref.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    with pytest.raises(ValueError, match="kl_coef > 0"):
        grpo_step(gpt, opt, samples, rewards, 4, hp.model_copy(update={"kl_coef": 0.1}), tok.pad_token_id)
