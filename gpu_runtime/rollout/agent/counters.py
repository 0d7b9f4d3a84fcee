"""What a rollout attempt did, counted from the threads of its chunks (not part of any artifact:
a retry differs). Each agent kind's counters are a dataclass of ints on this base."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class AttemptCounters:
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False, kw_only=True)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)
