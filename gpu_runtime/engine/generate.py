"""Batched, deterministic generation with a ``transformers`` causal LM.

A batch is left-padded, prefilled once, then decoded one token per step with
a KV cache. Sample ``i`` draws its randomness from its own
``torch.Generator`` seeded with ``row_seed(seed, i)`` (Gumbel-max over the
temperature / top-k / top-p filtered distribution), so its tokens depend only
on (weights, its prompt, seed, i) for a given batch. On a CUDA model the forward
runs on the GPU and each step's logits come back to the CPU for sampling, so the
generators (and the Gumbel draws) are CPU ones on every device: the same seed draws
the same noise on CPU and GPU. Finished samples keep
being fed padding until every sample is done, so the batch shape — and hence
every float — is the same on every run of the same batch.

Stops (SGLang's sampling params): a sample ends at EOS, at a token of
``stop_token_ids``, or once its decoded text contains a string of ``stop`` that the
newest token completed. The stopping token is kept (its logprob too), so the output
text contains the stop string and the trainer's loss mask covers exactly the tokens
the engine produced; nothing is generated for the sample after it.

Each output token's reported logprob is ``log_softmax(logits / temperature)`` of it
(``reported_logprobs``): the distribution the trainer trains, which divides by the same
temperature (docs/algorithms.md, "Temperature").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gpu_runtime.store.artifacts import row_seed
from transformers import PreTrainedModel

from gpu_runtime.models.causal_lm import lm_logits, new_cache, positions_from_mask

log = logging.getLogger(__name__)


@dataclass
class GenResult:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each output token's logprob (``reported_logprobs``)
    finish_reason: str = "length"  # "stop" | "length"
    matched: int | str | None = None  # what stopped it: the stop token id or the stop string


def _filter_logits(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """logits [V] -> temperature-scaled logits with filtered entries set to -inf."""
    x = logits / temperature
    v = x.shape[-1]
    if 0 < top_k < v:
        kth = torch.topk(x, top_k).values[-1]
        x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
    if 0.0 < top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop_sorted = (cum - probs) >= top_p  # keep the smallest prefix reaching top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_token(
    logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int, generator: torch.Generator | None
) -> int:
    """One token from logits [V] (float32). temperature <= 0 => greedy (no randomness drawn)."""
    if temperature <= 0.0 or generator is None:
        return int(torch.argmax(logits).item())
    x = _filter_logits(logits, temperature, top_p, top_k)
    # on the logits' device (the CPU in generate_batch), whatever torch's default device is
    u = torch.rand(x.shape, generator=generator, dtype=torch.float64, device=x.device).clamp_(1e-20, 1.0 - 1e-16)
    gumbel = -torch.log(-torch.log(u))
    return int(torch.argmax(x.double() + gumbel).item())


class _Stops:
    """When each sample of a batch ends: at a token of ``tokens`` (EOS among them), or once
    its decoded text contains a string of ``strings`` that its newest token completed."""

    def __init__(self, n: int, tokens: set[int], strings: list[str], decode: Callable[[list[int]], str] | None) -> None:
        if strings and decode is None:
            raise ValueError("stop strings need a decode function")
        self.tokens, self.strings, self.decode = tokens, strings, decode
        self.text_lens = [0] * n  # length of each sample's decoded text before its newest token
        self.done = [False] * n

    def check(self, i: int, r: GenResult, tok: int) -> None:
        """Sample ``i`` (its result ``r``) has just produced ``tok``: mark it done when that stops it."""
        if tok in self.tokens:
            r.finish_reason, r.matched = "stop", tok
            self.done[i] = True
        elif self.strings:
            assert self.decode is not None
            hit, self.text_lens[i] = stop_string_hit(self.decode(r.output_ids), self.text_lens[i], self.strings)
            if hit is not None:
                r.finish_reason, r.matched = "stop", hit
                self.done[i] = True


def _left_padded(prompts: list[list[int]], pad_id: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded to one width: (ids [B, W], key mask [B, W]) on ``dev``."""
    b, width = len(prompts), max(len(p) for p in prompts)
    cpu = torch.device("cpu")  # built here, moved once (a CUDA trainer's default device is its GPU)
    ids = torch.full((b, width), pad_id, dtype=torch.long, device=cpu)
    key_mask = torch.zeros((b, width), dtype=torch.bool, device=cpu)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long, device=cpu)
        key_mask[i, width - len(p):] = True
    return ids.to(dev), key_mask.to(dev)


