"""The chat template applied one turn at a time, without re-tokenising what came before.

An episode's tokens are its prompt, then for each turn the model's own tokens as it
generated them, then the tool turn's tokens. The tool turn's tokens are the template's
*delta*: the tokens a template adds to a finished assistant turn to append a tool
message and open the next assistant turn (for ChatML: ``"\\n<|im_start|>tool\\n" + result
+ "<|im_end|>\\n<|im_start|>assistant\\n"``). The delta is computed by rendering a probe chat
with and without the tool message; the earlier tokens are never re-encoded, so the ids
the model produced (and their logprobs) are exactly the ids trained on.
"""

from __future__ import annotations

from gpu_runtime.models.tokenizer import Tokenizer

# the end-of-turn token of common chat templates (ChatML / Qwen, Llama 3, Gemma)
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
_PROBE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


class IncrementalChat:
    def __init__(self, tokenizer: Tokenizer, tool_role: str) -> None:
        self.tok = tokenizer
        self.role = tool_role
        vocab = tokenizer.hf.get_vocab()
        ends = [vocab[t] for t in END_OF_TURN if t in vocab]
        self.base = tokenizer.encode_chat(_PROBE, add_generation_prompt=False)
        in_base = [i for i, t in enumerate(self.base) if t in ends]
        if not in_base:
            raise ValueError(
                f"the chat template closes an assistant turn with none of {END_OF_TURN}: agent episodes need one"
            )
        self.end_of_turn = self.base[in_base[-1]]
        self.glue = self.base[in_base[-1] + 1:]  # what the template writes after the end-of-turn token
        self.stop_ids = sorted({self.end_of_turn, tokenizer.eos_token_id})

    def prompt(self, messages: list[dict]) -> list[int]:
        return self.tok.encode_chat(messages, add_generation_prompt=True)

    def tool_turn(self, model_ids: list[int], observation: str) -> list[int]:
        """The tokens that follow the model's turn ``model_ids``: its end-of-turn token when the
        model did not write it, the template's glue, the tool message, the next assistant header."""
        full = self.tok.encode_chat([*_PROBE, {"role": self.role, "content": observation}], add_generation_prompt=True)
        if full[: len(self.base)] != self.base:
            raise ValueError("the chat template renders earlier turns differently once a tool message follows")
        closing = [] if model_ids and model_ids[-1] == self.end_of_turn else [self.end_of_turn]
        return closing + self.glue + full[len(self.base):]
