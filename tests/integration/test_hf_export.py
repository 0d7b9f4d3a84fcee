"""The model folder every policy version is published as is a real Hugging Face
``save_pretrained`` folder: transformers loads it (Qwen2 and Llama) with identical
logits, and its tokenizer gives the same ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from gpu_runtime.models.causal_lm import lm_logits, positions_from_mask
from gpu_runtime.models.model_folder import save_model_folder
from tests.engine_fixtures import tiny_model


@pytest.mark.parametrize("arch,cls", [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")])
@pytest.mark.parametrize("tie", [True, False])
def test_exported_folder_loads_in_transformers(tmp_path: Path, arch: str, cls: str, tie: bool) -> None:
    model, tok = tiny_model(seed=3, arch=arch, tie=tie)
    with torch.no_grad():
        for p in model.parameters():  # weights a trainer changed, not the init
            p.add_(0.01 * torch.randn_like(p))
    save_model_folder(model, tok, tmp_path / "hf", weight_version=7)

    ids = torch.tensor([tok.encode("12+34="), tok.encode("99+1=5")])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        ours = lm_logits(model, ids, mask, positions_from_mask(mask))
    # with the attention kernel we run (eager) the logits are identical ...
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), local_files_only=True, attn_implementation="eager"
    )
    assert type(hf).__name__ == cls
    with torch.no_grad():
        torch.testing.assert_close(ours, hf(ids).logits, rtol=0, atol=0)
    # ... and transformers' default kernel (SDPA) agrees to float32 rounding
    default = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    with torch.no_grad():
        torch.testing.assert_close(ours, default(ids).logits, rtol=0, atol=1e-4)

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert hf_tok("What is 12+34?", add_special_tokens=False)["input_ids"] == tok.encode("What is 12+34?")
    assert hf_tok.eos_token_id == tok.eos_token_id
