"""Run configs: unknown or invalid keys are errors that name the key and its line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from milestone_cli.config_file import ConfigError, load_run_config
from spec.data import DataSpec
from spec.run import EvalSpec, RunConfig
from spec.strict import format_validation_error
from spec.train import HParamUpdate, TrainSpec

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_examples_are_valid() -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        cfg = load_run_config(path)
        if not cfg.store.startswith("s3://"):
            assert cfg.store.startswith("file:///"), "relative file:// stores are made absolute"


def test_unknown_key_names_key_and_line(tmp_path: Path) -> None:
    p = write(tmp_path, "name: x\nrollout:\n  group_size: 4\n  grup_size: 8\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(p)
    assert f"{p}:4: rollout.grup_size: unknown key" in str(err.value)


def test_invalid_value_names_field(tmp_path: Path) -> None:
    p = write(tmp_path, "steps: 3\ntrain:\n  lr: -1\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(p)
    assert f"{p}:3: train.lr:" in str(err.value)


def test_cross_field_validation() -> None:
    with pytest.raises(ValueError, match="function is required"):
        RunConfig.model_validate({"reward": {"kind": "custom"}})
    with pytest.raises(ValueError, match="divisible"):
        RunConfig.model_validate({"model": {"hidden_size": 100, "num_attention_heads": 3}})
    with pytest.raises(ValueError, match="store must start with"):
        RunConfig.model_validate({"store": "/tmp/x"})


def test_hparam_update_applies_only_given_fields() -> None:
    train = TrainSpec(lr=1e-4, clip_eps=0.2)
    new = HParamUpdate(lr=5e-5).apply(train)
    assert new.lr == 5e-5 and new.clip_eps == 0.2
    with pytest.raises(ValueError):
        HParamUpdate(lr=0)


def test_cli_start_rejects_bad_config_before_connecting(tmp_path: Path) -> None:
    p = write(tmp_path, "steps: 2\nsft:\n  stepz: 3\n")
    # no Temporal server is listening on this address: validation must fail first
    out = subprocess.run(
        [sys.executable, "-m", "milestone_cli.main", "--address", "127.0.0.1:1", "start", str(p)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert out.returncode == 2
    assert f"{p}:3: sft.stepz: unknown key" in out.stderr


def test_milestone_set_reads_typed_values_and_names_bad_keys() -> None:
    from milestone_cli.errors import CLIError
    from milestone_cli.main import parse_assignments

    update = parse_assignments(["lr=1e-5", "ppo_epochs=2", "betas=[0.9,0.95]", "scale_adv_by_std=false"])
    assert update.given() == {"lr": 1e-5, "ppo_epochs": 2, "betas": [0.9, 0.95], "scale_adv_by_std": False}
    new = update.apply(TrainSpec())
    assert (new.lr, new.ppo_epochs, new.betas, new.scale_adv_by_std, new.clip_eps) == (1e-5, 2, (0.9, 0.95), False, 0.2)
    with pytest.raises(CLIError, match=r"lrr: unknown key \(settable: lr, betas"):
        parse_assignments(["lrr=1"])
    with pytest.raises(CLIError, match="lr: Input should be greater than 0"):
        parse_assignments(["lr=-1"])
    with pytest.raises(CLIError, match="expected KEY=VALUE"):
        parse_assignments(["lr"])
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0, 1\)"):
        parse_assignments(["betas=[0.9,1.5]"]).apply(TrainSpec())


def test_milestone_set_null_turns_an_optional_knob_off() -> None:
    from milestone_cli.errors import CLIError
    from milestone_cli.main import parse_assignments

    update = parse_assignments(["tis_cap=null", "lr=2e-5"])
    assert update.given() == {"lr": 2e-5, "tis_cap": None}
    new = update.apply(TrainSpec(tis_cap=2.0, clip_eps_high=0.28))
    assert (new.tis_cap, new.lr, new.clip_eps_high) == (None, 2e-5, 0.28)  # the others keep their values
    with pytest.raises(CLIError, match="lr: only these train fields can be null: clip_eps_high"):
        parse_assignments(["lr=null"])


def test_every_trainer_knob_is_settable_from_yaml(tmp_path: Path) -> None:
    p = write(tmp_path, "train:\n  warmup_steps: 4\n  clip_eps_high: 0.28\n  micro_batch_size: 16\n"
                        "  scale_adv_by_std: false\n  betas: [0.9, 0.95]\n  eps: 1.0e-6\n")
    t = load_run_config(p).train
    assert (t.warmup_steps, t.clip_eps_high, t.micro_batch_size, t.scale_adv_by_std, t.betas, t.eps) == (
        4, 0.28, 16, False, (0.9, 0.95), 1e-6)
    p = write(tmp_path, "train:\n  betas: [0.9, 1.0]\n")
    with pytest.raises(ConfigError, match=r":2: train.betas: betas\[1\] must be in \[0, 1\)"):
        load_run_config(p)


def test_one_formatter_names_key_path_with_or_without_origin() -> None:
    with pytest.raises(ValidationError) as err:
        RunConfig.model_validate({"train": {"lr": -1}, "stepz": 1, "store": "/tmp/x"})
    text = format_validation_error(err.value)
    assert "train.lr: Input should be greater than 0" in text.splitlines()
    assert "stepz: unknown key" in text.splitlines()
    assert "store: store must start with file:// or s3://" in text.splitlines()  # no "Value error, "
    located = format_validation_error(err.value, lambda loc: f"run.yaml:{len(loc)}")
    assert "run.yaml:2: train.lr: Input should be greater than 0" in located.splitlines()


@pytest.mark.parametrize("fn", ["pkg.mod:fn", "pkg.mod.fn", "mod:fn", "a.b.c:_fn"])
def test_reward_function_shapes_accepted(fn: str) -> None:
    assert RunConfig.model_validate({"reward": {"kind": "custom", "function": fn}}).reward.function == fn


@pytest.mark.parametrize("fn", ["fn", "pkg.mod:a.b", "pkg..mod:fn", ":fn", "mod:", "pkg mod:fn", "1pkg:fn"])
def test_reward_function_shape_rejected(fn: str) -> None:
    with pytest.raises(ValidationError) as err:
        RunConfig.model_validate({"reward": {"kind": "custom", "function": fn}})
    assert format_validation_error(err.value).startswith(f"reward.function: {fn!r} must look like 'pkg.module:fn'")


def start_offline(tmp_path: Path, reward: dict) -> subprocess.CompletedProcess:
    """`milestone start` against an address where nothing listens: pre-flight must decide first."""
    p = write(tmp_path, f"steps: 2\nstore: file://{tmp_path}/store\nreward: {json.dumps(reward)}\n")
    return subprocess.run(
        [sys.executable, "-m", "milestone_cli.main", "--address", "127.0.0.1:1", "start", str(p)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )


@pytest.mark.parametrize(
    ("function", "needle"),
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("tests.reward_fns:missing", "has no callable 'missing'"),
        ("tests.reward_fns:NOT_CALLABLE", "tests.reward_fns.NOT_CALLABLE is not callable (int)"),
    ],
)
def test_cli_start_checks_reward_function_before_connecting(tmp_path: Path, function: str, needle: str) -> None:
    out = start_offline(tmp_path, {"kind": "custom", "function": function})
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: reward.function: reward function {function!r}: ") and needle in out.stderr
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr


def test_cli_start_checks_a_weighted_terms_function_naming_the_term(tmp_path: Path) -> None:
    out = start_offline(tmp_path, {"kind": "weighted", "terms": [
        {"kind": "gsm8k"}, {"kind": "custom", "function": "tests.reward_fns:nope", "weight": 0.5}]})
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: reward.terms.1.function: reward function 'tests.reward_fns:nope': ")


def test_cli_start_bad_reward_regex_names_file_line(tmp_path: Path) -> None:
    out = start_offline(tmp_path, {"kind": "format", "pattern": "(<think>"})
    assert out.returncode == 2
    assert f"{tmp_path / 'run.yaml'}:3: reward.pattern: invalid regular expression '(<think>'" in out.stderr


def test_cli_start_reward_function_shape_names_file_line(tmp_path: Path) -> None:
    out = start_offline(tmp_path, {"kind": "custom", "function": "not a path"})
    assert out.returncode == 2
    assert f"{tmp_path / 'run.yaml'}:3: reward.function: 'not a path' must look like" in out.stderr


def test_cli_start_good_reward_function_passes_preflight(tmp_path: Path) -> None:
    out = start_offline(tmp_path, {"kind": "custom", "function": "tests.reward_fns:length_reward"})
    # past pre-flight: it fails only on the unreachable Temporal address, in one line
    assert out.returncode == 1
    assert out.stderr.startswith("error: cannot reach Temporal at 127.0.0.1:1") and len(out.stderr.splitlines()) == 1
    assert not (tmp_path / "store").exists()


def test_eval_section_defaults_and_due_steps(tmp_path: Path) -> None:
    ev = RunConfig().eval
    assert (ev.enabled, ev.every, ev.n, ev.k, ev.temperature, ev.max_new_tokens) == (True, 0, 100, 4, 1.0, None)
    assert [s for s in range(1, 8) if ev.due(s, 7)] == [7]  # every 0: only after the last step
    every3 = EvalSpec(every=3)
    assert [s for s in range(1, 8) if every3.due(s, 7)] == [3, 6, 7]
    assert not any(EvalSpec(enabled=False, every=1).due(s, 7) for s in range(1, 8))
    with pytest.raises(ConfigError, match=r"run.yaml:2: eval.k: Input should be greater than or equal to 1"):
        load_run_config(write(tmp_path, "steps: 2\neval: {k: 0}\n"))
    with pytest.raises(ConfigError, match=r"eval.temperature: Input should be greater than 0"):
        load_run_config(write(tmp_path, "eval: {temperature: 0}\n"))


def test_eval_path_rules() -> None:
    with pytest.raises(ValidationError, match="eval_path is for jsonl / parquet"):
        DataSpec(kind="arithmetic", eval_path="test.jsonl")
    with pytest.raises(ValidationError, match="eval_path 'test.csv' must end with"):
        DataSpec(kind="jsonl", path="train.jsonl", eval_path="test.csv")
    assert DataSpec(kind="parquet", path="train.parquet", eval_path="test.pq").eval_path == "test.pq"


def test_estimator_and_loss_defaults_are_todays_grpo() -> None:
    t = TrainSpec()
    assert (t.estimator, t.loss_agg, t.kl_estimator, t.kl_in_reward, t.entropy_coef) == (
        "grpo", "token_mean", "k3", False, 0)
    assert (t.dual_clip_c, t.tis_cap, t.loss_agg_norm_len, t.clip_eps_high, t.scale_adv_by_std) == (
        None, None, None, None, True)


@pytest.mark.parametrize("train,needle", [
    ({"dual_clip_c": 1.0}, "dual_clip_c: Input should be greater than 1"),
    ({"estimator": "cispo", "dual_clip_c": 3.0}, "dual_clip_c applies to the PPO-clip loss; estimator cispo"),
    ({"estimator": "gspo"}, "estimator gspo needs loss_agg seq_mean_token_mean"),
    ({"loss_agg": "seq_mean_token_sum_norm"}, "needs loss_agg_norm_len"),
    ({"kl_in_reward": True}, "kl_in_reward needs kl_coef > 0"),
    ({"estimator": "rloo", "scale_adv_by_std": False}, "estimator rloo never divides by the group std"),
    ({"tis_cap": 0.5}, "tis_cap: Input should be greater than or equal to 1"),
    ({"entropy_coef": -0.1}, "entropy_coef: Input should be greater than or equal to 0"),
    ({"estimator": "ppo2"}, "estimator: Input should be 'grpo'"),
    ({"gamma": 0.99}, "gamma: critic / GAE knobs of estimator ppo, unused by grpo"),
    ({"estimator": "ppo", "lam": 1.5}, "lam: Input should be less than or equal to 1"),
    ({"estimator": "ppo", "value_clip": 0}, "value_clip: Input should be greater than 0"),
    ({"estimator": "ppo", "critic_warmup_steps": -1}, "critic_warmup_steps: Input should be greater than or equal"),
    ({"kl_estimator": "k4"}, "kl_estimator: Input should be 'k1', 'k2' or 'k3'"),
])
def test_estimator_and_loss_combinations_are_validated(tmp_path: Path, train: dict, needle: str) -> None:
    p = write(tmp_path, "steps: 3\ntrain: " + json.dumps(train) + "\n")
    with pytest.raises(ConfigError, match=needle):
        load_run_config(p)


def test_estimator_combinations_that_are_valid() -> None:
    TrainSpec(estimator="gspo", loss_agg="seq_mean_token_mean", clip_eps=3e-4, clip_eps_high=4e-4)
    TrainSpec(estimator="cispo", clip_eps_high=4.0)  # CISPO's cap is well above PPO's clip range
    TrainSpec(scale_adv_by_std=False, loss_agg="seq_mean_token_sum_norm", loss_agg_norm_len=512)  # Dr.GRPO
    TrainSpec(estimator="reinforce_pp", kl_coef=0.01, kl_in_reward=True, kl_estimator="k1")
    TrainSpec(estimator="ppo", gamma=0.99, lam=0.95, value_clip=None, critic_lr=1e-5, critic_warmup_steps=2,
              kl_coef=0.05, kl_in_reward=True, dual_clip_c=3.0)
    # milestone set: switching to gspo takes its loss_agg in the same update
    new = HParamUpdate(estimator="gspo", loss_agg="seq_mean_token_mean").apply(TrainSpec())
    assert (new.estimator, new.loss_agg) == ("gspo", "seq_mean_token_mean")
    with pytest.raises(ValueError, match="estimator gspo needs"):
        HParamUpdate(estimator="gspo").apply(TrainSpec())


def test_operand_range_rules() -> None:
    assert DataSpec(min_operand=10, max_operand=99).min_operand == 10
    assert DataSpec().min_operand == 0  # recorded runs without the field keep their data
    with pytest.raises(ValidationError, match="min_operand 50 must be <= max_operand 20"):
        DataSpec(min_operand=50, max_operand=20)


def test_engines_host_defaults_to_loopback_and_takes_a_bare_address() -> None:
    from spec.engine import EngineSpec

    assert EngineSpec().host == "127.0.0.1"
    assert EngineSpec(host="0.0.0.0").host == "0.0.0.0" and EngineSpec(host="node-3.lan").host == "node-3.lan"
    for bad in ("http://10.0.0.1", "10.0.0.1:30000", "", "::1"):
        with pytest.raises(ValidationError, match="an IPv4 address or host name"):
            EngineSpec(host=bad)


def test_cli_set_reads_the_engine_count_and_names_what_is_settable() -> None:
    from milestone_cli.errors import CLIError
    from milestone_cli.main import parse_engine_assignments
    from spec.engine import EngineUpdate

    assert parse_engine_assignments(["engines.num_engines=3"]) == EngineUpdate(num_engines=3)
    with pytest.raises(CLIError, match="settable: engines.num_engines"):
        parse_engine_assignments(["engines.backend=vllm"])  # a new backend needs a new run
    with pytest.raises(CLIError, match="num_engines"):
        parse_engine_assignments(["engines.num_engines=0"])


def test_kept_versions_name_their_field_and_line(tmp_path: Path) -> None:
    assert RunConfig.model_validate({"steps": 9, "checkpoint": {"keep_versions": [6, 2, 6]}}).checkpoint.keep_versions \
        == [2, 6]
    p = write(tmp_path, "steps: 4\ncheckpoint:\n  every: 2\n  keep_versions: [2, 7]\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(p)
    assert "checkpoint" in str(err.value) and "keep_versions [7]: the run has 4 steps" in str(err.value)
    p = write(tmp_path, "checkpoint:\n  keep_versions: [0]\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(p)
    assert f"{p}:2: checkpoint.keep_versions:" in str(err.value) and "1 or more" in str(err.value)


def test_relative_model_path_is_relative_to_where_the_run_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(write(tmp_path, "model: {path: models/smollm2}\n"))
    assert cfg.model.path == str(tmp_path / "models" / "smollm2")
    assert load_run_config(write(tmp_path, "model: {path: /abs/m}\n")).model.path == "/abs/m"
