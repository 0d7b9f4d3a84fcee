"""PolicyTrainer: a step changes weights, state save/load continues bitwise, determinism."""

from __future__ import annotations

import json
import math
import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch

from gpu_runtime.store.artifacts import Sample
from gpu_runtime.data.datasets import encode_prompt, generate_arithmetic
from gpu_runtime.models.model_folder import load_model_folder, model_checksum
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.base_model import base_model_folder
from spec.model import ModelInitSpec, ModelSpec
from spec.train import TrainSpec
from spec.trainer_rpc import VersionInfo

ROWS = generate_arithmetic(32, seed=0, max_operand=20)
INIT = ModelInitSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)


@cache
def base(seed: int) -> Path:
    """A real HF folder (BPE tokenizer trained on ROWS, seeded transformers init), as a run builds it."""
    source = ModelSpec(init=INIT)
    return base_model_folder(source, ROWS, seed, Path(tempfile.mkdtemp(prefix="trainer-base-")))


TOK = Tokenizer.load(base(7))
METRICS = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "grad_norm", "lr", "tokens", "tokens_per_s",
           "reward_mean", "reward_std", "response_len_mean")


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


def hparams(**kw: object) -> TrainSpec:
    """The run config's ``train`` defaults with these overrides, as the node agent sends them."""
    base: dict[str, object] = dict(lr=1e-3, micro_batch_size=3, ppo_epochs=2, kl_coef=0.1, warmup_steps=3, clip_eps=0.2)
    base.update(kw)
    return TrainSpec(**base)


def rollout(step: int, n_prompts: int = 2, group: int = 4) -> tuple[list[Sample], list[float]]:
    """Fixed synthetic samples: responses are digit strings that vary per sample."""
    samples, rewards = [], []
    for p in range(n_prompts):
        row = ROWS[(step * n_prompts + p) % len(ROWS)]
        pids = encode_prompt(TOK, row)
        for g in range(group):
            text = str((step * 7 + p * 3 + g * 5) % 40)
            rids = TOK.encode(text) + ([TOK.eos_token_id] if g % 2 == 0 else [])
            samples.append(Sample(sample_id=f"s{step}-p{p}-g{g}", prompt_index=p, group_index=g, prompt_ids=pids,
                                  response_ids=rids, logprobs=[-1.0] * len(rids), weight_version=step,
                                  finish_reason="stop" if g % 2 == 0 else "length"))
            rewards.append(1.0 if (g + step) % 3 == 0 else 0.0)
    return samples, rewards


def new_trainer(seed: int = 7, **kw: object) -> PolicyTrainer:
    hp = hparams(**kw)
    tr = PolicyTrainer.create(base(seed), hp, seed)
    tr.sft_warmup(ROWS, steps=3, batch_size=8, lr=1e-3, seed=seed, betas=(0.9, 0.95))
    return tr


def optimizer_tensors(tr: PolicyTrainer) -> list[torch.Tensor]:
    state = tr.optimizer.state_dict()["state"]
    return [state[i][name] for i in sorted(state) for name in sorted(state[i])]


def assert_same_state(a: PolicyTrainer, b: PolicyTrainer) -> None:
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    ta, tb = optimizer_tensors(a), optimizer_tensors(b)
    assert len(ta) == len(tb) > 0
    for x, y in zip(ta, tb):
        assert torch.equal(x, y)
    assert a.policy_version == b.policy_version and a.opt_steps == b.opt_steps


