"""The command line of the micro-benchmarks measured on one model shape
(``bench_release_memory``, ``bench_weight_sync``): the shape, the repeats and the device as
flags, the result printed as JSON and, with ``--out``, written there too."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch


def run_shape_bench(doc: str, measure: Callable[..., dict], *, hidden: int, intermediate: int, layers: int,
                    heads: int, kv_heads: int, repeats: int) -> None:
    """Parse the flags (the defaults given here), measure on one CPU thread, print the JSON."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--intermediate", type=int, default=intermediate)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--kv-heads", type=int, default=kv_heads)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    torch.set_num_threads(1)
    res = measure(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, intermediate=a.intermediate,
                  repeats=a.repeats, device=a.device)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
