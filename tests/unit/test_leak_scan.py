"""The history walker of the secret-grep e2e test finds payloads wherever they nest
(single fields, repeated fields, maps), so a leak cannot hide from it."""

from __future__ import annotations

from temporalio.api.common.v1 import Header, Memo, Payload, Payloads, SearchAttributes
from temporalio.api.history.v1 import HistoryEvent, WorkflowExecutionStartedEventAttributes

from tests.e2e.leaks import occurrences, payloads_in


def test_payloads_in_finds_every_nested_payload() -> None:
    p = lambda tag: Payload(metadata={"encoding": b"json/plain"}, data=tag.encode())  # noqa: E731
    event = HistoryEvent(workflow_execution_started_event_attributes=WorkflowExecutionStartedEventAttributes(
        input=Payloads(payloads=[p("in0"), p("in1")]),
        memo=Memo(fields={"m": p("memo")}),
        header=Header(fields={"h": p("hdr")}),
        search_attributes=SearchAttributes(indexed_fields={"RlStep": p("sa")}),
    ))
    found = {path: pl.data.decode() for path, pl in payloads_in(event)}
    assert found == {
        "workflow_execution_started_event_attributes.input.payloads[0]": "in0",
        "workflow_execution_started_event_attributes.input.payloads[1]": "in1",
        "workflow_execution_started_event_attributes.memo.fields[m]": "memo",
        "workflow_execution_started_event_attributes.header.fields[h]": "hdr",
        "workflow_execution_started_event_attributes.search_attributes.indexed_fields[RlStep]": "sa",
    }


def test_occurrences_names_needle_and_place() -> None:
    assert occurrences({"secret": b"s3cr3t"}, {"a.log": b"x s3cr3t y", "b.log": b"clean"}) == ["secret in a.log"]
