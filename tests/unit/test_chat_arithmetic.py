"""``data.chat``: the built-in arithmetic as chats for an instruction-tuned model (the SmolLM2 example),
its held-out split, the eval's sampled accuracy, and the pre-flight checks of ``model.path``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpu_runtime.data.arithmetic import expression, generate_arithmetic, generate_heldout_arithmetic
from gpu_runtime.data.evaluation import is_correct
from gpu_runtime.data.rows import DataRow, final_answer, sft_target
from milestone_cli.preflight import PreflightError, check_model
from spec.data import DataSpec
from spec.run import RunConfig


def test_chat_rows_are_the_plain_draws_asked_as_a_question() -> None:
    plain = generate_arithmetic(50, 3, 12, "*")
    chat = generate_arithmetic(50, 3, 12, "*", chat=True)
    for p, c in zip(plain, chat):
        DataRow.model_validate(c)  # a valid normalized row: messages, no prompt
        a, b = p["prompt"][:-1].split("*")
        assert c["messages"] == [{"role": "user", "content": f"What is {a}*{b}?"}] and c["prompt"] is None
        assert final_answer(c) == final_answer(p) == str(int(a) * int(b)) == sft_target(c)
        assert expression(c) == expression(p) == p["prompt"] and c["id"] == p["id"]


def test_the_held_out_chats_never_ask_a_trained_product() -> None:
    train = generate_arithmetic(64, 0, 12, "*", chat=True)
    seen = {expression(r) for r in train}
    held = generate_heldout_arithmetic(100, 0, 12, "*", exclude=seen, chat=True)
    assert len(held) == 100 and all(r["messages"] for r in held)
    assert not seen & {expression(r) for r in held}
    # the whole space is 13 x 13: fewer unseen products than asked for gives what there is
    assert len(generate_heldout_arithmetic(500, 0, 12, "*", exclude=seen, chat=True)) == 169 - len(seen)


def test_the_eval_rule_is_the_reward_rule_on_chat_replies() -> None:
    row = generate_arithmetic(1, 0, 12, "*", chat=True)[0]
    answer = final_answer(row)
    assert is_correct(answer, row) and is_correct(f"The answer is {answer}.", row)
    assert not is_correct(f"{answer} is the product of ... 7", row)  # the last number is the answer


def test_chat_applies_to_arithmetic_only() -> None:
    with pytest.raises(ValidationError, match="chat applies to kind arithmetic"):
        DataSpec(kind="tool_arithmetic", chat=True)
    assert DataSpec(kind="arithmetic", chat=True).chat


def config(path: str, **data: object) -> RunConfig:
    return RunConfig.model_validate({"model": {"path": path}, "data": {"kind": "arithmetic", **data}})


def test_model_path_must_be_a_folder_and_chat_needs_a_template(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=r"model.path .*nope: no such folder \(from a GGUF: milestone model "
                                             r"import-gguf FILE.gguf --out FOLDER"):
        check_model(config(str(tmp_path / "nope")))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(PreflightError, match=rf"not a Hugging Face model folder .*import-gguf {gguf} --out"):
        check_model(config(str(gguf)))
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    check_model(config(str(folder)))  # plain prompts: no template needed
    with pytest.raises(PreflightError, match="no chat template, which chat prompts need"):
        check_model(config(str(folder), chat=True))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    check_model(config(str(folder), chat=True))
