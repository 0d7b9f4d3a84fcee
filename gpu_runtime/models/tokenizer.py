"""The model's own tokenizer (a Hugging Face fast tokenizer from the model folder),
behind the few calls the engine, rollout, trainer and rewards make.

Prompts are encoded without added special tokens (a BOS is prepended only when
asked for and the tokenizer has one); ``messages`` go through the folder's chat
template. EOS ends a response; PAD fills batches.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gpu_runtime.models.hf_factory import save_tokenizer


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase) -> None:
        if hf.eos_token_id is None:
            raise ValueError("tokenizer has no eos_token: set one in tokenizer_config.json")
        self.hf = hf

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise FileNotFoundError(f"{folder}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
        return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        return int(self.hf.pad_token_id if self.hf.pad_token_id is not None else self.hf.eos_token_id)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.hf.bos_token_id is None else int(self.hf.bos_token_id)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(self.hf.encode(text, add_special_tokens=False))
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def encode_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template (``tools``: OpenAI function
        schemas, rendered where the template puts them)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat_template: messages prompts need one")
        # tokenize=True: the ids, or a BatchEncoding holding them (transformers' return type covers every mode)
        schemas: list[dict | Callable[..., Any]] | None = list(tools) if tools else None
        out: Any = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, tools=schemas)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        text = self.hf.decode(ids, skip_special_tokens=skip_special)
        assert isinstance(text, str)  # one sequence's ids give one string
        return text

    def save(self, folder: str | Path) -> None:
        save_tokenizer(self.hf, folder)
