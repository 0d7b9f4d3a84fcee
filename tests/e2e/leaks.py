"""Where a secret could leak from a run: every workflow history (payloads included),
every log file, a metrics page. Helpers for the secret-grep e2e tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from google.protobuf.message import Message
from temporalio.api.common.v1 import Payload
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client

PAYLOAD = Payload.DESCRIPTOR.full_name


def payloads_in(msg: Message, path: str = "") -> Iterator[tuple[str, Payload]]:
    """Every ``Payload`` nested anywhere in ``msg``, with its field path."""
    for field, value in msg.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        where = f"{path}.{field.name}" if path else field.name
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].type == field.TYPE_MESSAGE:
                for k, v in value.items():
                    yield from _one(v, f"{where}[{k}]")
        elif field.is_repeated:
            for i, v in enumerate(value):
                yield from _one(v, f"{where}[{i}]")
        else:
            yield from _one(value, where)


def _one(msg: Message, path: str) -> Iterator[tuple[str, Payload]]:
    if msg.DESCRIPTOR.full_name == PAYLOAD:
        yield path, msg
    else:
        yield from payloads_in(msg, path)


async def all_histories(client: Client) -> dict[str, list[HistoryEvent]]:
    """``<workflow id>/<run id>`` -> events, for every run in the namespace (children and
    continued-as-new runs included)."""
    out: dict[str, list[HistoryEvent]] = {}
    async for wf in client.list_workflows():
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        out[f"{wf.id}/{wf.run_id}"] = list(history.events)
    return out


def log_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.log") if p.is_file())


def occurrences(needles: dict[str, bytes], blobs: dict[str, bytes]) -> list[str]:
    """``'<needle name> in <where>'`` for each needle found in a blob."""
    return [f"{name} in {where}" for where, blob in blobs.items() for name, n in needles.items() if n in blob]
