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
    """``tools`` (OpenAI function schemas) are rendered into every chat, where the template
    puts them (``apply_chat_template(..., tools=...)``)."""

    def __init__(self, tokenizer: Tokenizer, tool_role: str, tools: list[dict] | None = None) -> None:
        self.tok = tokenizer
        self.role = tool_role
        self.tools = tools or None
        vocab = tokenizer.hf.get_vocab()
        ends = [vocab[t] for t in END_OF_TURN if t in vocab]
        self.base = tokenizer.encode_chat(_PROBE, add_generation_prompt=False, tools=self.tools)
        in_base = [i for i, t in enumerate(self.base) if t in ends]
        if not in_base:
            raise ValueError(
                f"the chat template closes an assistant turn with none of {END_OF_TURN}: agent episodes need one"
            )
        self.end_of_turn = self.base[in_base[-1]]
        self.glue = self.base[in_base[-1] + 1:]  # what the template writes after the end-of-turn token
        self.stop_ids = sorted({self.end_of_turn, tokenizer.eos_token_id})

    def turn_text(self, model_ids: list[int]) -> str:
        """The model's turn as it wrote it, special tokens kept (``[TOOL_CALLS]``, ``<|python_tag|>``
        are special in their tokenizers), without the stop token that closed it: what a parser reads."""
        ids = model_ids[:-1] if model_ids and model_ids[-1] in self.stop_ids else model_ids
        return self.tok.decode(ids, skip_special=False)

    def prompt(self, messages: list[dict]) -> list[int]:
        return self.tok.encode_chat(messages, add_generation_prompt=True, tools=self.tools)

    def tool_turn(self, model_ids: list[int], observation: str) -> list[int]:
        """The tokens that follow the model's turn ``model_ids``: its end-of-turn token when the
        model did not write it, the template's glue, the tool message, the next assistant header."""
        return self.continuation(model_ids, [{"role": self.role, "content": observation}])

    def continuation(
        self, model_ids: list[int], messages: list[dict], tool_calls: list[dict] | None = None
    ) -> list[int]:
        """The tokens that follow the model's turn ``model_ids`` when ``messages`` (tool answers,
        a user message...) come next: its end-of-turn token when the model did not write it, the
        template's glue, ``messages`` as the template renders them after an assistant turn, the
        next assistant header. ``tool_calls`` (OpenAI shape): the calls the turn made, for
        templates that render a tool answer only after the assistant message that called it."""
        assistant = {**_PROBE[1], "tool_calls": tool_calls} if tool_calls else _PROBE[1]
        probe = [_PROBE[0], assistant]
        base = self.base if not tool_calls else self.tok.encode_chat(probe, add_generation_prompt=False, tools=self.tools)
        full = self.tok.encode_chat([*probe, *messages], add_generation_prompt=True, tools=self.tools)
        if full[: len(base)] != base:
            raise ValueError("the chat template renders earlier turns differently once a tool message follows")
        closing = [] if model_ids and model_ids[-1] == self.end_of_turn else [self.end_of_turn]
        return closing + self.glue + full[len(base):]
