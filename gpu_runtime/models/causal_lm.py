"""A small Qwen2-style causal LM built from a config (no hub download).

Parameter names follow Hugging Face's ``Qwen2ForCausalLM`` so a state dict can be
exported as a ``save_pretrained`` folder and loaded by SGLang / transformers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class ModelConfig:
    vocab_size: int = 64
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("model.hidden_size must be divisible by model.num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model.num_attention_heads must be divisible by model.num_key_value_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf_config(self, *, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "initializer_range")}
        d.update(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            hidden_act="silu",
            torch_dtype="float32",
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            use_sliding_window=False,
            attention_dropout=0.0,
        )
        return d


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B, T] int64 -> cos, sin of shape [B, 1, T, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # B,T,hd/2
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]


class KVCache:
    """Per-layer key/value tensors for batched incremental decoding."""

    def __init__(self, n_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]  # type: ignore[return-value]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=True)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        cfg = self.cfg
        hd = cfg.head_dim
        q = self.q_proj(x).view(b, t, cfg.num_attention_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.num_key_value_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.num_key_value_heads, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.append(layer, k, v)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, layer):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Qwen2-style decoder. ``forward`` takes a key-padding mask so left- or
    right-padded batches work; ``cache`` enables incremental decoding."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen2Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, p in sorted(self.named_parameters()):
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        # scale residual projections like GPT-2 for stable depth
        scale = 1.0 / math.sqrt(2 * self.config.num_hidden_layers)
        with torch.no_grad():
            for layer in self.model.layers:
                layer.self_attn.o_proj.weight.mul_(scale)
                layer.mlp.down_proj.weight.mul_(scale)

    def forward(
        self,
        input_ids: torch.Tensor,
        key_mask: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """input_ids: [B, T]; key_mask: [B, S] bool over all keys so far (S >= T,
        the last T are the new tokens); positions: [B, T]. Returns logits [B, T, V]."""
        b, t = input_ids.shape
        s = key_mask.shape[1]
        causal = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
        mask = causal[None, None] & key_mask[:, None, None, :]
        # a fully masked row (padding query) would give NaN: let it see itself
        eye = torch.zeros(t, s, dtype=torch.bool)
        eye[torch.arange(t), torch.arange(s - t, s)] = True
        mask = mask | eye[None, None]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, cache, i)
        return self.lm_head(self.model.norm(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def positions_from_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """Left- or right-padded mask [B, T] -> positions counting only real tokens."""
    return (key_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_model(cfg: ModelConfig, seed: int) -> CausalLM:
    model = CausalLM(cfg)
    model.init_weights(seed)
    return model


def state_dict_for_export(model: CausalLM) -> dict[str, torch.Tensor]:
    """Contiguous, untied copies of every tensor (safetensors refuses shared storage)."""
    sd = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def load_exported_state_dict(model: CausalLM, sd: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed_missing = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"weights do not match model: missing={missing} unexpected={unexpected}")
