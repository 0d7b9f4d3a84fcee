"""One TLS context for every HTTP client a node process makes.

``httpx.Client()`` builds a new ``ssl.SSLContext`` and loads the certifi bundle each
time: about 70 ms of CPU on this repo's 2-core machine, paid before a request to a
plain-HTTP loopback engine or trainer even starts. The node agent made one client per
trainer call, per engine weight push and per health probe (on the RL step's critical
path: ``train_step``, ``update_weights``, ``checkpoint``; measured with
``bench.step_timeline``). The context is built once per process here, with httpx's own
defaults (certifi, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``), so verification is unchanged.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default verifying context, built once (contexts are safe to share)."""
    return httpx.create_ssl_context()


def http_client(**kwargs: Any) -> httpx.Client:
    """``httpx.Client(**kwargs)`` on the shared TLS context."""
    return httpx.Client(verify=tls_context(), **kwargs)
