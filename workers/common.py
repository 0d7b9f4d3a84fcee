"""Shared worker plumbing: the Temporal connection (see ``workers.temporal_connection``) and graceful shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from temporalio.client import Client

from workers.payload_codec import codec_from_env
from workers.temporal_connection import DEFAULT_ADDRESS, connect_with, settings_from_env  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)


def temporal_address() -> str:
    return os.environ.get("MILESTONE_TEMPORAL_ADDRESS", DEFAULT_ADDRESS)


async def connect(address: str | None = None, namespace: str | None = None) -> Client:
    """Connect with the pydantic converter and the settings of ``workers.temporal_connection``
    (TLS / mTLS / API key, payload encryption) read from the environment."""
    return await connect_with(settings_from_env(address, namespace))


def settings_problem(address: str | None = None, namespace: str | None = None) -> str | None:
    """Why the connection settings (TLS files, API key, payload key) are unusable, or None:
    checked before a worker starts anything, so a bad file is one clear line."""
    try:
        settings_from_env(address, namespace)
        codec_from_env()
    except ValueError as err:  # TemporalSettingsError, PayloadKeyError: they name the variable
        return str(err)
    return None


def parse_worker_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p``'s arguments plus every worker's own (``--address``, ``--namespace``, the metrics
    endpoint), parsed; unusable connection settings end it here, as a usage error."""
    p.add_argument("--address", default=None, help="Temporal frontend (default $MILESTONE_TEMPORAL_ADDRESS or localhost:7233)")
    p.add_argument("--namespace", default=None)
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on HOST:PORT (0 = off)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the /metrics endpoint binds (default loopback; 0.0.0.0 in a container)")
    args = p.parse_args(argv)
    if problem := settings_problem(args.address, args.namespace):
        p.error(problem)
    return args


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
