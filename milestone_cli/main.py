"""``milestone`` command line: start, watch, status, pause, resume, set, report."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError

from milestone_cli.config_file import ConfigError, load_run_config
from milestone_cli.resume import NothingToResume, ResumeError, resume_state
from workers.common import connect
from workflows.config import HParamUpdate
from workflows.contracts import CONTROL_QUEUE, RunProgress, RunSummary, TrainingRunInput

UI_BASE = "http://localhost:8233"


def ui_link(run_id: str, namespace: str = "default") -> str:
    return f"{UI_BASE}/namespaces/{namespace}/workflows/{run_id}"


async def _progress(handle: WorkflowHandle) -> RunProgress:
    return await handle.query("progress", result_type=RunProgress)


async def _closed_state(handle: WorkflowHandle) -> str | None:
    desc = await handle.describe()
    st = desc.status
    if st in (None, WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW):
        return None
    return st.name.lower()


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(1, total))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def format_progress(p: RunProgress) -> str:
    last = p.steps[-1] if p.steps else None
    line = f"{p.run_id} {_bar(p.step, p.total_steps)} step {p.step}/{p.total_steps} v{p.policy_version} {p.state}"
    if last:
        line += (
            f" | reward {last.reward_mean:.3f} acc {last.accuracy:.2f} loss {last.loss:+.4f}"
            f" | {last.step_seconds:.1f}s/step"
        )
    return line


async def cmd_start(client: Client, args: argparse.Namespace) -> int:
    try:
        cfg = load_run_config(args.config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if cfg.data.kind == "jsonl":  # validate rows before the run starts
        from gpu_runtime.data.datasets import load_jsonl

        try:
            load_jsonl(cfg.data.path)
        except (ValueError, FileNotFoundError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    state = None
    if args.resume_from:
        try:
            run_id, cfg, state = resume_state(cfg, args.resume_from)
        except ResumeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 3 if isinstance(err, NothingToResume) else 2
        if args.run_id and args.run_id != run_id:
            print(f"error: --run-id {args.run_id}: a resume continues run {run_id} under its own id", file=sys.stderr)
            return 2
        if await _is_running(client, run_id):
            print(f"error: run {run_id} is still running; nothing to resume", file=sys.stderr)
            return 2
    else:
        run_id = args.run_id or f"{cfg.name}-{uuid.uuid4().hex[:8]}"
    await client.start_workflow(
        "TrainingRun",
        TrainingRunInput(config=cfg, state=state),
        id=run_id,
        task_queue=CONTROL_QUEUE,
        static_summary=f"{cfg.name}: {cfg.steps} RL steps" + (f" (resumed at step {state.next_step})" if state else ""),
    )
    if state is not None:
        print(f"resuming {run_id} at step {state.next_step} (policy v{state.policy_version}, data cursor {state.data_cursor})")
    print(f"started {run_id}\n  UI: {ui_link(run_id)}")
    if args.wait:
        return await watch(client, run_id)
    return 0


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
        except RPCError:
            line = f"{run_id}: waiting for a worker..."
        if line != last_line:
            print(("\r\x1b[2K" + line) if tty else line, end="" if tty else "\n", flush=True)
            last_line = line
        if closed:
            if tty:
                print()
            if closed != "completed":
                print(f"run {run_id} {closed}", file=sys.stderr)
                return 1
            summary = await handle.result()
            print(
                f"done: {summary.steps} steps, policy v{summary.policy_version}, "
                f"mean reward first steps {summary.first_reward_mean:.3f} -> last steps {summary.last_reward_mean:.3f}"
            )
            if summary.final_weights_key:
                print(f"final model (Hugging Face folder): {summary.final_weights_key} in the run's store")
            return 0
        await asyncio.sleep(interval_s)


async def cmd_status(client: Client, args: argparse.Namespace) -> int:
    handle = client.get_workflow_handle(args.run)
    closed = await _closed_state(handle)
    p = await _progress(handle)
    state = closed or p.state
    if args.json:
        doc = p.model_dump(mode="json")
        doc["state"] = state
        print(json.dumps(doc, indent=2))
    else:
        print(format_progress(p.model_copy(update={"state": state})))
        for e in p.events[-10:]:
            print(f"  {e.at} {e.kind}: {e.detail}")
    return 0


async def cmd_report(client: Client, args: argparse.Namespace) -> int:
    from milestone_cli.report import render_report

    p = await _progress(client.get_workflow_handle(args.run))
    try:
        out = render_report(p, Path(args.out or f"{args.run}-report.png"))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(p.steps)} steps)")
    return 0


async def cmd_signal(client: Client, args: argparse.Namespace) -> int:
    await client.get_workflow_handle(args.run).signal(args.command)
    print(f"{args.command} sent to {args.run}")
    return 0


def parse_assignments(items: list[str]) -> HParamUpdate:
    """``KEY=VALUE`` pairs -> a validated update of the ``train`` section. Values are
    read as YAML scalars or lists: ``lr=1e-5``, ``ppo_epochs=2``, ``betas=[0.9,0.95]``."""
    fields: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        try:
            fields[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ValueError(f"{key}: cannot read {value!r}: {err}") from None
    try:
        return HParamUpdate(**fields)
    except ValidationError as err:
        raise ValueError("; ".join(_setting_error(e) for e in err.errors())) from None


def _setting_error(e: Any) -> str:
    key = ".".join(map(str, e["loc"]))
    if e["type"] == "extra_forbidden":
        return f"{key}: unknown key (settable: {', '.join(HParamUpdate.model_fields)})"
    return f"{key}: {e['msg']}"


async def cmd_set(client: Client, args: argparse.Namespace) -> int:
    try:
        update = parse_assignments(args.assignments)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = await client.get_workflow_handle(args.run).execute_update("set_hparams", update)
    print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="milestone", description="Durable RL post-training on Temporal")
    p.add_argument("--address", default=None, help="Temporal frontend (default localhost:7233)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start a run from a YAML config")
    s.add_argument("config")
    s.add_argument("--run-id", default=None)
    s.add_argument("--wait", action="store_true", help="watch until the run ends")
    s.add_argument(
        "--resume-from", default=None, metavar="RUN_OR_CHECKPOINT_URI",
        help="continue a run after its newest durable checkpoint (or <store>/runs/<run>/checkpoints/step-N)",
    )
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
    se = sub.add_parser(
        "set", help="change any `train` setting between steps, e.g. lr=1e-5 ppo_epochs=2 betas=[0.9,0.95]"
    )
    se.add_argument("run")
    se.add_argument("assignments", nargs="+")
    return p


async def amain(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "start":  # validate the config before connecting
        try:
            load_run_config(args.config)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    client = await connect(args.address)
    if args.command == "start":
        return await cmd_start(client, args)
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


def main() -> None:
    code = asyncio.run(amain())
    # leave without interpreter teardown: the Temporal core can crash there
    # (PyGILState_Release, sdk-python #300) after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
