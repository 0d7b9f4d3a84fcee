"""The checksum gate an engine passes before it serves: after a start, a restart or a push.

An engine that hashes its whole state (torch, vLLM) must report the model folder's recorded
checksum; one that cannot (SGLang) has a few sampled parameters compared with the folder's
(``weight_probe``), and once they agree it stands for the folder's checksum.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpu_runtime.engine.backends import EngineBackend
from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.fleet_types import Slot
from gpu_runtime.engine.weight_probe import TRUNCATE_ROWS, expected_probe, mismatched
from gpu_runtime.models.model_folder import read_meta

log = logging.getLogger(__name__)


class WeightGate:
    """``client``: the fleet's (cached) client of an engine url."""

    def __init__(self, backend: EngineBackend, client: Callable[[str], EngineClient]) -> None:
        self.backend = backend
        self._client = client

    def expected_checksum(self, model_path: str) -> str | None:
        """The folder's recorded checksum, for a backend whose engines report one (else None)."""
        if not self.backend.supports_checksum:
            return None
        return read_meta(model_path).get("checksum")

    def probe_mismatch(self, s: Slot, model_path: str) -> list[str]:
        """Parameters whose sampled values on the engine differ from the folder's."""
        expected = expected_probe(model_path)
        client = self._client(s.url)
        got = {}
        for name in expected:
            try:
                got[name] = client.get_weights_by_name(name, truncate_size=TRUNCATE_ROWS)
            except EngineError as e:
                log.warning("slot %d: get_weights_by_name(%s) failed: %s", s.index, name, e)
        return mismatched(expected, got)

    def probe_verified(self, s: Slot, model_path: str) -> tuple[str | None, list[str]]:
        """(the folder's checksum, which a verified engine stands for since its sampled
        parameters are the folder's; or None) and the sampled parameters that differ."""
        wrong = self.probe_mismatch(s, model_path)
        return (None if wrong else read_meta(model_path).get("checksum")), wrong
