"""The run's base model folder: the user's Hugging Face folder (``model.path``), or
one built from ``model.init`` (a BPE tokenizer trained on the dataset's text and a
seeded random-init model). Built the same, byte for byte, on every node."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

from gpu_runtime.data.datasets import prompt_messages, prompt_text, sft_target
from gpu_runtime.models.hf_factory import init_model_folder, train_bpe_tokenizer
from gpu_runtime.store.artifacts import derive_seed
from spec.model import ModelSpec

log = logging.getLogger(__name__)
DONE = ".complete"


def tokenizer_texts(rows: list[dict]) -> list[str]:
    """What the tokenizer of a new model is trained on: each row's prompt (or its
    messages' contents) and its SFT target."""
    out = []
    for r in rows:
        messages = prompt_messages(r)
        prompt = "\n".join(m["content"] for m in messages) if messages is not None else prompt_text(r)
        out.append(prompt + sft_target(r))
    return out


def base_model_folder(source: ModelSpec, rows: list[dict], seed: int, work_dir: Path) -> Path:
    """The folder the trainer starts from (version 0 before SFT)."""
    if source.path is not None:
        folder = Path(source.path).expanduser()
        if not (folder / "config.json").exists():
            raise ValueError(f"model.path: {folder} is not a Hugging Face model folder (no config.json)")
        return folder
    init = source.init
    assert init is not None
    digest = hashlib.sha256(
        "\n".join([init.model_dump_json(), str(seed), *tokenizer_texts(rows)]).encode()
    ).hexdigest()[:16]
    folder = work_dir / f"base-{digest}"
    if (folder / DONE).exists():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = train_bpe_tokenizer(tokenizer_texts(rows), init.vocab_size)
    init_model_folder(
        tmp, arch=init.arch, hidden_size=init.hidden_size, intermediate_size=init.intermediate_size,
        num_hidden_layers=init.num_hidden_layers, num_attention_heads=init.num_attention_heads,
        num_key_value_heads=init.num_key_value_heads, max_position_embeddings=init.max_position_embeddings,
        tokenizer=tokenizer, seed=derive_seed("model-init", seed) % (1 << 63),
        tie_word_embeddings=init.tie_word_embeddings,
    )
    (tmp / DONE).write_text(digest)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    log.info("built base model %s (%s, vocab %d)", folder, init.arch, len(tokenizer))
    return folder
