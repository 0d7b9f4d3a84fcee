"""Request dispatch: one chunk (one batch request) to a healthy engine of the fleet, and on an
engine failure the SAME request (same seeds) again to a survivor.

Through the router when the fleet has one and the request takes one sampling-params dict;
else straight to an engine, round-robin over the healthy ones.
"""

from __future__ import annotations

import itertools
import logging
import zlib
from typing import Any

from gpu_runtime.engine.client import EngineError
from gpu_runtime.engine.fleet_memory import EngineMemory
from gpu_runtime.engine.fleet_types import NoHealthyEngine
from gpu_runtime.engine.health import HealthMonitor
from gpu_runtime.engine.supervisor import SlotSupervisor

log = logging.getLogger(__name__)


class RequestDispatch:
    def __init__(self, slots: SlotSupervisor, monitor: HealthMonitor, memory: EngineMemory) -> None:
        self.slots = slots
        self.monitor = monitor
        self.memory = memory
        self._rr = itertools.count()

    def generate_chunk(
        self, batch: list[list[int]], sampling_params: dict[str, Any], *, return_logprob: bool = True,
        max_attempts: int | None = None, affinity: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """Send one chunk (one batch request) to a healthy engine; on an engine failure,
        detect it and resend the SAME request (same seeds) to a survivor. ``affinity``: requests
        with the same key go to the same healthy engine (an agent episode's calls: its prefix stays
        in that engine's cache), straight, not through the router."""
        self.memory.push_if_pending()
        sup = self.slots
        params = sup.backend.batch_sampling_params(sampling_params, len(batch))
        # sglang-router 0.3.2 refuses a list of sampling params (HTTP 422, measured): such a
        # chunk (SGLang's, one seed per sample) goes to an engine directly, round-robin
        via_router = sup.router is not None and isinstance(params, dict) and affinity is None
        attempts = max_attempts or len(sup.slots) + 2
        last: EngineError | None = None
        for _ in range(attempts):
            healthy = sup.healthy_urls()
            if not healthy:
                raise NoHealthyEngine(f"no healthy engine (slots: {[s.state for s in sup.slots]})") from last
            if via_router and sup.router:
                url = sup.router.url
            elif affinity is not None:
                url = healthy[zlib.crc32(affinity.encode()) % len(healthy)]
            else:
                url = healthy[next(self._rr) % len(healthy)]
            try:
                return sup.client(url).generate(batch, params, return_logprob), url
            except EngineError as e:
                if e.status is not None and 400 <= e.status < 500 and e.status not in (404, 408, 429):
                    raise  # the request itself is bad: retrying elsewhere cannot help
                last = e
                log.warning("chunk failed on %s: %s; detecting failures and retrying", url, e)
                if via_router:
                    self.monitor.check_now()
                else:
                    s = next(x for x in sup.slots if x.url == url)
                    _, ok, timed_out, detail = self.monitor.probe(s)
                    if not ok:
                        sup.declare_dead(s, f"request failed and probe failed: {detail}", hung=timed_out)
        raise NoHealthyEngine(f"chunk failed {attempts} times") from last
