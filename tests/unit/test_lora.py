"""LoRA (peft) in the policy trainer: only the adapters train, sit in the optimizer and are
checkpointed; the published weights are base + B @ A * alpha / r; both exports load in
transformers / peft with the trainer's logits; a checkpoint restores bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from pydantic import ValidationError

from gpu_runtime.models.causal_lm import export_state_dict, load_causal_lm
from gpu_runtime.models.model_folder import load_model_folder, model_checksum
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.common.lora import merged_state_dict
from spec.model import LoraSpec, ModelSpec
from spec.run import RunConfig
from tests.unit.test_policy_trainer import ROWS, assert_same_state, base, hparams, rollout

LORA = LoraSpec(r=4, alpha=8.0)


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


def lora_trainer(seed: int = 7, lora: LoraSpec = LORA, **kw: object) -> PolicyTrainer:
    tr = PolicyTrainer.create(base(seed), hparams(**kw), seed, lora)
    tr.sft_warmup(ROWS, steps=3, batch_size=8, lr=1e-2, seed=seed, betas=(0.9, 0.999))
    return tr


def base_weights(seed: int = 7) -> dict[str, torch.Tensor]:
    return export_state_dict(load_causal_lm(base(seed)))


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_only_adapters_train_and_only_they_are_in_the_optimizer() -> None:
    tr = lora_trainer(kl_coef=0.0)
    trainable = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n, _ in trainable)
    # every linear layer of both blocks (q k v o gate up down), A and B each
    assert len(trainable) == 2 * 7 * 2
    in_optimizer = [p for g in tr.optimizer.param_groups for p in g["params"]]
    assert [id(p) for p in in_optimizer] == [id(p) for _, p in trainable]

    frozen = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    before = tr.checksum()
    tr.train_step(*rollout(0), group_size=4, hparams=tr.hparams)
    assert tr.checksum() != before
    for n, p in tr.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), f"frozen base weight {n} changed"
    state = tr.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)


def test_fresh_adapters_compute_the_base_model_and_the_init_is_seeded() -> None:
    a = PolicyTrainer.create(base(7), hparams(), 7, LORA)
    assert merged_state_dict(a.model).keys() == base_weights().keys()
    for k, v in merged_state_dict(a.model).items():  # B starts at zero: the merge is the base
        assert torch.equal(v, base_weights()[k]), k
    b = PolicyTrainer.create(base(7), hparams(), 7, LORA)
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(x, y), n
    # the adapter init does not move the trainer's own RNG: full fine-tuning draws the same numbers
    PolicyTrainer.create(base(7), hparams(), 7)
    after_full = torch.rand(3)
    PolicyTrainer.create(base(7), hparams(), 7, LORA)
    assert torch.equal(torch.rand(3), after_full)


def test_published_weights_are_base_plus_scaled_b_times_a(tmp_path: Path) -> None:
    tr = lora_trainer()
    tr.train_step(*rollout(0), group_size=4, hparams=tr.hparams)
    merged = tr.published_state()
    plain = base_weights()
    assert merged.keys() == plain.keys()
    scale = LORA.alpha / LORA.r
    params = dict(tr.model.named_parameters())
    changed = 0
    for key, w in merged.items():
        module = key.removesuffix(".weight")
        a = params.get(f"base_model.model.{module}.lora_A.default.weight")
        if a is None:
            assert torch.equal(w, plain[key]), f"{key} is not adapted and must be the base weight"
            continue
        b = params[f"base_model.model.{module}.lora_B.default.weight"]
        assert torch.equal(w, plain[key] + (b @ a) * scale), key
        changed += int(not torch.equal(w, plain[key]))
    assert changed == 14
    # peft's own merge agrees to float rounding
    import copy

    peft_merged = export_state_dict(copy.deepcopy(tr.model).merge_and_unload())
    for key in merged:
        torch.testing.assert_close(merged[key], peft_merged[key], rtol=0, atol=1e-6)

    checksum = tr.export_model_folder(tmp_path / "v1")
    assert checksum == tr.checksum()
    model, _, meta = load_model_folder(tmp_path / "v1")
    assert meta["checksum"] == checksum == model_checksum(model)  # what the engines' checksum gate compares


def test_both_exports_load_with_the_trainers_logits(tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM, PeftModel

    tr = lora_trainer(kl_coef=0.0)
    tr.train_step(*rollout(0), group_size=4, hparams=tr.hparams)
    tr.model.eval()
    ids = torch.tensor([tr.tokenizer.encode("12+7=19", add_bos=True)])
    ours = logits(tr.model, ids)

    tr.export_model_folder(tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), local_files_only=True, attn_implementation="eager")
    torch.testing.assert_close(logits(merged, ids), ours, rtol=0, atol=1e-5)  # (x W' vs x W + x A^T B^T)

    tr.export_adapter_folder(tmp_path / "adapter", str(base(7)))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(base(7)))
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        str(base(7)), local_files_only=True, attn_implementation="eager")
    loaded = PeftModel.from_pretrained(plain, str(tmp_path / "adapter"))
    torch.testing.assert_close(logits(loaded, ids), ours, rtol=0, atol=0)  # the same computation, bitwise
    auto = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"), attn_implementation="eager")
    torch.testing.assert_close(logits(auto, ids), ours, rtol=0, atol=0)


def test_checkpoint_holds_adapters_only_and_restores_bitwise(tmp_path: Path) -> None:
    a = lora_trainer()  # with the KL reference (a frozen copy of the post-SFT adapters)
    for step in range(2):
        a.train_step(*rollout(step), group_size=4, hparams=a.hparams)
    a.save_state(tmp_path / "lora")
    a.train_step(*rollout(2), group_size=4, hparams=a.hparams)

    b = PolicyTrainer.create(base(7), hparams(), 7, LORA)  # a restarted trainer: the base + fresh adapters
    b.load_state(tmp_path / "lora")
    assert b.policy_version == 2
    b.train_step(*rollout(2), group_size=4, hparams=b.hparams)
    assert_same_state(a, b)
    assert a.ref_model is not None and b.ref_model is not None
    for x, y in zip(a.ref_model.parameters(), b.ref_model.parameters()):
        assert torch.equal(x, y)

    full = PolicyTrainer.create(base(7), hparams(), 7)
    full.train_step(*rollout(0), group_size=4, hparams=full.hparams)
    full.save_state(tmp_path / "full")
    for name in ("policy.safetensors", "reference.safetensors", "optimizer.safetensors"):
        assert (tmp_path / "lora" / name).stat().st_size < (tmp_path / "full" / name).stat().st_size / 2, name
    meta = json.loads((tmp_path / "lora" / "trainer_meta.json").read_text())
    assert meta["lora"] == LORA.model_dump(mode="json")

    with pytest.raises(ValueError, match="field 'lora'"):  # another rank, or full fine-tuning
        PolicyTrainer.create(base(7), hparams(), 7, LORA.model_copy(update={"r": 2})).load_state(tmp_path / "lora")
    with pytest.raises(ValueError, match="field 'lora'"):
        full.load_state(tmp_path / "lora")


def test_lora_dropout_replays_bitwise_from_a_checkpoint(tmp_path: Path) -> None:
    """Dropout draws from the trainer's RNG, which the checkpoint carries."""
    drop = LORA.model_copy(update={"dropout": 0.3, "target_modules": ["q_proj", "v_proj"]})
    a = lora_trainer(lora=drop, kl_coef=0.0)
    a.save_state(tmp_path / "s")
    a.train_step(*rollout(0), group_size=4, hparams=a.hparams)
    b = PolicyTrainer.create(base(7), hparams(kl_coef=0.0), 7, drop)
    b.load_state(tmp_path / "s")
    b.train_step(*rollout(0), group_size=4, hparams=b.hparams)
    assert_same_state(a, b)
    assert len([p for p in a.model.parameters() if p.requires_grad]) == 2 * 2 * 2


