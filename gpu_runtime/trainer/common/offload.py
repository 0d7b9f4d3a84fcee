"""The trainer's side of ``engines.release_memory``: between train steps its optimizer
state lives on the host and its grads are gone, so the engines sharing its GPU can
generate in that memory.

AdamW's ``exp_avg`` / ``exp_avg_sq`` (two fp32 copies of the trainable weights: the
biggest thing a trainer holds besides the weights) are copied to host buffers (pinned on
CUDA, allocated once and reused) after a step and copied back before the next; the copy
is exact, so training continues bitwise as without it. 0-dim entries (``step``) and
anything already on another device than its parameter stay where they are. Grads are
freed, not copied: every optimizer step starts with ``zero_grad(set_to_none=True)``, so
nothing reads a grad after the step that made it. On the CPU the "host" copy is still a
real copy (fresh tensors each way), so a bug that aliased the optimizer's live state
with its parked copy would show there too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


@dataclass
class OptimizerOffload:
    """Optimizers' state parked on the host; ``onload`` undoes exactly what ``offload`` did."""

    host: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)  # reused buffers
    parked: list[tuple[dict, str, torch.device]] = field(default_factory=list)  # (state, key, device) to bring back
    last_offload_s: float = 0.0
    last_onload_s: float = 0.0

    @property
    def offloaded(self) -> bool:
        return bool(self.parked)

    def offload(self, optimizers: Sequence[torch.optim.Optimizer]) -> int:
        """Move the optimizers' per-parameter state tensors to the host and drop the
        parameters' grads. Returns the bytes moved. A second call before ``onload`` is a
        no-op."""
        if self.parked:
            return 0
        t0 = time.perf_counter()
        moved = 0
        with torch.no_grad():
            for o, opt in enumerate(optimizers):
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.grad = None
                        state = opt.state.get(p)
                        if not state:
                            continue
                        for key, t in list(state.items()):
                            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.device != p.device:
                                continue
                            bkey = (o, id(p), key)
                            buf = self.host.get(bkey)
                            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
                                self.host[bkey] = buf
                            buf.copy_(t)
                            state[key] = buf
                            self.parked.append((state, key, t.device))
                            moved += buf.numel() * buf.element_size()
        _empty_cache()
        self.last_offload_s = time.perf_counter() - t0
        return moved

    def onload(self) -> None:
        """Fresh device copies of everything ``offload`` parked (the host buffers are kept
        for the next offload)."""
        if not self.parked:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            for state, key, device in self.parked:
                host = state[key]
                fresh = torch.empty(host.shape, dtype=host.dtype, device=device)
                fresh.copy_(host)
                state[key] = fresh
        self.parked = []
        self.last_onload_s = time.perf_counter() - t0


def _empty_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
