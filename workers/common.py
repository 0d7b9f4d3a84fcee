"""Shared worker plumbing: Temporal connection settings and graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "localhost:7233"


def temporal_address() -> str:
    return os.environ.get("MILESTONE_TEMPORAL_ADDRESS", DEFAULT_ADDRESS)


def temporal_namespace() -> str:
    return os.environ.get("MILESTONE_TEMPORAL_NAMESPACE", "default")


async def connect(address: str | None = None, namespace: str | None = None) -> Client:
    """Connect with the pydantic converter. ``MILESTONE_TEMPORAL_API_KEY`` enables TLS + API key."""
    api_key = os.environ.get("MILESTONE_TEMPORAL_API_KEY")
    return await Client.connect(
        address or temporal_address(),
        namespace=namespace or temporal_namespace(),
        data_converter=pydantic_data_converter,
        api_key=api_key,
        tls=bool(api_key),
    )


def install_shutdown(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=os.environ.get("MILESTONE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health probe otherwise
