"""The SHA-256 of ``tokenizer.json`` as a fresh process trains it from the test's texts:
``tests/unit/test_hf_factory.py::test_tokenizer_is_deterministic_across_processes`` compares
it with its own (a fresh hash seed is where an unordered merge tie would show).
``python -m tests.scripts.tokenizer_sha``; prints the digest."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path


def main() -> None:
    from gpu_runtime.models.hf_factory import save_tokenizer, train_bpe_tokenizer
    from tests.unit.test_hf_factory import TEXTS

    with tempfile.TemporaryDirectory() as d:
        save_tokenizer(train_bpe_tokenizer(TEXTS, vocab_size=300), Path(d))
        print(hashlib.sha256((Path(d) / "tokenizer.json").read_bytes()).hexdigest())


if __name__ == "__main__":
    main()