def reported_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logprobs the engine reports: ``log_softmax(logits / temperature)``, the distribution
    it samples from before top-p / top-k (which RL refuses), so the trainer, which divides by
    the same temperature, sees the same numbers. Greedy (``temperature`` 0) and 1 report the raw
    ``log_softmax(logits)`` (no division at 1: bitwise the numbers of before)."""
    return torch.log_softmax(logits if temperature <= 0.0 or temperature == 1.0 else logits / temperature, dim=-1)


def _sample_step(
    logits: torch.Tensor, results: list[GenResult], gens: list[torch.Generator | None], stops: _Stops,
    pad_id: int, pick: Callable[..., int], temperature: float,
) -> torch.Tensor:
    """One token for every unfinished sample from the step's logits [B, V] (on the CPU) by
    ``pick`` (``sample_token`` with the request's sampling params), appended to its result with
    its logprob at ``temperature``; the step's new tokens [B] (``pad_id`` for the finished samples)."""
    logp = reported_logprobs(logits, temperature)
    new_tokens = torch.full((len(results),), pad_id, dtype=torch.long, device=torch.device("cpu"))
    for i, r in enumerate(results):
        if stops.done[i]:
            continue
        tok = pick(logits[i], generator=gens[i])
        r.output_ids.append(tok)
        r.logprobs.append(float(logp[i, tok].item()))
        new_tokens[i] = tok
        stops.check(i, r, tok)
    return new_tokens


@torch.no_grad()
def generate_batch(
    model: PreTrainedModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int = 0,
    eos_id: int | None = None,
    pad_id: int = 0,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[GenResult]:
    """Generate for a batch of token-id prompts. ``stop`` needs ``decode`` (token ids ->
    text, the tokenizer's). ``on_step(step)`` is called after each decode step (used by
    the server as a progress heartbeat)."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    b = len(prompts)
    results = [GenResult() for _ in range(b)]
    if max_new_tokens == 0:
        return results
    stops = _Stops(b, set(stop_token_ids) | ({eos_id} if eos_id is not None else set()), [x for x in stop if x], decode)
    gens = [torch.Generator().manual_seed(row_seed(seed, i)) if temperature > 0 else None for i in range(b)]
    pick = functools.partial(sample_token, temperature=temperature, top_p=top_p, top_k=top_k)

    dev = model_device(model)
    ids, key_mask = _left_padded(prompts, pad_id, dev)
    positions = positions_from_mask(key_mask)
    next_pos = positions[:, -1] + 1
    cache = new_cache(model)
    logits = lm_logits(model, ids, key_mask, positions, cache)[:, -1, :].cpu()
    for step in range(max_new_tokens):
        new_tokens = _sample_step(logits, results, gens, stops, pad_id, pick, temperature)
        if on_step is not None:
            on_step(step)
        if all(stops.done) or step == max_new_tokens - 1:
            break
        key_mask = torch.cat([key_mask, torch.ones((b, 1), dtype=torch.bool, device=dev)], dim=1)
        logits = lm_logits(model, new_tokens[:, None].to(dev), key_mask, next_pos[:, None], cache)[:, -1, :].cpu()
        next_pos = next_pos + 1
    return results


def model_device(model: PreTrainedModel) -> torch.device:
    """Where the model's weights are (inputs go there; sampling stays on the CPU)."""
    return next(model.parameters()).device


def stop_string_hit(text: str, prev_len: int, stop: Sequence[str]) -> tuple[str | None, int]:
    """(the first of ``stop`` that ``text`` contains and that ends past ``prev_len``, the
    length of the text before the newest token; ``len(text)``): a stop string counts once
    the token that completes it is produced, even when that token carries more text."""
    for s in stop:
        if text.find(s, max(0, prev_len - len(s) + 1)) != -1:
            return s, len(text)
    return None, len(text)
