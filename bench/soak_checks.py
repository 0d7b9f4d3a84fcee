"""What a soak (``bench.soak``) asserts about a finished run, read from the run's store and
its progress: every prompt trained exactly once (by sample id), the DP cells whole and equal.

Each check returns a list of failures (empty: it holds), so the soak reports every broken
invariant at once instead of the first.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from gpu_runtime.data.datasets import prompts_for_step
from gpu_runtime.store import artifacts as art
from spec.trainer_rpc import StepBatch
from workflows.run_state import RunProgress


def trained_exactly_once(store: Path, run_id: str, cfg: dict, p: RunProgress) -> list[str]:
    """Every committed step's stored train batch (``StepBatch`` -> ``RolloutChunk`` samples)
    holds that step's own samples, no sample id appears in two steps, and the data positions
    the steps cover are ``0 .. final data cursor`` once each, in order (each step's prompts are
    the dataset indices at its positions, ``group_size`` samples each)."""
    out: list[str] = []
    n_rows, seed = cfg["data"]["num_train"], cfg["seed"]
    group = cfg["rollout"]["group_size"]
    run_dir = store / "runs" / run_id / "steps"
    stored = sorted(int(d.name) for d in run_dir.iterdir() if (d / "step_batch.json").exists())
    committed = [s.step for s in p.steps]
    if committed != list(range(1, p.total_steps + 1)):
        out.append(f"committed steps {committed}, expected 1..{p.total_steps} once each")
    if stored != committed:
        out.append(f"stored train batches for steps {stored}, committed steps {committed}")
    seen: dict[str, int] = {}  # sample id -> the step that trained it
    cursor = 0
    for s in p.steps:
        if s.data_cursor < cursor:
            out.append(f"step {s.step}: data cursor went back {cursor} -> {s.data_cursor}")
            continue
        batch = StepBatch.model_validate_json((store / art.step_batch_key(run_id, s.step)).read_text())
        if batch.step != s.step:
            out.append(f"step {s.step}: its stored batch says step {batch.step}")
        samples: list[art.Sample] = []
        for key in batch.chunk_keys:
            if not key.startswith(art.step_prefix(run_id, s.step) + "/"):
                out.append(f"step {s.step}: trained chunk {key} of another step")
            chunk = art.RolloutChunk.model_validate_json((store / key).read_text())
            if chunk.step != s.step:
                out.append(f"step {s.step}: chunk {key} is step {chunk.step}'s")
            samples += chunk.samples
        for x in samples:
            if x.sample_id != f"s{s.step}-p{x.prompt_index}-g{x.group_index}":
                out.append(f"step {s.step}: sample {x.sample_id} is not this step's "
                           f"(prompt {x.prompt_index}, group {x.group_index})")
            if x.sample_id in seen:
                out.append(f"sample {x.sample_id} trained in step {seen[x.sample_id]} and step {s.step}")
            seen[x.sample_id] = s.step
        rewards = json.loads((store / batch.rewards_key).read_text())["rewards"]
        if [r["sample_id"] for r in rewards] != [x.sample_id for x in samples]:
            out.append(f"step {s.step}: rewards are not the trained samples'")
        expected = prompts_for_step(n_rows, seed, cursor, s.data_cursor - cursor)
        if Counter(x.prompt_index for x in samples) != Counter(i for i in expected for _ in range(group)):
            out.append(f"step {s.step}: trained prompts {sorted({x.prompt_index for x in samples})}, "
                       f"positions {cursor}..{s.data_cursor - 1} are prompts {sorted(expected)}")
        times = Counter(expected)  # a prompt twice in a step only across an epoch boundary
        for i in times:
            got = sorted(x.group_index for x in samples if x.prompt_index == i)
            if got != sorted(list(range(group)) * times[i]):
                out.append(f"step {s.step}: prompt {i} has groups {got}, expected 0..{group - 1} x{times[i]}")
        cursor = s.data_cursor
    if cursor != p.data_cursor:
        out.append(f"the steps cover positions 0..{cursor - 1}, the run's data cursor is {p.data_cursor}")
    return out


def cells_whole(p: RunProgress) -> list[str]:
    """At the end every DP cell is alive, none is waiting for a restart, and all hold the
    same state (checksum of weights + AdamW + schedule + version) at the final version."""
    if p.dp is None:
        return ["the run reports no DP cells"]
    out = []
    states = [(c.index, c.state) for c in p.dp.cells]
    if any(state != "alive" for _, state in states):
        out.append(f"DP cells at the end: {states}")
    if p.cell_heal:
        out.append(f"cells still waiting for a restart: {sorted(p.cell_heal)}")
    if len({(c.policy_version, c.state_checksum) for c in p.dp.cells}) != 1:
        out.append("DP cells differ at the end: "
                   + ", ".join(f"cell {c.index} v{c.policy_version} {c.state_checksum[:12]}" for c in p.dp.cells))
    elif p.dp.cells[0].policy_version != p.policy_version:
        out.append(f"DP cells at v{p.dp.cells[0].policy_version}, the run at v{p.policy_version}")
    return out
