"""How ``milestone`` prints a run: its progress line, its cells, its newest eval."""

from __future__ import annotations

from datetime import datetime, UTC

from spec.status import CellState
from workflows.run_state import RunProgress


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(1, total))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def format_progress(p: RunProgress) -> str:
    last = p.steps[-1] if p.steps else None
    line = f"{p.run_id} {_bar(p.step, p.total_steps)} step {p.step}/{p.total_steps} v{p.policy_version} {p.state}"
    if last and p.mode == "sft":  # no rollout, no reward: the labels' loss is the number to watch
        line += f" | sft loss {last.loss:.4f} | {last.step_seconds:.1f}s/step"
    elif last:
        line += (
            f" | reward {last.reward_mean:.3f} acc {last.accuracy:.2f} loss {last.loss:+.4f}"
            f" | {last.step_seconds:.1f}s/step"
        )
        if last.sampling:
            d = last.sampling
            line += f" | kept {d.groups_kept}/{d.groups_generated} groups in {d.rounds} round{'s' * (d.rounds > 1)}"
        if last.reward_errors:
            line += f" | {last.reward_errors} reward errors"
        stale = last.staleness
        if stale or last.overlap_seconds or last.buffer_depth:  # one_step_off / fully_async: batches sampled ahead
            line += (f" | samples v{last.rollout_version} (staleness {stale}), {last.buffer_depth} ahead,"
                     f" {last.overlap_seconds:.1f}s overlapped")
        if last.dp_cells is not None and p.dp is not None:  # trainer.cells: how many cells committed the step
            line += f" | {last.dp_cells}/{len(p.dp.cells)} DP cells"
    return line


def format_nodes(p: RunProgress) -> list[str]:
    """Which node holds what: the trainer's node, and each rollout node with its engines (engines.nodes > 0)."""
    if not p.rollout_nodes:
        return []
    lines = [f"  trainer node {p.node_queue or '?'}"]
    for n in p.rollout_nodes:
        mine = [e for e in p.engines if e.node == n.node_id]
        served = sorted({e.weight_version for e in mine if e.weight_version is not None})
        lines.append(f"  rollout node {n.node_id} ({n.task_queue}): {len(mine)} engines"
                     + (f" serving v{', v'.join(map(str, served))}" if served else ""))
    return lines


def format_cells(p: RunProgress) -> list[str]:
    """One line per fsdp2 cell and per rank (pid, Ray node, state), as the trainer last reported them."""
    lines = []
    for cell in p.cells:
        lines.append(f"  cell {cell.generation} on {cell.node or '?'}: {len(cell.ranks)} ranks, {cell.placement}, "
                     f"ray {cell.ray_address}")
        lines += [f"    rank {r.rank}: pid {r.pid} node {r.node_ip} {r.state}" for r in cell.ranks]
    if p.dp is not None:
        alive = sum(c.state == CellState.ALIVE for c in p.dp.cells)
        lines.append(f"  DP cells on {p.dp.node or '?'}: {alive}/{len(p.dp.cells)} alive, torchft lighthouse pid "
                     f"{p.dp.lighthouse_pid}" + (f" (restarted {p.dp.lighthouse_restarts}x)" if p.dp.lighthouse_restarts else ""))
        for c in p.dp.cells:
            line = f"    cell {c.index}: pid {c.pid} {c.state} v{c.policy_version}"
            if c.healed_from_step is not None:
                line += f", healed from a peer (held v{c.healed_from_step})"
            if c.restarts:
                line += f", restarted {c.restarts}x"
            heal = p.cell_heal.get(str(c.index))
            if c.state == CellState.LOST:
                line += f": {c.why}"
            if heal is not None:
                line += (f"; restart due {datetime.fromtimestamp(heal.due_at, UTC).isoformat(timespec='seconds')}"
                         f" (failed restarts: {heal.failures})")
            lines.append(line)
    return lines


def format_gap(p: RunProgress) -> str | None:
    """The last RL step's train-inference logprob gap (None before the first, and in mode sft)."""
    if not p.steps or p.mode == "sft":
        return None
    s = p.steps[-1]
    return (f"  logprob gap engine vs trainer (step {s.step}): mean {s.rollout_logprob_abs_diff:.2e}, "
            f"max {s.rollout_logprob_abs_diff_max:.2e}")


def format_eval(p: RunProgress) -> str | None:
    """The newest held-out eval of the run, or None before the first."""
    s = next((s for s in reversed(p.steps) if s.eval_greedy is not None), None)
    if s is None:
        return None
    return (
        f"  eval after step {s.step} (v{s.policy_version}, {s.eval_n} held-out prompts): "
        f"greedy {s.eval_greedy:.3f}, pass@{s.eval_k} {s.eval_pass_at_k:.3f}"
    )


__all__ = ["format_cells", "format_eval", "format_gap", "format_progress"]
