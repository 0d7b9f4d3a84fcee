"""How the CLI words errors: one line, the run's failure type first."""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

from milestone_cli.errors import connect_error, failure_text, one_line
from workflows.failures import Failure, failure


def chain(*errors: BaseException) -> BaseException:
    """errors[0] caused by errors[1] caused by ... (as Temporal decodes a failure)."""
    for outer, inner in zip(errors, errors[1:]):
        outer.__cause__ = inner
    return errors[0]


def test_one_line_joins_a_multi_line_message() -> None:
    text = "invalid TrainingRun input:\nconfig.a: x\nconfig.b: y\n"
    assert one_line(text) == "invalid TrainingRun input: config.a: x; config.b: y"
    assert one_line("single") == "single"


def test_failure_text_names_our_failure_type_anywhere_in_the_chain() -> None:
    err = chain(RuntimeError("Workflow execution failed"), RuntimeError("Child failed"),
                failure(Failure.INVALID_INPUT, "reward.function: bad"))
    assert failure_text(err) == "InvalidInput: reward.function: bad"


def test_failure_text_falls_back_to_the_innermost_cause() -> None:
    err = chain(RuntimeError("Workflow execution failed"), ApplicationError("boom", type="KeyError"))
    assert failure_text(err) == "KeyError: boom"
    assert failure_text(chain(RuntimeError("outer"), TimeoutError("timed out"))) == "TimeoutError: timed out"


def test_connect_error_keeps_the_reason_only() -> None:
    raw = RuntimeError('Failed client connect: Server connection error: tonic::transport::Error(Transport, '
                       'ConnectError(ConnectError("tcp connect error", 127.0.0.1:1, Os { code: 111, kind: '
                       'ConnectionRefused, message: "Connection refused" })))')
    err = connect_error("127.0.0.1:1", raw)
    assert str(err).startswith("cannot reach Temporal at 127.0.0.1:1: Connection refused (") and err.code == 1
