"""Spot-check an engine's weights by sampled parameters (``/get_weights_by_name``).

For engines that cannot hash their whole state (SGLang): read the first rows of a
few parameters and compare them with the model folder the engine was told to load.
SGLang returns ``param[:truncate_size]`` (first rows, possibly bf16), so the
comparison flattens both and allows a relative tolerance.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from safetensors import safe_open

TRUNCATE_ROWS = 2


def probe_names(names: list[str]) -> list[str]:
    """A fixed sample: the embedding, the first and last layer's projections, the final norm."""
    wanted = ["model.embed_tokens.weight", "model.norm.weight"]
    layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
    if layers:
        wanted += [f"model.layers.{layers[0]}.self_attn.q_proj.weight", f"model.layers.{layers[-1]}.mlp.down_proj.weight"]
    return [n for n in wanted if n in names]


def expected_probe(folder: str | Path, rows: int = TRUNCATE_ROWS) -> dict[str, list[float]]:
    """The sampled values as the model folder holds them."""
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        return {n: f.get_tensor(n)[:rows].flatten().tolist() for n in probe_names(names)}


def _flatten(value: Any) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)]
    out: list[float] = []
    for v in value:
        out.extend(_flatten(v))
    return out


def mismatched(expected: dict[str, list[float]], got: dict[str, Any], rel_tol: float = 1e-2) -> list[str]:
    """Names whose engine values differ from the folder's (bf16-sized tolerance)."""
    bad = []
    for name, want in expected.items():
        have = _flatten(got.get(name, []))
        if len(have) != len(want) or not all(
            math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-3) for a, b in zip(have, want)
        ):
            bad.append(name)
    return bad
