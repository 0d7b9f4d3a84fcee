"""The RPC method tables: every declared method is served, and nothing undeclared is.

The trainer's server and a DP cell's register exactly their table's methods (``spec.rpc``),
each served by the service method of the same name whose result is the declared one; a
fsdp2 rank dispatches only the declared calls of its trainer. Over the wire, a client
calls through a declaration and an undeclared name is refused by type, not silently served."""

from __future__ import annotations

import threading
import typing
from collections.abc import Iterator
from types import SimpleNamespace
from unittest.mock import Mock

import pytest
from pydantic import BaseModel

from gpu_runtime.proc.rpc import RemoteError, RPCClient, RPCServer
from gpu_runtime.trainer import server
from gpu_runtime.trainer.dp import cell_rpc, cell_server
from gpu_runtime.trainer.fsdp2 import rank_methods
from gpu_runtime.trainer.fsdp2.rank import CellRankTrainer
from gpu_runtime.trainer.service import TrainerService
from spec.rpc import Handler, MethodTable, RpcMethod, TableMismatch
from spec.trainer_rpc import TRAINER_RPC


def test_trainer_server_serves_exactly_the_table() -> None:
    served = server.build_methods(Mock(spec=TrainerService))
    assert set(served) == {m.name for m in TRAINER_RPC}
    assert all(h.method in TRAINER_RPC for h in served.values())


@pytest.mark.parametrize("method", list(TRAINER_RPC), ids=lambda m: m.name)
def test_trainer_methods_are_the_services_of_the_same_name(method: RpcMethod) -> None:
    fn = getattr(TrainerService, method.name)
    assert typing.get_type_hints(fn)["return"] is method.result


def test_dp_cell_server_serves_exactly_the_table() -> None:
    svc = cell_server.CellService(0, "http://127.0.0.1:1", 1.0)
    served = cell_rpc.CELL_RPC.serve(*cell_server.handlers(svc))
    assert set(served) == {m.name for m in cell_rpc.CELL_RPC}
    for h in served.values():
        fn = getattr(cell_server.CellService, h.method.name)
        hints = typing.get_type_hints(fn)
        assert (hints["a"], hints["return"]) == (h.method.arg, h.method.result)


def test_fsdp2_rank_methods_are_trainer_calls() -> None:
    assert len(rank_methods.RANK_METHODS) == len(set(rank_methods.RANK_METHODS))
    for name, m in rank_methods.RANK_METHODS.items():
        assert m.name == name
        if m is not rank_methods.POLICY_VERSION:  # an attribute: read through a function
            assert m.fn is getattr(CellRankTrainer, name)
    trainer = SimpleNamespace(policy_version=4, checksum=lambda: "abc")
    assert rank_methods.serve(trainer, rank_methods.POLICY_VERSION.name) == 4
    with pytest.raises(rank_methods.UnknownRankMethod):
        rank_methods.serve(trainer, "checksum_of_anything")


class Ping(BaseModel):
    n: int


class Pong(BaseModel):
    n: int


PING = RpcMethod("ping", Ping, Pong)
STOP = RpcMethod("stop", Ping, Pong)
TABLE = MethodTable("test RPC", PING, STOP)


def test_a_table_refuses_handlers_that_do_not_match_it() -> None:
    ping = Handler(PING, lambda a: Pong(n=a.n))
    with pytest.raises(TableMismatch) as err:
        TABLE.serve(ping, ping, Handler(RpcMethod("ping2", Ping, Pong), lambda a: Pong(n=0)))
    assert (err.value.unknown, err.value.twice, err.value.missing) == (["ping2"], ["ping"], ["stop"])
    with pytest.raises(ValueError):
        MethodTable("twice", PING, RpcMethod("ping", Ping, Pong))


@pytest.fixture
def client() -> Iterator[RPCClient]:
    srv = RPCServer("127.0.0.1", 0, TABLE.serve(Handler(PING, lambda a: Pong(n=a.n + 1)),
                                                Handler(STOP, lambda a: Pong(n=-a.n))))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    c = RPCClient(f"http://127.0.0.1:{srv.port}", timeout_s=10.0)
    try:
        yield c
    finally:
        c.close()
        srv.httpd.shutdown()
        srv.httpd.server_close()


def test_calls_through_a_declaration(client: RPCClient) -> None:
    out = client.call(PING, Ping(n=1))
    assert isinstance(out, Pong) and out.n == 2
    with pytest.raises(RemoteError) as err:
        client.call(RpcMethod("nope", Ping, Pong), Ping(n=1))
    assert err.value.error_type == "UnknownMethod"
    with pytest.raises(TypeError):
        client.call(PING, Pong(n=1))
