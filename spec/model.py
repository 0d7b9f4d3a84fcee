"""The model sections of the run config: the model to train (``model``: a folder or a
new one, optionally with LoRA adapters) and the teacher of on-policy distillation
(``distill``). Torch-free; part of the workflow input (``spec.run``) and of the trainer's
``RunSetup`` (``spec.trainer_rpc``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from spec.strict import Strict

# the linear layers of the architectures model.init builds (Qwen2 and Llama name them alike)
INIT_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelInitSpec(Strict):
    """A new model written as a v0 Hugging Face folder before the run trains it: a
    byte-level BPE tokenizer trained on the run's dataset text, and a random-init
    ``transformers`` model seeded by the run's seed."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(256, ge=8)
    num_hidden_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    max_position_embeddings: int = Field(256, ge=16)
    vocab_size: int = Field(512, ge=259, description="BPE vocabulary (3 special tokens + 256 bytes + merges)")
    tie_word_embeddings: bool = True

    @model_validator(mode="after")
    def _heads(self) -> ModelInitSpec:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class LoraSpec(Strict):
    """LoRA adapters (peft) on the model's linear layers: only the adapters train, sit in the
    optimizer and are checkpointed; every published version holds the merged weights (what
    the engines load), and ``export: adapter`` adds the peft adapter folder."""

    r: int = Field(8, ge=1, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is B @ A * alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (seeded, checkpointed RNG)")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="all-linear: every linear layer but the LM head; or module names (a name matches every "
        "module whose dotted path ends with it, e.g. q_proj)",
    )
    export: Literal["merged", "adapter"] = Field(
        "merged",
        description="merged: each version is a plain model folder; adapter: also its peft adapter folder "
        "(<version>/adapter, pointing at the base model)",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError("give at least one module name, or all-linear")
        if any(not name or name != name.strip() for name in v):
            raise ValueError(f"module names must be non-empty without spaces, got {v}")
        if len(set(v)) != len(v):
            raise ValueError(f"module names must be unique, got {v}")
        if any(name.split(".")[-1] in ("lm_head", "embed_tokens") for name in v):
            raise ValueError("LoRA on lm_head / embed_tokens is not supported (it would untie tied embeddings)")
        return v


class ModelSpec(Strict):
    """The model to train: ``path`` to a Hugging Face folder (config.json, safetensors,
    tokenizer files; any causal LM ``transformers`` implements), or ``init`` to build
    a new one. Neither given: ``init`` with its defaults. ``lora``: train adapters only."""

    path: str | None = Field(None, description="local folder readable by every node")
    init: ModelInitSpec | None = None
    lora: LoraSpec | None = Field(None, description="LoRA adapters (unset: full fine-tuning)")

    @model_validator(mode="before")
    @classmethod
    def _flat_init(cls, v: Any) -> Any:
        """``model: {hidden_size: ..}`` is shorthand for ``model: {init: {hidden_size: ..}}``."""
        if isinstance(v, dict) and set(v) & set(ModelInitSpec.model_fields) and "init" not in v:
            flat = {k: x for k, x in v.items() if k in ModelInitSpec.model_fields}
            return {**{k: x for k, x in v.items() if k not in flat}, "init": flat}
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.path is not None and self.init is not None:
            raise ValueError("give model.path or model.init, not both")
        if self.path is None and self.init is None:
            self.init = ModelInitSpec()
        if self.init is not None and self.lora is not None and isinstance(self.lora.target_modules, list):
            unknown = [n for n in self.lora.target_modules if n.split(".")[-1] not in INIT_LINEAR_MODULES]
            if unknown:
                raise ValueError(
                    f"lora.target_modules {unknown} name no linear layer of a model.init {self.init.arch} model "
                    f"({', '.join(INIT_LINEAR_MODULES)})"
                )
        return self


class DistillSpec(Strict):
    """On-policy distillation: the trainer scores the student's own samples with a teacher
    model and adds ``coef * (teacher logprob - student logprob)`` to each response token's
    advantage (a per-token reverse-KL reward, docs/algorithms.md)."""

    teacher_path: str = Field(
        min_length=1, description="the teacher's Hugging Face folder (same tokenizer as the student), on every node"
    )
    coef: float = Field(1.0, gt=0, description="weight of the per-token reverse-KL advantage")
