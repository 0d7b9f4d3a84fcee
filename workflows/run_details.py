"""What ``TrainingRun`` shows and refuses, as pure functions of its state: the Temporal UI's
details text of a run, and why a live ``set_hparams`` update is refused (None: accepted)."""

from __future__ import annotations

from pydantic import ValidationError

from spec.event_text import event_text
from spec.run import RunConfig
from spec.status import CellState
from spec.train import HParamUpdate, TrainSpec, mode_conflicts
from spec.trainer import megatron_train_conflicts
from spec.trainer_rpc import ForkPoint
from workflows.run_state import RunState


def run_details(status: str, st: RunState, total_steps: int | None, lineage: list[ForkPoint]) -> str:
    """The run's current details (markdown) for the Temporal UI: status, progress, the last
    step and eval, the node, the DP cells, the fork it came from and the last event."""
    last = st.history[-1] if st.history else None
    lines = [
        f"**{status}** — step {st.next_step - 1}/{total_steps if total_steps is not None else '?'}, "
        f"policy v{st.policy_version}, data cursor {st.data_cursor}",
    ]
    if last:
        lines.append(
            f"last step: reward {last.reward_mean:.3f} (acc {last.accuracy:.2f}), loss {last.loss:.4f}, "
            f"{last.step_seconds:.1f}s"
        )
    evaluated = st.last_evaluated()
    if evaluated:
        lines.append(
            f"held-out eval after step {evaluated.step}: greedy {evaluated.eval_greedy:.3f}, "
            f"pass@{evaluated.eval_k} {evaluated.eval_pass_at_k:.3f} ({evaluated.eval_n} prompts)"
        )
    if st.node:
        lines.append(f"node: `{st.node.task_queue}`" + (" (trainer)" if st.rollout_nodes else ""))
    if st.rollout_nodes:  # engines.nodes > 0: which node runs which engines
        per_node = {n.node_id: sum(e.node == n.node_id for e in st.engines) for n in st.rollout_nodes}
        lines.append("rollout nodes: " + ", ".join(f"`{n.task_queue}` ({per_node[n.node_id]} engines)"
                                                  for n in st.rollout_nodes))
    if st.dp is not None:  # trainer.cells > 1
        alive = sum(c.state == CellState.ALIVE for c in st.dp.cells)
        lost = ", ".join(f"cell {i} restarts after {h.failures} failed restart(s)" if h.failures else f"cell {i} lost"
                         for i, h in sorted(st.cell_heal.items()))
        lines.append(f"DP cells: {alive}/{len(st.dp.cells)} alive" + (f" ({lost})" if lost else ""))
    if lineage:
        lines.append(f"forked from `{lineage[-1].run_id}` at step {lineage[-1].step}")
    if st.events:
        ev = st.events[-1]
        lines.append(f"last event: {ev.at[:19]} {ev.kind}: {event_text(ev)}")
    return "\n\n".join(lines)


def hparam_update_refused(cfg: RunConfig | None, train: TrainSpec, update: HParamUpdate) -> str | None:
    """Why ``update`` cannot apply to a run of ``cfg`` (None: not started yet) training with
    ``train`` now (None: it can)."""
    if not update.given():
        return f"no field given (any of {', '.join(TrainSpec.model_fields)})"
    if update.kl_coef and cfg is not None and cfg.train.kl_coef == 0:
        return "kl_coef: the run started with kl_coef 0 and keeps no reference model"
    try:
        updated = update.apply(train)
    except ValidationError as err:
        return str(err)
    if cfg is None:
        return None
    if bad := mode_conflicts(cfg.mode, updated):
        return f"{', '.join(bad)}: RL loss knobs, unused in mode {cfg.mode}"
    if cfg.trainer.backend == "megatron" and (bad := megatron_train_conflicts(updated)):
        return f"trainer.backend megatron does not support {'; '.join(bad)}"
    return None
