"""Hugging Face <-> Megatron-core state dicts for the Qwen2 / Llama family (local spec).

Megatron's layer (``get_gpt_layer_local_spec``) differs from HF's in three layouts:

- attention: one ``linear_qkv`` whose rows are grouped by query group (GQA): for each
  of the ``num_key_value_heads`` groups, its ``heads // groups`` query heads, then its
  key head, then its value head (each ``head_dim`` rows); the bias (Qwen2) likewise;
- gated MLP: one ``linear_fc1`` = ``[gate_proj; up_proj]`` stacked on rows;
- names: ``post_attention_layernorm`` is ``pre_mlp_layernorm``, ``model.norm`` is
  ``decoder.final_layernorm``; with tied embeddings there is no ``output_layer.weight``
  (HF's ``lm_head.weight`` is the embedding; an export leaves it out).

Pure tensor reshapes and concatenations: a round trip is bitwise, needs no
megatron-core, and works on any device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def of(cls, hf_config: Any) -> Shape:
        """From a Hugging Face model config (any architecture's ``PretrainedConfig``)."""
        c = hf_config
        heads = int(c.num_attention_heads)
        kv = int(getattr(c, "num_key_value_heads", None) or heads)
        hidden = int(c.hidden_size)
        head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
        if heads % kv:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
        return cls(int(c.num_hidden_layers), hidden, heads, kv, head_dim,
                   bool(getattr(c, "tie_word_embeddings", False)))


# per-layer names, HF suffix -> Megatron suffix (one tensor each)
_PLAIN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP = {"model.embed_tokens.weight": "embedding.word_embeddings.weight", "model.norm.weight": "decoder.final_layernorm.weight"}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shape) -> torch.Tensor:
    """HF q [H*d, ...], k/v [G*d, ...] -> Megatron's grouped [G*(H/G+2)*d, ...] (weights or biases)."""
    g, per, d = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
    rest = q.shape[1:]
    qg = q.reshape(g, per * d, *rest)
    kg = k.reshape(g, d, *rest)
    vg = v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(g * (per + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, s: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, per, d = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
    rest = qkv.shape[1:]
    x = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(x, [per * d, d, d], dim=1)
    return (q.reshape(g * per * d, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(),
            v.reshape(g * d, *rest).contiguous())


class _Source:
    """A state dict read by name: a missing name is a ValueError naming it, and ``check_all_used``
    names what no read took (a weight the conversion has no place for)."""

    def __init__(self, sd: dict[str, torch.Tensor], what: str) -> None:
        self.sd, self.what, self.used = sd, what, set[str]()

    def __contains__(self, name: str) -> bool:
        return name in self.sd

    def take(self, name: str) -> torch.Tensor:
        if name not in self.sd:
            raise ValueError(f"{self.what} state dict has no {name}")
        self.used.add(name)
        return self.sd[name]

    def check_all_used(self, why: str) -> None:
        left = sorted(set(self.sd) - self.used)
        if left:
            raise ValueError(f"{self.what} weights with no {why}: {left[:5]}")


def hf_to_megatron(sd: dict[str, torch.Tensor], s: Shape) -> dict[str, torch.Tensor]:
    """An HF state dict (``export_state_dict`` naming; ``lm_head.weight`` optional when tied)
    -> Megatron GPTModel's. Unknown or missing names are a ValueError naming them."""
    src = _Source(sd, "HF")
    take = src.take
    out: dict[str, torch.Tensor] = {}
    for hf, mg in _TOP.items():
        out[mg] = take(hf)
    if s.tied:
        src.used.add("lm_head.weight")  # the embedding, if present at all
    else:
        out["output_layer.weight"] = take("lm_head.weight")
    for i in range(s.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf, mg in _PLAIN.items():
            out[m + mg] = take(p + hf)
        a = p + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight"), s)
        if a + "q_proj.bias" in src:  # Qwen2: qkv biases; Llama: none
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias"), s)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0)
    src.check_all_used("Megatron place (unsupported architecture?)")
    return out


def megatron_to_hf(sd: dict[str, torch.Tensor], s: Shape) -> dict[str, torch.Tensor]:
    """Megatron GPTModel's state dict (``_extra_state`` entries ignored) -> HF naming, with
    ``lm_head.weight`` left out when tied (what ``export_state_dict`` gives)."""
    src = _Source({k: v for k, v in sd.items() if not k.endswith("._extra_state")}, "Megatron")
    take = src.take
    out: dict[str, torch.Tensor] = {}
    for hf, mg in _TOP.items():
        out[hf] = take(mg)
    if not s.tied:
        out["lm_head.weight"] = take("output_layer.weight")
    for i in range(s.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf, mg in _PLAIN.items():
            out[p + hf] = take(m + mg)
        a = p + "self_attn."
        q, k, v = split_qkv(take(m + "self_attention.linear_qkv.weight"), s)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if m + "self_attention.linear_qkv.bias" in src:
            q, k, v = split_qkv(take(m + "self_attention.linear_qkv.bias"), s)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        gate, up = torch.chunk(take(m + "mlp.linear_fc1.weight"), 2, dim=0)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
    src.check_all_used("HF place")
    return out
