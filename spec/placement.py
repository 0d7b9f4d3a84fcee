"""The placement context of a run's work on a node, declared once: the run, its store, and the
placement epoch the work runs under. Every node activity input that writes, and the trainer's
``RunSetup``, carry it; every store write goes at that epoch, so work of a placement the run
has left behind writes nothing (``gpu_runtime.store.fence``: the store refuses older epochs)."""

from __future__ import annotations

from pydantic import BaseModel


class Placed(BaseModel):
    run_id: str
    store_uri: str
    epoch: int = 0  # 0: unfenced (a store without a fence: tests and tools that write directly)
