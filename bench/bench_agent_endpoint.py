"""Seconds per RL step of an agent written with the ``openai`` SDK (``rollout.agent.kind: openai``,
examples/agents/react_calculator.py) against the same task run by the built-in tool loop
(``kind: tools``), side by side on one real stack.

Both runs: the calculator task (``data.kind: tool_arithmetic``), the same tiny model, SFT warm-up,
prompts, group size, token budgets and steps. The built-in loop generates each turn of a chunk's
episodes as one batch and runs the calculator in the node agent; the OpenAI kind starts one
child process per episode (an interpreter and the ``openai`` import), serves each call over
HTTP one request at a time per episode, and records each call before answering. Prints s/step
(mean of steps 2..N) and the rollout phase per kind, in alternating pairs, and the ratio
openai / tools per pair; and the mean wall time of an episode's agent process.

    .venv/bin/python -m bench.bench_agent_endpoint [--pairs 2] [--steps 4] [--prompts 4] [--group 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.e2e.faults import progress, run_to_end  # noqa: E402
from tests.stack import Stack, running_stack, tiny_config  # noqa: E402
from workers.common import connect  # noqa: E402

AGENTS = {
    "tools": {"kind": "tools", "tools": ["calculator"]},
    "openai": {"kind": "openai", "entrypoint": "examples.agents.react_calculator:run", "max_calls": 3},
}


def config(store: Path, kind: str, a: argparse.Namespace) -> dict:
    return tiny_config(
        store, steps=a.steps,
        data={"kind": "tool_arithmetic", "num_train": 200, "min_operand": 2, "max_operand": 9, "ops": "*"},
        sft={"steps": a.sft_steps, "batch_size": 32, "lr": 3e-3},
        rollout={"prompts_per_step": a.prompts, "group_size": a.group, "chunk_size": a.prompts * a.group // 2,
                 "agent": AGENTS[kind] | {"max_tokens_per_turn": 12, "max_episode_tokens": 40}},
        eval={"enabled": False}, checkpoint={"every": a.steps, "keep_last": 2},
    )


def one(stack: Stack, store: Path, kind: str, a: argparse.Namespace) -> dict[str, float]:
    async def main() -> dict[str, float]:
        client = await connect(stack.server.address)
        run_id = f"bench-{kind}-{uuid.uuid4().hex[:6]}"
        await run_to_end(client, run_id, config(store, kind, a), timeout_s=1800)
        steps = (await progress(client, run_id)).steps[1:]
        agent = [s.agent or {} for s in steps]
        return {
            "s_per_step": statistics.fmean(s.step_seconds for s in steps),
            "rollout_s": statistics.fmean(s.phase_seconds.get("rollout", 0.0) for s in steps),
            "tool_calls": statistics.fmean(m.get("tool_calls", 0.0) for m in agent),
            "agent_s": statistics.fmean(m.get("agent_seconds_mean", 0.0) for m in agent),
        }

    return asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp, running_stack(Path(tmp)) as stack:
        store = Path(tmp) / "store"
        ratios = []
        for pair in range(a.pairs):
            tools, openai = one(stack, store, "tools", a), one(stack, store, "openai", a)
            ratio = openai["s_per_step"] / tools["s_per_step"]
            ratios.append(ratio)
            print(f"pair {pair}: tools {tools['s_per_step']:.2f} s/step (rollout {tools['rollout_s']:.2f}, "
                  f"{tools['tool_calls']:.1f} calls) | openai {openai['s_per_step']:.2f} s/step (rollout "
                  f"{openai['rollout_s']:.2f}, {openai['tool_calls']:.1f} calls, agent process "
                  f"{openai['agent_s']:.2f} s/episode) | ratio {ratio:.2f}", flush=True)
        print(f"openai / tools s/step: mean {statistics.fmean(ratios):.2f} over {len(ratios)} pairs")


if __name__ == "__main__":
    main()
