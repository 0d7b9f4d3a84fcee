"""The model folder every policy version is published as is a real Hugging Face
``save_pretrained`` folder: transformers loads it as Qwen2ForCausalLM with the same
logits, and its tokenizer.json gives the same ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.models.causal_lm import ModelConfig, build_model, positions_from_mask
from gpu_runtime.models.model_folder import save_model_folder
from gpu_runtime.models.tokenizer import CharTokenizer

transformers = pytest.importorskip("transformers")


def test_exported_folder_loads_in_transformers(tmp_path: Path) -> None:
    tok = CharTokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = build_model(cfg, seed=3)
    save_model_folder(model, tok, tmp_path / "hf", weight_version=7)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    ids = torch.tensor([tok.encode("12+34=", add_bos=True), tok.encode("99+1=5", add_bos=True)])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        ours = model(ids, mask, positions_from_mask(mask))
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    assert hf_tok("What is 12+34?")["input_ids"] == tok.encode("What is 12+34?")
