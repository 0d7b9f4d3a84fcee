"""The test stack's Temporal dev server and SeaweedFS survive a port taken between
``free_port`` and their bind (CI lost ``test_trainer_cell_run``'s stack to ``bind: address
already in use``): a first start is retried on fresh ports. A restart keeps its ports (they
are the server's address) and fails naming what the server printed."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from infra.seaweedfs import SeaweedServer
from tests.stack import TemporalDevServer, wait_for


def bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:  # a connection of the stopped server still in TIME_WAIT
        return False


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


def test_a_frontend_port_another_process_listens_on_is_replaced(tmp_path: Path) -> None:
    """An open port is not the server's: the start waits until this server serves a client,
    sees it exit (bind failed), and moves on, instead of waiting out a dead server."""
    server = TemporalDevServer(tmp_path)
    with socket.socket() as squatter:  # listening: the port answers, but not as Temporal
        squatter.bind(("127.0.0.1", server.port))
        squatter.listen()
        taken = server.port
        try:
            server.start()
            assert server.port != taken and server.proc is not None and server.proc.poll() is None
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
        wait_for(lambda: bound(squatter, port), 120, what=f"port {port} free of the stopped server's connections")
        try:
            with pytest.raises(RuntimeError, match=f"{port}: bind: address already in use"):
                server.start(attempts=2)
            assert server.port == port and server.proc is None
        finally:
            server.stop()


def test_seaweedfs_retries_a_first_start_that_lost_a_port(tmp_path: Path) -> None:
    server = SeaweedServer(tmp_path / "weed", 0)
    server._choose_ports()
    volume_port = server.ports["volume"]
    with socket.socket() as squatter:  # bound, not listening: like an outgoing connection's local port
        squatter.bind(("127.0.0.1", volume_port))
        try:
            server.start()
            assert server.is_running() and server.ports["volume"] != volume_port
            assert "is not available" in (tmp_path / "weed" / "weed.out").read_text()
        finally:
            server.stop()


def test_seaweedfs_restart_keeps_its_ports(tmp_path: Path) -> None:
    server = SeaweedServer(tmp_path / "weed", 0)
    server.start()
    ports, s3_port = dict(server.ports), server.s3_port
    server.stop()
    with socket.socket() as squatter:  # listening (the stopped server's connections may linger in TIME_WAIT)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", ports["filer"]))
        squatter.listen()
        try:
            with pytest.raises(RuntimeError, match="is not available"):
                server.start()
            assert server.ports == ports and server.s3_port == s3_port
        finally:
            server.stop()
