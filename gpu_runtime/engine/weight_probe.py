"""Spot-check an engine's weights by sampled parameters (``/get_weights_by_name``).

For engines that cannot hash their whole state (SGLang): read the first rows of a
few parameters and compare them with the model folder the engine was told to load.
SGLang returns ``param[:truncate_size]`` (first rows, as float32 of what it serves,
possibly bf16), so the comparison flattens both and allows a relative tolerance.

Which names SGLang answers (read in sglang 0.5.23, ``python/sglang/srt/models``): only the
model classes that define ``get_weights_by_name``. ``LlamaForCausalLM`` (and
``MistralForCausalLM``, its subclass) takes Hugging Face names and maps them itself:
``q_proj`` / ``k_proj`` / ``v_proj`` to its slice of the fused ``qkv_proj``, ``gate_proj`` /
``up_proj`` to theirs of ``gate_up_proj``; ``embed_tokens``, ``norm`` and ``down_proj`` are
read as they are. ``Qwen2ForCausalLM`` has no such method (the model runner's
"TODO: Add support for Qwen models"): every read fails, so a Qwen2 model on SGLang has no
weight check and is refused (``unverifiable_reason``) rather than served unchecked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from safetensors import safe_open

TRUNCATE_ROWS = 2


# architectures (config.json ``architectures``) whose SGLang model class answers /get_weights_by_name
SGLANG_READABLE = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})


def unverifiable_reason(folder: str | Path) -> str | None:
    """Why SGLang engines serving the model at ``folder`` could not be weight-checked, or None."""
    archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    if any(a in SGLANG_READABLE for a in archs):
        return None
    return (f"SGLang cannot read back the parameters of {'/'.join(archs) or 'this model'} (/get_weights_by_name "
            f"serves only {', '.join(sorted(SGLANG_READABLE))} in sglang 0.5.23), so a weight push to its engines "
            "could not be verified; use a Llama-architecture model with engines.backend sglang, or the torch engine")


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
        names = probe_names(list(f.keys()))
        if not names:  # nothing to compare would pass every engine
            raise ValueError(f"{folder}: none of the probed parameters is in model.safetensors")
        return {n: f.get_tensor(n)[:rows].flatten().tolist() for n in names}


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