def test_train_step_changes_weights_and_reports_finite_metrics() -> None:
    tr = new_trainer()
    assert tr.policy_version == 0
    before = tr.checksum()
    samples, rewards = rollout(0)
    m = tr.train_step(samples, rewards, group_size=4, hparams=tr.hparams)
    assert tr.policy_version == 1
    assert tr.checksum() != before
    for k in METRICS:
        assert math.isfinite(m[k]), k
    assert m["tokens"] == sum(len(s.response_ids) for s in samples)
    assert m["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert m["grad_norm"] > 0 and m["kl"] >= 0
    assert m["lr"] == pytest.approx(1e-3 * 2 / 3)  # second optimizer step of a 3-step warm-up


def test_first_epoch_ratio_is_one_without_kl() -> None:
    tr = new_trainer(kl_coef=0.0, ppo_epochs=1)
    assert tr.ref_model is None
    m = tr.train_step(*rollout(0), group_size=4, hparams=tr.hparams)
    assert m["clip_fraction"] == 0.0 and m["kl"] == 0.0
    with pytest.raises(ValueError, match="kl_coef"):
        tr.train_step(*rollout(1), group_size=4, hparams=hparams(kl_coef=0.5))


def test_save_load_continues_bitwise(tmp_path: Path) -> None:
    a = new_trainer()
    for step in range(2):
        a.train_step(*rollout(step), group_size=4, hparams=a.hparams)
    a.save_state(tmp_path / "state")
    a.train_step(*rollout(2), group_size=4, hparams=a.hparams)

    b = PolicyTrainer.from_state(tmp_path / "state")
    assert b.policy_version == 2
    b.train_step(*rollout(2), group_size=4, hparams=b.hparams)
    assert_same_state(a, b)

    # load_state into a differently-trained trainer of the same shape also continues bitwise
    c = new_trainer(seed=99)
    c.load_state(tmp_path / "state")
    c.train_step(*rollout(2), group_size=4, hparams=c.hparams)
    assert_same_state(a, c)
    assert c.ref_model is not None and a.ref_model is not None
    for x, y in zip(a.ref_model.parameters(), c.ref_model.parameters()):
        assert torch.equal(x, y)
    meta = json.loads((tmp_path / "state" / "trainer_meta.json").read_text())
    assert meta["policy_version"] == 2


def test_checkpoint_from_before_the_estimator_knobs_still_loads(tmp_path: Path) -> None:
    a = new_trainer()
    a.train_step(*rollout(0), group_size=4, hparams=a.hparams)
    a.save_state(tmp_path / "state")
    meta_path = tmp_path / "state" / "trainer_meta.json"
    meta = json.loads(meta_path.read_text())
    for key in ("estimator", "dual_clip_c", "loss_agg", "loss_agg_norm_len", "kl_estimator", "kl_in_reward",
                "entropy_coef", "tis_cap"):
        del meta["hparams"][key]
    meta_path.write_text(json.dumps(meta))
    b = PolicyTrainer.from_state(tmp_path / "state")
    assert b.hparams == a.hparams
    a.train_step(*rollout(1), group_size=4, hparams=a.hparams)
    b.train_step(*rollout(1), group_size=4, hparams=b.hparams)
    assert_same_state(a, b)


def test_load_state_rejects_corrupt_weights(tmp_path: Path) -> None:
    a = new_trainer()
    a.save_state(tmp_path / "s")
    meta_path = tmp_path / "s" / "trainer_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["checksum"] = "0" * 64
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="checksum"):
        PolicyTrainer.from_state(tmp_path / "s")


def test_two_fresh_trainers_are_bitwise_identical() -> None:
    a, b = new_trainer(seed=3), new_trainer(seed=3)
    for step in range(2):
        ma = a.train_step(*rollout(step), group_size=4, hparams=a.hparams)
        mb = b.train_step(*rollout(step), group_size=4, hparams=b.hparams)
        assert {k: ma[k] for k in METRICS if k != "tokens_per_s"} == {k: mb[k] for k in METRICS if k != "tokens_per_s"}
    assert_same_state(a, b)
    assert a.checksum() == b.checksum()
    assert new_trainer(seed=4).checksum() != new_trainer(seed=3).checksum()


def test_sft_warmup_resets_rl_state() -> None:
    tr = PolicyTrainer.create(base(1), hparams(), 1)
    init = tr.checksum()
    m = tr.sft_warmup(ROWS, steps=4, batch_size=8, lr=1e-3, seed=1, betas=(0.9, 0.95))
    assert m["sft_loss_last"] < m["sft_loss_first"]
    assert tr.checksum() != init and tr.policy_version == 0 and tr.opt_steps == 0
    assert tr.optimizer.state_dict()["state"] == {}
    assert tr.ref_model is not None and model_checksum(tr.ref_model) == tr.checksum()


def test_export_and_evaluate(tmp_path: Path) -> None:
    tr = new_trainer()
    tr.train_step(*rollout(0), group_size=4, hparams=tr.hparams)
    checksum = tr.export_model_folder(tmp_path / "m")
    assert checksum == tr.checksum()
    model, tok, meta = load_model_folder(tmp_path / "m")
    assert meta == {"weight_version": 1, "checksum": checksum}
    assert model_checksum(model) == checksum and tok.encode("12+7=") == TOK.encode("12+7=")
    acc = tr.evaluate_greedy(ROWS, limit=8, max_new_tokens=4)
    assert 0.0 <= acc <= 1.0


def test_bad_inputs_are_rejected() -> None:
    tr = new_trainer()
    samples, rewards = rollout(0)
    with pytest.raises(ValueError, match="group_size"):
        tr.train_step(samples, rewards, group_size=3, hparams=tr.hparams)
    with pytest.raises(ValueError, match="rewards"):
        tr.train_step(samples, rewards[:-1], group_size=4, hparams=tr.hparams)
    with pytest.raises(ValueError, match="share one prompt"):
        tr.train_step(samples, rewards, group_size=8, hparams=tr.hparams)


def test_sft_with_zero_steps_keeps_the_folder_weights_and_reports_finite_numbers() -> None:
    """``sft.steps: 0`` skips the warm-up: v0 is the base folder's weights, and every
    reported number survives the JSON of the trainer RPC and the Temporal payload."""
    tr = PolicyTrainer.create(base(1), hparams(), 1)
    before = tr.checksum()
    m = tr.sft_warmup(ROWS, steps=0, batch_size=8, lr=1e-3, seed=1, betas=(0.9, 0.95))
    assert tr.checksum() == before and tr.policy_version == 0
    assert all(math.isfinite(v) for v in m.values()) and "sft_loss_first" not in m
    info = VersionInfo(policy_version=0, checksum=before, model_path="p", sft_metrics=m)
    assert VersionInfo.model_validate_json(info.model_dump_json()) == info
