"""One declaration per RPC method, used by both ends: its name on the wire, its argument
model and its result model (the pattern of ``workflows/stubs.py`` for a process boundary).

A client calls through the declaration (``client.call(TRAIN_STEP, TrainStepCall(...))``:
the argument must be the method's, the answer is parsed into its result model, and a type
checker sees both). A server registers one handler per method of its ``MethodTable``
(``TRAINER_RPC.serve(Handler(TRAIN_STEP, fn), ...)``), which refuses a table with a method
left unserved, a handler for a method it does not declare, or two for one; a name no
method of the table carries is answered ``UnknownMethod``. The transport (JSON over HTTP)
is ``gpu_runtime.proc.rpc``; the names on the wire are the methods' ``name``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel

A = TypeVar("A", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)


@dataclass(frozen=True)
class RpcMethod(Generic[A, R]):
    """One RPC method: what the client sends (``arg``) and what the server answers (``result``)."""

    name: str
    arg: type[A]
    result: type[R]


@dataclass(frozen=True)
class Handler(Generic[A, R]):
    """What serves one method: ``fn`` takes the validated argument and returns the result model."""

    method: RpcMethod[A, R]
    fn: Callable[[A], R]

    def serve(self, body: bytes) -> dict:
        """The method on a request body (the argument's JSON; empty: ``{}``) -> the result's JSON."""
        return self.fn(self.method.arg.model_validate_json(body or b"{}")).model_dump(mode="json")


class TableMismatch(ValueError):
    """A server's handlers and its table's methods differ (names of each kind)."""

    def __init__(self, table: str, unknown: list[str], twice: list[str], missing: list[str]) -> None:
        super().__init__(f"{table}: handlers do not match the table: unknown {unknown}, "
                         f"served twice {twice}, unserved {missing}")
        self.unknown, self.twice, self.missing = unknown, twice, missing


class MethodTable:
    """The methods of one RPC (the trainer's, a DP cell's): the one list both ends name."""

    def __init__(self, name: str, *methods: RpcMethod) -> None:
        names = [m.name for m in methods]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"{name}: methods declared twice: {dupes}")
        self.name = name
        self.methods: dict[str, RpcMethod] = {m.name: m for m in methods}

    def __iter__(self) -> Iterator[RpcMethod]:
        return iter(self.methods.values())

    def __contains__(self, method: object) -> bool:
        return isinstance(method, RpcMethod) and self.methods.get(method.name) is method

    def serve(self, *handlers: Handler) -> dict[str, Handler]:
        """The handlers by wire name: exactly one for every method of the table, none else."""
        unknown = sorted(h.method.name for h in handlers if h.method not in self)
        served = [h.method.name for h in handlers]
        twice = sorted({n for n in served if served.count(n) > 1})
        missing = sorted(set(self.methods) - set(served))
        if unknown or twice or missing:
            raise TableMismatch(self.name, unknown, twice, missing)
        return {h.method.name: h for h in handlers}


__all__ = ["Handler", "MethodTable", "RpcMethod", "TableMismatch"]
