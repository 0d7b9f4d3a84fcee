"""The test stack's Temporal dev server survives a port taken between ``free_port``
and its bind (CI lost ``test_trainer_cell_run``'s stack to ``bind: address already in
use``), and any other start failure names what the server printed."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.stack import TemporalDevServer


def test_a_taken_frontend_port_is_replaced_before_the_first_start(tmp_path: Path) -> None:
    server = TemporalDevServer(tmp_path)
    with socket.socket() as squatter:  # bound, not listening: like an outgoing connection's local port
        squatter.bind(("127.0.0.1", server.port))
        taken = server.port
        try:
            server.start()
            assert server.port != taken
            assert "address already in use" in (tmp_path / "temporal.log").read_text()
        finally:
            server.stop()


def test_a_taken_frontend_port_on_restart_is_an_error_with_the_servers_words(tmp_path: Path) -> None:
    """After the first start the workers know the address: the port is not changed."""
    server = TemporalDevServer(tmp_path)
    server.start()
    port = server.port
    server.stop()
    with socket.socket() as squatter:  # bound, not listening: like an outgoing connection's local port
        squatter.bind(("127.0.0.1", port))
        try:
            with pytest.raises(RuntimeError, match=f"{port}: bind: address already in use"):
                server.start(attempts=2)
            assert server.port == port and server.proc is None
        finally:
            server.stop()
