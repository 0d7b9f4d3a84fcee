"""A scripted "model" behind the rollout's generator signature, for agent tests that need a
model which really calls tools: it reads the chat it is given (decoded) and answers the
calculator task the way a trained model would. Its tokens are the tokenizer's; its logprobs
are a pure function of the request's sampling seed, so a call generated with another seed,
or generated twice, is seen in the numbers. ``calls`` counts requests (a replay makes none).

``hermes=True`` writes Qwen2.5-style ``<tool_call>`` JSON; otherwise the ``<calculator>`` tag.
A question with two products (``What is 12*34 + 56*78?``, ``tool_arithmetic`` with ``terms: 2``) gets
both calls in one turn, then the call of their sum, then the answer."""

from __future__ import annotations

import json
import re
import threading

from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.store.artifacts import derive_seed

QUESTION = re.compile(r"What is (\d+\*\d+)(?: \+ (\d+\*\d+))?\?")


class ScriptedModel:
    def __init__(self, tok: Tokenizer, *, hermes: bool = False, fail_on: int | None = None) -> None:
        self.tok, self.hermes, self.fail_on = tok, hermes, fail_on
        self.calls = 0
        self.lock = threading.Lock()
        self.end = tok.hf.convert_tokens_to_ids("<|im_end|>")

    def reply(self, chat: str) -> str:
        """The next turn: the question's call(s); after two products' answers, the call of their
        sum; after one answer, the answer."""
        m = QUESTION.search(chat.rsplit("<|im_start|>user", 1)[-1])
        if m is None:
            return "I do not know"
        after = chat.rsplit("<|im_start|>user", 1)[-1].split("<|im_start|>assistant\n")[1:-1]  # finished turns
        if not after:  # the first turn: every product at once
            return "".join(self._call(e) for e in m.groups() if e)
        answers = re.findall(r"<\|im_start\|>tool\n(-?\d+)<\|im_end\|>", after[-1])
        if len(answers) == 2:  # both products came back: add them
            return self._call(f"{answers[0]}+{answers[1]}")
        return answers[-1] if answers else "0"

    def _call(self, expression: str) -> str:
        if self.hermes:
            return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": expression}})}\n</tool_call>'
        return f"<calculator>{expression}</calculator>"

    def __call__(self, prompts: list[list[int]], sp: dict) -> tuple[list[dict], str]:
        with self.lock:
            self.calls += 1
            if self.fail_on == self.calls:
                raise ConnectionError("engine died")
        out = []
        for i, prompt in enumerate(prompts):
            ids = [*self.tok.encode(self.reply(self.tok.decode(prompt, skip_special=False))), self.end]
            finish = "stop"
            if len(ids) > sp["max_new_tokens"]:
                ids, finish = ids[: sp["max_new_tokens"]], "length"
            lps = [-((derive_seed(sp["sampling_seed"], i, j) % 1000) + 1) / 1000 for j in range(len(ids))]
            out.append({"output_ids": ids, "meta_info": {
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                "finish_reason": {"type": finish}}})
        return out, "scripted"