def test_target_modules_that_match_nothing_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"model.lora.target_modules .*linear layers"):
        PolicyTrainer.create(base(7), hparams(), 7, LORA.model_copy(update={"target_modules": ["qkv"]}))


def test_config_validation() -> None:
    assert RunConfig.model_validate({"model": {"lora": {}}}).model.lora == LoraSpec()
    assert RunConfig().model.lora is None
    bad = [
        ({"init": {}, "lora": {"target_modules": ["q_proj", "qkv_proj"]}}, "qkv_proj"),
        ({"lora": {"target_modules": ["lm_head"]}}, "lm_head"),
        ({"lora": {"target_modules": []}}, "at least one"),
        ({"lora": {"r": 0}}, "greater than or equal to 1"),
        ({"lora": {"alpha": 0}}, "greater than 0"),
        ({"lora": {"dropout": 1.0}}, "less than 1"),
        ({"lora": {"export": "both"}}, "merged"),
        ({"lora": {"rank": 8}}, "rank"),
    ]
    for model, needle in bad:
        with pytest.raises(ValidationError, match=needle):
            ModelSpec.model_validate(model)
    # a user's folder: its module names are checked by the trainer, not here
    assert ModelSpec.model_validate({"path": "/m", "lora": {"target_modules": ["c_attn"]}}).lora is not None
