"""What one version export costs the trainer: written over a pruned version's file, against a fresh file.

The trainer exports every policy version as a model folder its engines load
(``gpu_runtime.models.model_folder.write_model_folder``). This times, version after
version, pruned to the newest two as ``TrainerService`` prunes:

- ``fresh``: the export as it was before spares: ``weights_checksum``, then
  ``safetensors.save_file`` into a new file (fresh page cache for every version);
- ``in place``: the project's export: the new version written over a pruned version's file
  (``Spares``), hashed on a second thread while it is written.

Both write the same model's tensors, changed a little before each version (as a train
step changes them), and the exported folders are checked to hold the same checksum.
Usage::

    .venv/bin/python -m bench.bench_export [--shape 0.36b|demo] [--versions 8] [--dir PATH]

``--dir``: where the folders go (default: a temporary folder beside the node's work dirs,
``.milestone/bench-export``: the disk the version folders use). Versions 1..2 of each side
have no spare yet (warm-up: excluded from the mean).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from bench.gpu_check import FULL_SHAPE  # noqa: E402
from gpu_runtime.models.causal_lm import exported_tensors  # noqa: E402
from gpu_runtime.models.hf_factory import train_bpe_tokenizer  # noqa: E402
from gpu_runtime.models.model_folder import (  # noqa: E402
    META_FILE,
    WEIGHTS_FILE,
    prune_version_folders,
    weights_checksum,
    write_model_folder,
)
from gpu_runtime.models.tokenizer import Tokenizer  # noqa: E402

SHAPES = {"0.36b": FULL_SHAPE,
          "demo": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2}}


def fresh_export(folder: Path, weights: dict[str, torch.Tensor], version: int) -> str:
    """The export before spares: hash, then a new safetensors file, then the folder renamed in."""
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True)
    checksum = weights_checksum(weights)
    save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / META_FILE).write_text(json.dumps({"weight_version": version, "checksum": checksum}))
    tmp.rename(folder)
    for old in folder.parent.glob("v*"):  # the newest two, as before: deleted
        if old.name < f"v{version - 1:06d}":
            shutil.rmtree(old)
    return checksum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.36b", choices=sorted(SHAPES))
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--dir", default=".milestone/bench-export")
    a = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    cfg = Qwen2Config(vocab_size=2048, **SHAPES[a.shape])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    weights = {k: v.contiguous() for k, v in exported_tensors(model).items()}
    gb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
    tok = Tokenizer(train_bpe_tokenizer(["1+2=3", "hello world", "the answer is 42"], 300))  # the folder carries one
    times: dict[str, list[float]] = {"fresh": [], "in place": []}
    sums: dict[str, list[str]] = {"fresh": [], "in place": []}
    for v in range(1, a.versions + 1):
        with torch.no_grad():
            for t in weights.values():
                t.add_(1e-3)  # a train step's change
        for side in times:  # the two sides take turns: the machine's drift falls on both
            folder = root / side.replace(" ", "-") / f"v{v:06d}"
            t0 = time.perf_counter()
            if side == "fresh":
                sums[side].append(fresh_export(folder, weights, v))
            else:
                sums[side].append(write_model_folder(cfg, None, tok, folder, weight_version=v, weights=weights))
                prune_version_folders(folder.parent, v)
            times[side].append(time.perf_counter() - t0)
        print(f"v{v}: fresh {times['fresh'][-1]:.2f}s  in place {times['in place'][-1]:.2f}s", flush=True)
    assert sums["fresh"] == sums["in place"], "the two exports hashed to different checksums"
    fresh, in_place = statistics.fmean(times["fresh"][2:]), statistics.fmean(times["in place"][2:])
    print(f"\n{a.shape}: {gb:.2f} GB per version, mean of versions 3..{a.versions}")
    print(f"{'export':<10} {'fresh':>8} {'in place':>9} {'ratio':>7}")
    print(f"{'seconds':<10} {fresh:>8.2f} {in_place:>9.2f} {in_place / fresh:>6.2f}x")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
