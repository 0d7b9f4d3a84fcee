"""``data.kind: reasoning_gym``: rows from a `reasoning-gym <https://github.com/open-thought/reasoning-gym>`_
procedural generator, made offline when the run's data is prepared, and the generator's own
scorer (``reward.kind: reasoning_gym``, and the held-out eval of such rows).

Each generated entry (``question``, ``answer``, ``metadata``) becomes a normalized row:
``prompt`` = the question, ``answer`` = the answer, ``id`` = ``rg-<dataset>-<index>``, and the
whole entry under ``metadata["reasoning_gym"]`` so the scorer gets exactly what it made.
The rows are a pure function of (dataset, config, size, seed): ``reasoning_gym`` seeds each
entry from the dataset seed and its index. The package is imported only here, lazily.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gpu_runtime.store.artifacts import derive_seed

META_KEY = "reasoning_gym"
MISSING = ("data.kind reasoning_gym needs the reasoning-gym package (pip install 'milestone[reasoning-gym]', "
           "or reasoning-gym==0.1.25)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _rg() -> Any:
    try:
        import reasoning_gym
    except ImportError as err:
        raise ValueError(MISSING) from err
    return reasoning_gym


def available() -> bool:
    try:
        _rg()
    except ValueError:
        return False
    return True


def _dataset(name: str, config: dict[str, Any], size: int, seed: int) -> Any:
    rg = _rg()
    try:
        return rg.create_dataset(name, size=size, seed=seed % (1 << 31), **config)
    except Exception as err:  # an unknown name, a bad config key or value
        raise ValueError(f"data.dataset {name!r} with data.dataset_config {config}: {type(err).__name__}: {err}") from None


def _row(name: str, index: int, entry: dict) -> dict:
    try:
        stored = json.loads(json.dumps(entry))
    except (TypeError, ValueError) as err:
        raise ValueError(f"data.dataset {name!r}: entry {index} is not JSON ({err}); this generator is not supported") from None
    return {"id": f"rg-{name}-{index}", "prompt": str(entry["question"]), "messages": None,
            "answer": str(entry["answer"]), "metadata": {META_KEY: {"dataset": name, "entry": stored}}}


def generate_rows(name: str, config: dict[str, Any], size: int, seed: int) -> list[dict]:
    """``size`` rows of generator ``name`` (a ValueError naming ``data.dataset`` when it cannot)."""
    ds = _dataset(name, config, size, seed)
    return [_row(name, i, ds[i]) for i in range(size)]


def generate_heldout(name: str, config: dict[str, Any], n: int, seed: int, exclude: set[str]) -> list[dict]:
    """Up to ``n`` rows from the same generator under a seed derived from ``seed``, whose
    prompts are not in ``exclude`` (the train set) nor repeated; ids ``rg-<name>-eval-<i>``."""
    ds = _dataset(name, config, 4 * n, derive_seed("rg-eval", seed))
    out: list[dict] = []
    seen = set(exclude)
    for i in range(4 * n):
        row = _row(name, i, ds[i])
        if row["prompt"] in seen:
            continue
        seen.add(row["prompt"])
        out.append({**row, "id": f"rg-{name}-eval-{i}"})
        if len(out) == n:
            break
    return out


def is_gym_row(row: dict) -> bool:
    return isinstance(row.get("metadata"), dict) and META_KEY in row["metadata"]


def extract(response: str) -> str:
    """What the scorer sees of a response: the last ``<answer>...</answer>`` when there is one,
    else the whole response, stripped."""
    found = _ANSWER_TAG.findall(response)
    return (found[-1] if found else response).strip()


def score(response: str, row: dict) -> float:
    """The row's generator's own ``score_answer`` on the response (0.0 .. 1.0)."""
    if not is_gym_row(row):
        raise ValueError(f"row {row.get('id')!r} was not made by data.kind reasoning_gym (no metadata.{META_KEY})")
    meta = row["metadata"][META_KEY]
    fn = _rg().get_score_answer_fn(meta["dataset"])
    return float(fn(answer=extract(response), entry=meta["entry"]))
