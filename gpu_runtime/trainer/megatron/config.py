"""An HF ``config.json`` (Qwen2 / Llama) as Megatron-core's ``TransformerConfig`` and
``GPTModel`` arguments, for the local (no Transformer Engine) layer spec.

``transformer_config_kwargs`` and ``gpt_model_kwargs`` are plain dicts (tested without
megatron-core); ``transformer_config`` builds the dataclass, importing megatron-core
then. Settings Megatron's local spec would silently compute differently (rope scaling,
sliding windows, q/k norms, non-SiLU activations, attention or MLP biases other than
Qwen2's qkv bias) are refused with the config field named.
"""

from __future__ import annotations

from typing import Any

import torch

SUPPORTED = ("qwen2", "llama")
# fusions that need CUDA kernels or Apex/TE; off so the model is the plain PyTorch one
_UNFUSED = dict(bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)


def _get(c: Any, name: str, default: Any = None) -> Any:
    return c.get(name, default) if isinstance(c, dict) else getattr(c, name, default)


def check_supported(c: Any) -> None:
    mt = _get(c, "model_type")
    if mt not in SUPPORTED:
        raise ValueError(f"config.json model_type {mt!r}: trainer.backend megatron supports {list(SUPPORTED)}")
    act = _get(c, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act {act!r}: only silu (gated) is mapped")
    # transformers 5 reports plain RoPE as rope_parameters (aliased rope_scaling) of type "default"
    for rope in (_get(c, "rope_scaling"), _get(c, "rope_parameters")):
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError("config.json rope_scaling: scaled RoPE is not mapped to Megatron")
    if _get(c, "use_sliding_window", False):
        raise ValueError("config.json use_sliding_window: sliding-window attention is not mapped")
    if _get(c, "attention_bias", False) and mt == "llama":
        raise ValueError("config.json attention_bias: Llama with attention biases is not mapped")
    if _get(c, "mlp_bias", False):
        raise ValueError("config.json mlp_bias: MLP biases are not mapped")


def rope_theta(c: Any) -> float:
    params = _get(c, "rope_parameters") or {}
    return float(params["rope_theta"] if isinstance(params, dict) and "rope_theta" in params
                 else _get(c, "rope_theta", 10000.0))


def transformer_config_kwargs(c: Any, *, params_dtype: torch.dtype = torch.float32, bf16: bool = False) -> dict[str, Any]:
    """``TransformerConfig(**kwargs)`` for HF config ``c`` (an object or the config.json dict)."""
    check_supported(c)
    heads = int(_get(c, "num_attention_heads"))
    hidden = int(_get(c, "hidden_size"))
    return dict(
        num_layers=int(_get(c, "num_hidden_layers")),
        hidden_size=hidden,
        ffn_hidden_size=int(_get(c, "intermediate_size")),
        num_attention_heads=heads,
        num_query_groups=int(_get(c, "num_key_value_heads") or heads),
        kv_channels=int(_get(c, "head_dim") or hidden // heads),
        normalization="RMSNorm",
        layernorm_epsilon=float(_get(c, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=_get(c, "model_type") == "qwen2",
        hidden_dropout=0.0,
        attention_dropout=float(_get(c, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(_get(c, "initializer_range", 0.02)),
        params_dtype=params_dtype,
        bf16=bf16,
        attention_softmax_in_fp32=True,
        **_UNFUSED,
    )


def gpt_model_kwargs(c: Any) -> dict[str, Any]:
    """``GPTModel(config, spec, **kwargs)`` besides the config and the layer spec."""
    check_supported(c)
    return dict(
        vocab_size=int(_get(c, "vocab_size")),
        max_sequence_length=int(_get(c, "max_position_embeddings")),
        share_embeddings_and_output_weights=bool(_get(c, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=int(rope_theta(c)),
        pre_process=True,
        post_process=True,
    )


def transformer_config(c: Any, **kw: Any) -> Any:
    """The ``megatron.core`` TransformerConfig (imports megatron-core: the ``[gpu]`` extra)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**transformer_config_kwargs(c, **kw))
