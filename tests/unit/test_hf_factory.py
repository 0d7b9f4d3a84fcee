"""Local Hugging Face model folders: the BPE tokenizer (deterministic, digits
split, exact round trip, ChatML template, EOS/PAD) and random-init Qwen2 / Llama
folders that load back offline with identical logits."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from gpu_runtime.data.datasets import generate_arithmetic
from gpu_runtime.models.hf_factory import (
    CHATML_TEMPLATE, build_hf_model, init_model_folder, save_tokenizer, train_bpe_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [r["prompt"] + "\n" + r["answer"] for r in generate_arithmetic(300, seed=0, ops="+-*")] + [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello, world! hello world; HELLO World",
]
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tok() -> transformers.PreTrainedTokenizerFast:
    return train_bpe_tokenizer(TEXTS, vocab_size=300)


def _tokenizer_json_sha(tokenizer: transformers.PreTrainedTokenizerFast, folder: Path) -> str:
    save_tokenizer(tokenizer, folder)
    return hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()


def test_tokenizer_is_deterministic_across_processes(tok, tmp_path: Path) -> None:
    here = _tokenizer_json_sha(tok, tmp_path / "a")
    again = _tokenizer_json_sha(train_bpe_tokenizer(TEXTS, vocab_size=300), tmp_path / "b")
    # a fresh process has a fresh hash seed: that is where an unordered merge tie would show
    child = subprocess.run([sys.executable, "-m", "tests.scripts.tokenizer_sha"], capture_output=True, text=True,
                           check=True, timeout=120, cwd=ROOT).stdout.split()[-1]
    assert here == again == child
    other = _tokenizer_json_sha(train_bpe_tokenizer(TEXTS, vocab_size=280), tmp_path / "c")
    assert other != here


def test_vocab_layout_and_too_small_vocab(tok) -> None:
    assert 260 < len(tok) <= 300
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|startoftext|>"]
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        train_bpe_tokenizer(TEXTS, vocab_size=259)


def test_digits_are_single_tokens(tok) -> None:
    for token in tok.get_vocab():
        if any(c.isdigit() for c in token):
            assert len(token) == 1, f"vocab entry {token!r} mixes a digit with something else"
    assert tok.tokenize("12345+678=") == ["1", "2", "3", "4", "5", "+", "6", "7", "8", "="]
    ids = tok("What is 23+45?")["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[-6:] == ["2", "3", "+", "4", "5", "?"]


def test_round_trip_is_exact_for_arbitrary_text(tok) -> None:
    rng = random.Random(0)
    alphabet = "ab Z09 \t\n\r  +-=?#'\"\\ü日本語🙂\u00a0\u200b\x00\x7f"
    texts = [
        " leading space", "trailing space ", "two  spaces\n\n\nnewlines", "ünïcödé 日本語 🙂", "a1b22c333 4 55",
        "  What is 12+34?\n#### 46  ", "e\u0301 (decomposed) vs \u00e9", "",
    ] + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(200)]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text, repr(text)
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_eos_pad_and_bos(tok) -> None:
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id == 0
    assert tok.bos_token == "<|startoftext|>" and tok.bos_token_id == 3
    chars = tok.convert_tokens_to_ids(list("23+45="))
    assert tok("23+45=")["input_ids"] == [3, *chars]  # BOS prepended, nothing appended
    assert tok("23+45=", add_special_tokens=False)["input_ids"] == chars
    assert tok.decode([3, *chars, 0], skip_special_tokens=True) == "23+45="


def test_without_bos() -> None:
    tok = train_bpe_tokenizer(TEXTS, vocab_size=300, add_bos=False)
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok("23+45=")["input_ids"] == tok.convert_tokens_to_ids(list("23+45="))
    assert tok.convert_ids_to_tokens([3]) == ["<|startoftext|>"]  # same ids either way, unused here
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n")


def test_chat_template(tok) -> None:
    messages = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == ("<|startoftext|><|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                    "<|im_start|>assistant\n5<|im_end|>\n")
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|startoftext|><|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids == tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [3, 1] and ids.count(3) == 1  # one BOS, from the template
    assert ids.count(1) == 2 and ids.count(2) == 1  # the markers are single special tokens
    assert tok.chat_template == CHATML_TEMPLATE


def _build(arch: str, tok, seed: int, **kw) -> transformers.PreTrainedModel:
    return build_hf_model(arch=arch, tokenizer=tok, seed=seed, **SHAPE, **kw)


@pytest.mark.parametrize("arch,cls", [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_model_folder_round_trip(arch: str, cls: str, tok, tmp_path: Path) -> None:
    folder = init_model_folder(tmp_path / arch, arch=arch, tokenizer=tok, seed=5, **SHAPE)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    loaded_tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert type(model).__name__ == cls
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tok) == len(loaded_tok)
    assert (model.config.eos_token_id, model.config.pad_token_id, model.config.bos_token_id) == (0, 0, 3)
    gen = model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (0, 0, 3)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied by default
    assert loaded_tok.chat_template == CHATML_TEMPLATE
    assert loaded_tok.extra_special_tokens == ["<|im_start|>", "<|im_end|>"]
    text = "What is 23+45?\n#### 68"
    assert loaded_tok(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded_tok(text)["input_ids"][0] == loaded_tok.bos_token_id == 3

    raw = json.loads((folder / "config.json").read_text())  # what transformers 4.x (SGLang) reads
    assert raw["rope_theta"] == 10000.0 and raw["dtype"] == "float32"
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tcfg["additional_special_tokens"] == ["<|im_start|>", "<|im_end|>"]

    ids = torch.tensor([tok("12+34=46")["input_ids"], tok("98*76=54")["input_ids"]])  # 8 tokens each
    with torch.no_grad():
        fresh = _build(arch, tok, seed=5).eval()(ids).logits
        assert torch.equal(model.eval()(ids).logits, fresh)


def test_seed_determinism_and_rng_untouched(tok) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = (_build("qwen2", tok, seed=s).state_dict() for s in (7, 7, 8))
    assert torch.equal(torch.get_rng_state(), before)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])


def test_untied_llama_without_bos_and_shape_errors(tok, tmp_path: Path) -> None:
    no_bos = train_bpe_tokenizer(TEXTS, vocab_size=300, add_bos=False)
    folder = init_model_folder(tmp_path / "untied", arch="llama", tokenizer=no_bos, seed=0, tie_word_embeddings=False,
                               **SHAPE)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.config.bos_token_id is None and model.generation_config.bos_token_id is None
    loaded = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert loaded.bos_token_id is None and loaded("12")["input_ids"] == no_bos("12")["input_ids"]
    with pytest.raises(FileExistsError):
        init_model_folder(folder, arch="llama", tokenizer=tok, seed=0, **SHAPE)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        build_hf_model(arch="qwen2", tokenizer=tok, seed=0, **{**SHAPE, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="arch"):
        _build("gpt2", tok, 0)
