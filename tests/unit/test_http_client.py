"""One TLS context per process for the node's HTTP clients, still verifying."""

from __future__ import annotations

import ssl

from gpu_runtime.engine.client import EngineClient
from gpu_runtime.proc.http_client import http_client, tls_context
from gpu_runtime.proc.rpc import RPCClient


def test_clients_share_one_verifying_context() -> None:
    ctx = tls_context()
    assert ctx is tls_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname  # the speed-up is not verify=False
    assert ctx.cert_store_stats()["x509_ca"] > 0  # the CA bundle is loaded
    with http_client() as a, http_client(timeout=3.0) as b:
        assert a._transport._pool._ssl_context is ctx and b._transport._pool._ssl_context is ctx
    engine = EngineClient("http://127.0.0.1:1", token="t")
    rpc = RPCClient("http://127.0.0.1:1")
    try:
        assert engine._http._transport._pool._ssl_context is ctx
        assert rpc._http._transport._pool._ssl_context is ctx
    finally:
        engine.close()
        rpc.close()
