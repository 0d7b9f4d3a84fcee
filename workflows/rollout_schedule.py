"""Which batches an RL step samples ahead, and whether a buffered batch may be trained.

``rollout.mode`` sets how many batches the run keeps sampled ahead (the buffer's depth):
sync 0, one_step_off 1, fully_async ``rollout.max_staleness`` (K). Step n trains the
oldest buffered batch (or samples its own when the buffer is empty: step 1, a fork, a
resume), then, during its train_step and on the weights the engines serve (v(n-1)),
samples the batches of steps n+len(rest)+1 .. n+depth (never past the run's last step).

A batch for step m sampled during step g was generated on v(g-1) and trains from
v(m-1): its staleness is m-g. Step 1 fills the buffer (g = 1 for m <= K+1), later steps
top it up by one (g = m-K), so the staleness is at most K, and exactly K once the
buffer is full. Every decision is a function of step numbers, the depth and the
batches recorded in the step's input, never of timing: a retried, re-placed or
replayed step makes the same schedule (docs/rollout-modes.md).
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from temporalio.exceptions import ApplicationError

    from spec.run import RunConfig
    from workflows.contracts.sampling import Sampled
    from workflows.contracts.step import RLStepInput
    from workflows.failures import Failure, failure


def buffer_depth(cfg: RunConfig) -> int:
    """Batches kept sampled ahead: the most policy versions a trained batch may lag."""
    if cfg.mode != "rl":
        return 0
    return {"sync": 0, "one_step_off": 1, "fully_async": cfg.rollout.max_staleness}[cfg.rollout.mode]


def buffered(inp: RLStepInput) -> list[Sampled]:
    """The step's input buffer, oldest first."""
    return list(inp.buffer)


def steps_ahead(step: int, last_step: int, left: int, depth: int) -> list[int]:
    """The steps whose batches step ``step`` samples during its train_step, given ``left``
    batches (steps step+1 .. step+left) still buffered after it took its own."""
    return list(range(step + left + 1, min(step + depth, last_step) + 1))


def check_batch(batch: Sampled, inp: RLStepInput, depth: int) -> ApplicationError | None:
    """Why step ``inp.step`` must not train ``batch`` (None: it may): the batch must start
    at the run's committed data cursor (each prompt trained once, in order) and lag the
    trained weights by at most ``depth`` versions."""
    stale = inp.policy_version - batch.policy_version
    if batch.data_cursor != inp.data_cursor:
        return failure(
            Failure.INVALID_INPUT,
            f"step {inp.step}: the oldest buffered batch drew its prompts at cursor {batch.data_cursor}, the run's "
            f"committed cursor is {inp.data_cursor}: training it would skip or repeat prompts",
        )
    if not 0 <= stale <= depth:
        return failure(
            Failure.INVALID_INPUT,
            f"step {inp.step}: the oldest buffered batch was generated on v{batch.policy_version}, the step trains "
            f"from v{inp.policy_version}: staleness {stale} is outside 0..{depth} (rollout.max_staleness)",
        )
    return None
