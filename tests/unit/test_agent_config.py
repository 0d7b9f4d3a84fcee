"""``rollout.agent``: validated at config load with errors naming the field; the calculator
task's rows and demonstrations; the episode metrics and their pooling over rounds."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from gpu_runtime.data.datasets import load_jsonl, write_jsonl
from gpu_runtime.data.rows import final_answer, sft_target
from gpu_runtime.data.tool_arithmetic import generate_tool_arithmetic
from gpu_runtime.rollout.agent.metrics import episode_metrics
from gpu_runtime.store.artifacts import EpisodeInfo, Sample
from milestone_cli.preflight import PreflightError, check_agent
from spec.run import RunConfig
from spec.strict import format_validation_error
from workflows.agent_metrics import pool_agent_metrics

OK = {"data": {"kind": "tool_arithmetic"}, "rollout": {"agent": {}}, "eval": {"enabled": False}}


def errors(cfg: dict) -> str:
    with pytest.raises(ValidationError) as e:
        RunConfig.model_validate(cfg)
    return format_validation_error(e.value)


def test_defaults_and_a_valid_section() -> None:
    agent = RunConfig.model_validate(OK).rollout.agent
    assert agent is not None and agent.tools == ["calculator"] and agent.max_turns == 4
    assert RunConfig().rollout.agent is None  # single-turn unless asked for


@pytest.mark.parametrize("patch,message", [
    ({"rollout": {"agent": {"tools": ["calculator", "calculator"]}}}, "rollout.agent.tools: tools must be unique"),
    ({"rollout": {"agent": {"tools": ["shell"]}}}, "rollout.agent.tools: unknown tool 'shell'"),
    ({"rollout": {"agent": {"tools": []}}}, "give at least one tool, or an environment"),
    ({"rollout": {"agent": {"environment": "not a path"}}}, "rollout.agent.environment: environment 'not a path'"),
    ({"rollout": {"agent": {"max_turns": 0}}}, "rollout.agent.max_turns"),
    ({"rollout": {"agent": {"max_tokens_per_turn": 64, "max_episode_tokens": 32}}}, "exceeds max_episode_tokens"),
    ({"rollout": {"agent": {"on_tool_error": "retry"}}}, "on_tool_error must be continue or stop"),
    ({"rollout": {"agent": {"tool": ["calculator"]}}}, "rollout.agent.tool: unknown key"),
    ({"eval": {"enabled": True}}, "eval: enabled: the held-out eval samples one response per prompt"),
    ({"rollout": {}}, "rollout: data.kind tool_arithmetic is a calculator task: set rollout.agent"),
])
def test_bad_sections_name_the_field(patch: dict, message: str) -> None:
    assert message in errors(OK | patch)


def test_agent_needs_mode_rl() -> None:
    cfg = {"mode": "sft", "sft": {"steps": 0}, "rollout": {"agent": {}}, "eval": {"enabled": False}}
    assert "rollout: agent applies to mode rl" in errors(cfg)


def test_preflight_imports_custom_tools() -> None:
    cfg = RunConfig.model_validate(OK | {"rollout": {"agent": {"tools": ["calculator", "tests.agent_tools:make_upper"]}}})
    check_agent(cfg)
    bad = RunConfig.model_validate(OK | {"rollout": {"agent": {"tools": ["tests.agent_tools:nope"]}}})
    with pytest.raises(PreflightError, match="rollout.agent.tools: cannot import 'tests.agent_tools:nope'"):
        check_agent(bad)
    env = RunConfig.model_validate(OK | {"rollout": {"agent": {"environment": "tests.agent_tools:missing_env"}}})
    with pytest.raises(PreflightError, match="rollout.agent.environment: cannot import"):
        check_agent(env)


def test_tool_arithmetic_rows(tmp_path) -> None:
    rows = generate_tool_arithmetic(20, 5, 99_999_999, "*", min_operand=1_000_000)
    assert rows == generate_tool_arithmetic(20, 5, 99_999_999, "*", min_operand=1_000_000)
    write_jsonl(rows, tmp_path / "d.jsonl")
    assert load_jsonl(tmp_path / "d.jsonl") == rows  # valid normalized rows
    r = rows[0]
    a, b = r["messages"][1]["content"].removeprefix("What is ").removesuffix("?").split("*")
    assert 1_000_000 <= int(a) <= 99_999_999 and final_answer(r) == str(int(a) * int(b))
    assert sft_target(r) == (f"<calculator>{a}*{b}</calculator><|im_end|>\n<|im_start|>tool\n{int(a) * int(b)}"
                             f"<|im_end|>\n<|im_start|>assistant\n{int(a) * int(b)}")


def _sample(outcome: str, turns: int, calls: int, errors_: int, mask: list[int], rewards: list) -> Sample:
    return Sample(sample_id="s", prompt_index=0, group_index=0, prompt_ids=[1], response_ids=list(range(len(mask))),
                  logprobs=[0.0] * len(mask), weight_version=0, finish_reason="stop", loss_mask=mask,
                  episode=EpisodeInfo(outcome=outcome, turns=turns, tool_calls=calls, tool_errors=errors_,
                                      turn_rewards=rewards))


def test_episode_metrics_by_hand() -> None:
    m = episode_metrics([
        _sample("completed", 2, 1, 0, [1, 1, 0, 0, 1], [1.0, None]),
        _sample("truncated", 3, 2, 1, [1, 0, 1, 0, 1, 1, 1], [0.0, 0.5, None]),
    ])
    assert m == {
        "episodes": 2.0, "turns_mean": 2.5, "tool_calls": 3.0, "tool_errors": 1.0, "tool_calls_mean": 1.5,
        "calls_per_turn_max": 0.0,
        "episode_tokens_mean": 6.0, "model_tokens_mean": 4.0, "truncation_rate": 0.5,
        "outcome_completed": 0.5, "outcome_truncated": 0.5, "outcome_tool_error": 0.0, "outcome_timeout": 0.0,
        "turn_reward_mean": 0.5,
    }
    assert episode_metrics([]) == {}


def test_pooling_rounds_sums_counts_and_weights_means() -> None:
    pooled = pool_agent_metrics([{"episodes": 2.0, "tool_calls": 3.0, "turns_mean": 1.0, "calls_per_turn_max": 3.0},
                                 {"episodes": 6.0, "tool_calls": 1.0, "turns_mean": 3.0, "calls_per_turn_max": 1.0}])
    assert pooled == {"episodes": 8.0, "tool_calls": 4.0, "turns_mean": 2.5, "calls_per_turn_max": 3.0}
    assert pool_agent_metrics([]) is None


def test_the_example_config_passes_preflight() -> None:
    from pathlib import Path

    from milestone_cli.preflight import check_config

    cfg = check_config(Path(__file__).resolve().parents[2] / "examples" / "agent_calculator.yaml")
    assert cfg.data.kind == "tool_arithmetic" and cfg.rollout.agent is not None


def test_the_openai_example_passes_preflight_and_a_bad_entrypoint_is_named() -> None:
    from pathlib import Path

    from milestone_cli.preflight import check_config

    cfg = check_config(Path(__file__).resolve().parents[2] / "examples" / "agent_openai.yaml")
    assert cfg.rollout.agent is not None and cfg.rollout.agent.kind == "openai"
    for entry, message in [("tests.agent_programs:nope", "cannot import"),
                           ("tests.agent_tools:make_upper", "must take (base_url, api_key, row)")]:
        bad = RunConfig.model_validate(OK | {"rollout": {"agent": {"kind": "openai", "entrypoint": entry}}})
        with pytest.raises(PreflightError, match=rf"rollout.agent.entrypoint: .*{re.escape(message)}"):
            check_agent(bad)


@pytest.mark.parametrize(("agent", "message"), [
    ({"kind": "openai"}, "kind openai needs entrypoint"),
    ({"kind": "chat"}, "kind must be one of tools, environment, openai"),
    ({"entrypoint": "a.b:run"}, "entrypoint is for kind openai"),
    ({"kind": "openai", "entrypoint": "a.b:run", "on_agent_error": "retry"}, "on_agent_error must be zero or score"),
    ({"kind": "openai", "entrypoint": "not a path"}, "entrypoint 'not a path' must be a dotted path"),
])
def test_openai_kind_config_errors_name_the_field(agent: dict, message: str) -> None:
    assert message in errors(OK | {"rollout": {"agent": agent}})
