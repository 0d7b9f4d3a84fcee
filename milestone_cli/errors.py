"""CLI errors: every failure becomes one ``error: <message>`` line and an exit code.

``amain`` catches at one place; these helpers turn Temporal's exceptions
(RPC errors, failed workflows, updates and queries, connection errors) into a
sentence that names the run.
"""

from __future__ import annotations

import re

from temporalio.client import (
    RPCTimeoutOrCancelledError,
    WorkflowFailureError,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ApplicationError, FailureError, TemporalError
from temporalio.service import RPCError, RPCStatusCode

from workflows.failures import failure_in


class CLIError(Exception):
    """A refused or failed command: ``error: <message>`` and exit ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Unreachable(CLIError):
    """The Temporal frontend cannot be reached."""


def one_line(text: str) -> str:
    """Join a multi-line message: 'head:\\nx\\ny' -> 'head: x; y'."""
    out = ""
    for line in (ln.strip() for ln in text.splitlines()):
        if line:
            out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


def failure_text(err: BaseException) -> str:
    """Why a run failed: ``<FailureType>: <message>`` for our failure types (found
    anywhere in the cause chain), else the innermost cause's message."""
    kind, message = failure_in(err)
    if kind is not None:
        return f"{kind.value}: {message}"
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    name = cause.type if isinstance(cause, ApplicationError) and cause.type else type(cause).__name__
    return f"{name}: {cause.message if isinstance(cause, FailureError) else cause}"


def connect_error(address: str, err: BaseException) -> Unreachable:
    """'Failed client connect: ... message: "Connection refused" ...' -> a short reason."""
    text = str(err)
    m = re.search(r'(?:message|error): "([^"]+)"', text)
    reason = m.group(1) if m else text.removeprefix("Failed client connect: ")
    return Unreachable(
        f"cannot reach Temporal at {address}: {reason} (is the stack up? `make up`, or set --address / "
        f"MILESTONE_TEMPORAL_ADDRESS)"
    )


def describe_error(err: TemporalError, run: str | None) -> str:
    """One sentence for a Temporal client error raised while acting on ``run``."""
    where = f"run {run}: " if run else ""
    if isinstance(err, RPCError):
        if err.status == RPCStatusCode.NOT_FOUND and "not found" in err.message:
            return f"run {run!r} not found" if run else err.message
        if err.message == "workflow execution already completed":  # said of any closed run
            return f"{where}the run has ended (it takes no more signals or updates; see `milestone status {run}`)"
        return where + err.message
    if isinstance(err, WorkflowFailureError):
        return f"{where}failed: {failure_text(err)}"
    if isinstance(err, WorkflowUpdateFailedError):
        return f"{where}update refused: {failure_in(err.cause)[1]}"
    if isinstance(err, (WorkflowQueryFailedError, WorkflowQueryRejectedError)):
        return f"{where}progress query failed: {err}"
    if isinstance(err, RPCTimeoutOrCancelledError):
        return f"{where}Temporal did not answer in time"
    return where + str(err)
