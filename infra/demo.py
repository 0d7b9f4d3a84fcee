"""``make demo``: start the embedded stack, run the demo config to the end, summarise."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

from infra import devstack
from milestone_cli.config_file import load_run_config
from milestone_cli.main import ui_link, watch
from workers.common import connect
from workflows.run_state import TrainingRunInput
from workflows.queues import CONTROL_QUEUE
from workflows.training_run import TrainingRun


async def run_demo(config_path: str) -> int:
    cfg = load_run_config(config_path)
    client = await connect()
    run_id = f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    await client.start_workflow(
        TrainingRun.run, TrainingRunInput(config=cfg), id=run_id, task_queue=CONTROL_QUEUE,
        static_summary=f"{cfg.name}: {cfg.steps} RL steps",
    )
    print(f"run {run_id}: {cfg.steps} GRPO steps after a {cfg.sft.steps}-step SFT warm-up")
    print(f"watch it in the Temporal UI: {ui_link(run_id)}")
    code = await watch(client, run_id)
    print(f"Temporal UI of the run: {ui_link(run_id)}")
    print("the stack keeps running so the UI stays browsable; stop it with: make down")
    return code


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("config", nargs="?", default="examples/demo.yaml")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    devstack.up(s3=load_run_config(args.config).store.startswith("s3://"))
    code = asyncio.run(run_demo(args.config))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (sdk-python #300 crash at exit)


if __name__ == "__main__":
    main()
