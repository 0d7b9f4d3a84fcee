"""A character-level tokenizer built locally (no hub download).

Saved as ``milestone_tokenizer.json`` plus a Hugging Face ``tokenizer.json``
(WordLevel over single characters) so a model folder is self-contained.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
DEFAULT_CHARS = string.digits + "+-*/=()., ?:#\n" + string.ascii_letters + "'$%"
FILE_NAME = "milestone_tokenizer.json"


class CharTokenizer:
    def __init__(self, chars: str = DEFAULT_CHARS) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("tokenizer chars must be unique")
        self.specials = [PAD, BOS, EOS]
        self.chars = chars
        self.itos: list[str] = self.specials + list(chars)
        self.stoi = {s: i for i, s in enumerate(self.itos)}

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    @property
    def pad_token_id(self) -> int:
        return self.stoi[PAD]

    @property
    def bos_token_id(self) -> int:
        return self.stoi[BOS]

    @property
    def eos_token_id(self) -> int:
        return self.stoi[EOS]

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        unknown = sorted({c for c in text if c not in self.stoi})
        if unknown:
            raise ValueError(f"characters not in tokenizer vocabulary: {unknown!r}")
        ids = [self.stoi[c] for c in text]
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        out = []
        for i in ids:
            if i < 0 or i >= len(self.itos):
                raise ValueError(f"token id {i} out of range")
            s = self.itos[i]
            if skip_special and s in self.specials:
                continue
            out.append(s)
        return "".join(out)

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / FILE_NAME).write_text(json.dumps({"type": "char", "chars": self.chars}))
        (folder / "tokenizer.json").write_text(json.dumps(self._hf_tokenizer_json()))
        (folder / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": BOS,
                    "eos_token": EOS,
                    "pad_token": PAD,
                    "model_max_length": 4096,
                }
            )
        )

    @classmethod
    def load(cls, folder: str | Path) -> "CharTokenizer":
        path = Path(folder) / FILE_NAME
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer at {path}")
        data = json.loads(path.read_text())
        if data.get("type") != "char":
            raise ValueError(f"{path}: unsupported tokenizer type {data.get('type')!r}")
        return cls(data["chars"])

    def _hf_tokenizer_json(self) -> dict:
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {"id": self.stoi[s], "content": s, "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": True}
                for s in self.specials
            ],
            "normalizer": None,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": False},
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": dict(self.stoi), "unk_token": PAD},
        }
