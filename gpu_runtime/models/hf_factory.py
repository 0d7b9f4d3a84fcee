"""Real Hugging Face model folders made locally: a byte-level BPE tokenizer
trained on given texts and a random-init ``transformers`` Qwen2 / Llama model.

``train_bpe_tokenizer`` makes the tokenizer, ``build_hf_model`` the model,
``save_hf_folder`` writes both, ``init_model_folder`` does the last two in one
call. Nothing is downloaded. A folder written by ``init_model_folder`` loads with
``AutoModelForCausalLM.from_pretrained(folder)`` and
``AutoTokenizer.from_pretrained(folder)`` and is bitwise reproducible: the same
texts and vocab size give a byte-identical ``tokenizer.json``, the same seed
gives identical weights.

The tokenizer follows Qwen2's conventions: byte-level BPE, every digit its own
token (so ``"123"`` is ``1``, ``2``, ``3``; no multi-digit number tokens),
``<|endoftext|>`` as EOS and PAD, ``<|im_start|>`` / ``<|im_end|>`` for a
ChatML chat template. Unlike Qwen2 it has a BOS, ``<|startoftext|>``, that
``tokenizer(text)`` prepends (``add_special_tokens=False`` leaves it out; the
chat template writes it itself, as Llama 3's does). A randomly initialised model
trained from scratch on short prompts learns worse without one: on 2-digit
addition (bench/plain_grpo.py, same init per seed, 300 SFT steps) held-out
accuracy was 21/75/68 % on seeds 0/1/2 with this BOS, 13/9/33 % with none and
20/9/22 % with ``<|endoftext|>`` as BOS. ``add_bos=False`` gives Qwen2's behaviour.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast,
    Qwen2Config,
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
STARTOFTEXT = "<|startoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, STARTOFTEXT)  # ids 0-3, also when BOS is off
N_BYTES = 256  # the byte-level alphabet every tokenizer starts from

# ChatML, as Qwen2 uses it (without Qwen's default system message), after the BOS if any.
CHATML_TEMPLATE = (
    "{%- if bos_token %}{{- bos_token }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

Arch = Literal["qwen2", "llama"]


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # Digits first: each digit becomes its own pre-token, so BPE can never merge
    # digits. add_prefix_space would prepend a space to every such piece: off.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    add_bos: bool = True,
    min_frequency: int = 2,
    model_max_length: int = 2048,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``texts`` with at most ``vocab_size`` entries
    (fewer when the texts offer no more merges seen ``min_frequency`` times).
    Ids 0-3 are the special tokens, then the 256 byte symbols, then merges.
    Decoding an encoding gives back the exact text (any Unicode). With
    ``add_bos`` the tokenizer's bos_token is ``<|startoftext|>`` and encoding
    with special tokens prepends it; without, it has no bos_token."""
    minimum = len(SPECIAL_TOKENS) + N_BYTES
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum} (4 special tokens + 256 bytes), got {vocab_size}")
    if min_frequency < 0:
        raise ValueError(f"min_frequency must be >= 0, got {min_frequency}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # add_bos_token=True makes transformers 5 write a TemplateProcessing post-processor
    # ("<|startoftext|> $A") into tokenizer.json, which 4.x applies as it is.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=STARTOFTEXT if add_bos else None,
        add_bos_token=add_bos,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> None:
    """``save_pretrained`` in a form transformers 4.x (e.g. SGLang's) and 5.x both
    load: the chat template inside tokenizer_config.json, ``tokenizer_class``
    ``PreTrainedTokenizerFast`` (5.x writes ``TokenizersBackend``, unknown to 4.x)
    and the extra special tokens under 4.x's key ``additional_special_tokens``
    (4.x reads a list under 5.x's ``extra_special_tokens`` as an error).
    Tokenize a rendered chat with ``add_special_tokens=False``: the template
    already starts with the BOS."""
    folder = Path(folder)
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if "extra_special_tokens" in cfg:
        cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens")
    for transient in ("is_local", "local_files_only"):  # load-time flags of a reloaded tokenizer
        cfg.pop(transient, None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _config(
    arch: Arch, tokenizer: PreTrainedTokenizerFast, *, tie_word_embeddings: bool, **shape: Any
) -> Qwen2Config | LlamaConfig:
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    if arch == "qwen2":
        return Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=tie_word_embeddings, use_sliding_window=False,
                           **ids, **shape)
    if arch == "llama":
        return LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=tie_word_embeddings, **ids, **shape)
    raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")


def build_hf_model(
    *,
    arch: Arch,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    max_position_embeddings: int,
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    initializer_range: float = 0.02,
) -> PreTrainedModel:
    """A random-init float32 ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` from
    transformers' own config and init, seeded (same seed: identical weights;
    the caller's torch RNG is left as it was). The vocab size is
    ``len(tokenizer)``; eos/pad/bos ids come from the tokenizer (bos None for
    a tokenizer without BOS) into the config and the generation config."""
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("tokenizer must have an eos_token and a pad_token")
    for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                    ("num_hidden_layers", num_hidden_layers), ("num_attention_heads", num_attention_heads),
                    ("num_key_value_heads", num_key_value_heads), ("max_position_embeddings", max_position_embeddings)):
        if v <= 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_attention_heads {num_attention_heads}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads {num_attention_heads} must be divisible by num_key_value_heads {num_key_value_heads}")
    config = _config(
        arch, tokenizer, tie_word_embeddings=tie_word_embeddings, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    return model


def save_hf_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """``save_pretrained`` (safetensors) of model and tokenizer into ``out_dir``
    (new or empty), config.json also carrying the top-level ``rope_theta`` that
    transformers 4.x reads (5.x reads ``rope_parameters`` and accepts both)."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"out_dir {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    path = out / "config.json"
    saved = json.loads(path.read_text())
    saved["rope_theta"] = saved["rope_parameters"]["rope_theta"]
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tokenizer, out)
    return out


def init_model_folder(out_dir: str | Path, **model_args: Any) -> Path:
    """``build_hf_model(**model_args)`` (arch, shape, tokenizer, seed, ...) saved with
    its tokenizer into ``out_dir`` (new or empty): config.json,
    generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
    Returns the folder, which ``AutoModelForCausalLM.from_pretrained`` /
    ``AutoTokenizer.from_pretrained`` load offline."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"out_dir {out} exists and is not empty")
    return save_hf_folder(build_hf_model(**model_args), model_args["tokenizer"], out)
