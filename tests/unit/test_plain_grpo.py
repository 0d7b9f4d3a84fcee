"""The plain SFT -> GRPO reference loop (bench/plain_grpo.py) on a tiny model:
its data split, masks, loss against hand-computed numbers, and that a few
steps train and stay finite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)

from bench import plain_grpo as pg
from gpu_runtime.data.datasets import prompt_text

TINY = ["--hidden", "32", "--intermediate", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2"]


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory):
    train, _ = pg.split_rows(200, 20, data_seed=0)
    args = pg.parse_args(TINY)
    folder = pg.make_model_folder(tmp_path_factory.mktemp("m") / "model", train, args)
    return folder, train


def test_split_is_disjoint_and_prefix_stable() -> None:
    train, heldout = pg.split_rows(300, 100, data_seed=4)
    assert len(heldout) == 100
    prompts = [prompt_text(r) for r in heldout]
    assert len(set(prompts)) == 100 and not set(prompts) & {prompt_text(r) for r in train}
    assert pg.split_rows(300, 50, data_seed=4)[0] == train


def test_answer_of() -> None:
    assert pg.answer_of("68") == "68"
    assert pg.answer_of("007") == "7"
    assert pg.answer_of("6 8") == "8"
    assert pg.answer_of("-5x") == "-5"
    assert pg.answer_of("") is None


def test_completion_mask_covers_exactly_the_completion(policy) -> None:
    model, _ = pg.load_policy(policy[0])
    logp, mask = pg.completion_logprobs(model, [[5, 6, 7], [5]], [[8, 0], [9, 10, 0]], pad_id=0)
    assert logp.shape == mask.shape == (2, 4)
    # row 0: tokens 5 6 7 | 8 0 -> targets at entries 2, 3; row 1: 5 | 9 10 0 -> entries 0, 1, 2
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert (logp <= 0).all()


def test_grpo_loss_with_ratio_one_is_minus_token_mean_advantage(policy) -> None:
    model, _ = pg.load_policy(policy[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    prompts = [[5, 6]] * 4
    responses = [[8, 0], [9], [8, 8, 0], [9, 0]]
    rewards = [1.0, 0.0, 0.0, 0.0]  # group of 2 and a group of 2 with equal rewards
    out = pg.grpo_update(model, opt, prompts, responses, rewards, group=2, pad_id=0, clip=0.2, grad_clip=1.0)
    adv = [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0, 0.0]  # (r - mean) / (population std + 1e-6)
    lens = [2, 1, 3, 2]
    expected = -sum(a * n for a, n in zip(adv, lens)) / sum(lens)
    assert out["loss"] == pytest.approx(expected, rel=1e-5)
    assert out["response_len"] == pytest.approx(2.0)


def test_generate_stops_at_eos(policy) -> None:
    model, tok = pg.load_policy(policy[0])
    eos = tok.eos_token_id
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: greedy takes the first id, EOS
    responses = pg.generate(model, [[5, 6], [7]], eos, max_new_tokens=4, temperature=None)
    assert responses == [[eos], [eos]]


def test_main_runs_sft_and_grpo_and_writes_json(policy, tmp_path: Path, capsys) -> None:
    folder, _ = policy
    out = tmp_path / "summary.json"
    before = {k: v.clone() for k, v in pg.load_policy(folder)[0].state_dict().items()}
    summary = pg.main(["--model", str(folder), "--n-train", "200", "--n-heldout", "20", "--sft-steps", "3",
                       "--sft-batch", "8", "--rl-steps", "2", "--prompts", "2", "--group", "4", "--kl", "0.1",
                       "--log-every", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert "seconds per RL step" in text and "held-out greedy acc after RL" in text
    saved = json.loads(out.read_text())
    assert saved["rl_steps"] == 2 and len(saved["rewards"]) == 2
    for key in ("sft_s_per_step", "rl_s_per_step", "reward_first20", "reward_last20", "heldout_acc_sft",
                "heldout_acc_rl", "sft_loss_last"):
        assert saved[key] == summary[key] and saved[key] == saved[key]  # present and not NaN
    assert summary["heldout_acc_sft"] >= 0.0
    # the folder itself is never written to
    after = pg.load_policy(folder)[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sft_learns_a_few_rows(policy) -> None:
    folder, train = policy
    model, tok = pg.load_policy(folder)
    stats = pg.sft(model, tok, train[:4], steps=30, batch_size=8, lr=3e-3, seed=0, log_every=0)
    assert stats["sft_loss_last"] < 0.5 * stats["sft_loss_first"]


def test_prompt_starts_with_bos_unless_built_without(policy, tmp_path: Path) -> None:
    folder, train = policy
    _, tok = pg.load_policy(folder)
    assert pg.encode_prompt(tok, train[0])[0] == tok.bos_token_id
    no_bos = pg.make_model_folder(tmp_path / "nb", train, pg.parse_args([*TINY, "--no-bos"]))
    _, tok = pg.load_policy(no_bos)
    assert pg.encode_prompt(tok, train[0]) == tok(prompt_text(train[0]))["input_ids"]
    assert tok.bos_token_id is None and tok.convert_ids_to_tokens(pg.encode_prompt(tok, train[0])[0]).isdigit()
