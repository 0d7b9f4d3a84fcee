"""One run whose store is a real S3 server (SeaweedFS), with payload encryption on.

- checkpoints survive the loss of the node's local disk: a crashed trainer restores from
  S3 and replays;
- the S3 credentials appear nowhere a run leaves text: no workflow history (every event
  of every run, children included, payloads decrypted), no log file of the stack, no
  line of the node agent's /metrics;
- with ``MILESTONE_PAYLOAD_KEY`` set, history holds ciphertext only, the run still
  completes, and the codec server (``python -m infra.codec_server``) decrypts a payload
  for the UI over real HTTP.

The stack and the run are shared by the module's tests (one run, several questions).
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from gpu_runtime.proc.processes import free_port, spawn, stop_pid
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.checkpoint_store import CheckpointStore
from infra.seaweedfs import SeaweedServer
from workflows.versioning import PATCHES
from tests.e2e.faults import progress, start_run, wait_activity_started
from tests.e2e.leaks import all_histories, log_files, occurrences, payloads_in
from tests.s3_fixtures import new_bucket_name, seaweed_fixture, store_for  # noqa: F401  (fixture)
from tests.stack import ROOT, Stack, tiny_config
from workers.payload_codec import ENCODING, EncryptionCodec
from workers.temporal_connection import connect_with, data_converter, settings_from_env
from workflows.run_state import RunProgress, RunSummary
from workflows.stubs import TRAIN_STEP

pytestmark = pytest.mark.e2e

PAYLOAD_KEY = base64.b64encode(os.urandom(32)).decode()
RUN = "s3-run"


@dataclass
class S3Run:
    stack: Stack
    bucket: str
    summary: RunSummary
    progress: RunProgress
    histories: dict[str, list[HistoryEvent]]
    metrics_text: bytes


@pytest.fixture(scope="module")
def s3_run(seaweed: SeaweedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Run]:  # noqa: F811
    workdir = tmp_path_factory.mktemp("s3-run")
    bucket = new_bucket_name()
    codec_env = {"MILESTONE_PAYLOAD_KEY": PAYLOAD_KEY}
    env = {
        "MILESTONE_S3_ENDPOINT": seaweed.endpoint_url,
        "AWS_ACCESS_KEY_ID": seaweed.access_key,
        "AWS_SECRET_ACCESS_KEY": seaweed.secret_key,
        "MILESTONE_FAULT_TRAIN_DELAY_S": "2",
        **codec_env,
    }
    stack = Stack(workdir, env=env)
    cfg = tiny_config(workdir, steps=3, store=f"s3://{bucket}/exp", checkpoint={"every": 1, "keep_last": 2})
    try:
        stack.start()

        async def main() -> S3Run:
            client = await connect_with(settings_from_env(stack.server.address), data_converter(codec_env))
            handle = await start_run(client, RUN, cfg)
            await wait_activity_started(client, f"{RUN}/step-2", TRAIN_STEP.name)
            # the node loses its disk copy of every checkpoint, then its trainer
            shutil.rmtree(workdir / "nodes" / "node0" / "trainer" / RUN / "checkpoints", ignore_errors=True)
            os.kill(stack.node_pids("node0")["trainer"], signal.SIGKILL)
            summary = await asyncio.wait_for(handle.result(), 300)
            p = await progress(client, RUN)
            histories = await all_histories(client)
            metrics_text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['node0']}/metrics", timeout=10).content
            return S3Run(stack, bucket, summary, p, histories, metrics_text)

        yield asyncio.run(main())
    finally:
        stack.stop()


def test_run_on_s3_survives_trainer_crash_and_local_disk_loss(s3_run: S3Run, seaweed: SeaweedServer) -> None:  # noqa: F811
    assert s3_run.summary.steps == 3
    # checkpoint 1 uploads in the background: if it was not durable yet, step 0 + replay
    restored = s3_run.progress.steps[1].restored_from_step
    assert restored in (0, 1)
    assert s3_run.progress.steps[1].replayed_steps == list(range(restored + 1, 2))
    s3 = store_for(seaweed, s3_run.bucket, "exp")
    workdir = s3_run.stack.workdir
    ckpts = CheckpointStore(s3, art.checkpoints_prefix(RUN), local_dir=workdir / "verify")
    assert [c.step for c in ckpts.list_durable()] == [2, 3]  # keep_last: 2
    restored_ckpt = ckpts.restore(workdir / "restored")
    assert restored_ckpt.step == 3 and restored_ckpt.meta["data_cursor"] == 12


def _secrets(seaweed: SeaweedServer) -> dict[str, bytes]:  # noqa: F811
    return {"S3 secret key": seaweed.secret_key.encode(), "S3 access key id": seaweed.access_key.encode(),
            "payload key": PAYLOAD_KEY.encode()}


def test_credentials_never_reach_history_logs_or_metrics(s3_run: S3Run, seaweed: SeaweedServer) -> None:  # noqa: F811
    runs = s3_run.histories
    assert f"{RUN}/step-1" in {k.rsplit("/", 1)[0] for k in runs} and len(runs) >= 4  # the run and its RLStep children
    codec = EncryptionCodec(base64.b64decode(PAYLOAD_KEY))
    blobs: dict[str, bytes] = {}
    for name, events in runs.items():
        blobs[f"history {name}"] = b"".join(e.SerializeToString() for e in events)
        plain = [codec.decrypt(p).data for e in events for _, p in payloads_in(e)]
        blobs[f"decrypted payloads of {name}"] = b"\n".join(plain)
    everything = b"".join(v for k, v in blobs.items() if k.startswith("decrypted"))
    assert s3_run.bucket.encode() in everything  # the grep reads the real inputs (the store URI is one)
    logs = log_files(s3_run.stack.workdir)
    names = {p.name for p in logs}
    assert {"temporal.log", "control.log", "gpu-node0.log", "router.log", "engine-0.log"} <= names, names
    blobs |= {f"log {p}": p.read_bytes() for p in logs}
    assert b"milestone_" in s3_run.metrics_text
    blobs["node0 /metrics"] = s3_run.metrics_text
    assert occurrences(_secrets(seaweed), blobs) == []


def test_history_holds_only_ciphertext(s3_run: S3Run) -> None:
    plaintext_paths, encrypted = [], 0
    for name, events in s3_run.histories.items():
        for e in events:
            assert s3_run.bucket.encode() not in e.SerializeToString(), (name, e.event_type)
            for path, p in payloads_in(e):
                if p.metadata.get("encoding") == ENCODING:
                    encrypted += 1
                elif "search_attributes" in path:  # indexed by the server: plain by design
                    continue
                elif "[patch-data]" in path:  # the SDK writes patch markers without the codec: a patch id
                    assert len(p.data) < 100 and any(i.encode() in p.data for i in PATCHES), p.data
                else:
                    plaintext_paths.append(f"{name} {EventType.Name(e.event_type)} {path}")
    assert encrypted > 50 and plaintext_paths == []


@pytest.fixture
def codec_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = spawn([sys.executable, "-m", "infra.codec_server", "--port", str(port)], tmp_path / "codec.log",
                 env={"MILESTONE_PAYLOAD_KEY": PAYLOAD_KEY, "PYTHONPATH": str(ROOT)}, stdout_pipe=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("READY"), (tmp_path / "codec.log").read_text()
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_pid(proc.pid, proc)


def test_codec_server_decodes_a_history_payload_for_the_ui(s3_run: S3Run, codec_server: str) -> None:
    started = next(e for e in s3_run.histories[_run_key(s3_run)]
                   if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
    sealed = Payloads(payloads=started.workflow_execution_started_event_attributes.input.payloads)
    assert sealed.payloads[0].metadata["encoding"] == ENCODING
    ui = {"Origin": "http://localhost:8233", "X-Namespace": "default", "Content-Type": "application/json"}
    pre = httpx.options(codec_server + "/default/decode", headers={
        "Origin": ui["Origin"], "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,x-namespace"}, timeout=10)
    assert pre.status_code == 200 and pre.headers["Access-Control-Allow-Origin"] == ui["Origin"]
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert "x-namespace" in pre.headers["Access-Control-Allow-Headers"].lower()
    r = httpx.post(codec_server + "/default/decode", content=json_format.MessageToJson(sealed), headers=ui, timeout=10)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ui["Origin"]
    decoded = json_format.Parse(r.content, Payloads())
    assert decoded.payloads[0].metadata["encoding"] == b"json/plain"
    assert f"s3://{s3_run.bucket}/exp".encode() in decoded.payloads[0].data
    # /encode seals again (the CLI's and UI's other direction); the round trip is exact
    again = httpx.post(codec_server + "/encode", content=r.content, headers=ui, timeout=10)
    assert again.status_code == 200
    back = httpx.post(codec_server + "/decode", content=again.content, headers=ui, timeout=10)
    assert json_format.Parse(back.content, Payloads()) == decoded
    # not a Payloads body; an origin that is not the UI's gets no CORS grant
    bad = httpx.post(codec_server + "/decode", content=b"{nope", headers=ui, timeout=10)
    assert bad.status_code == 400
    other = httpx.post(codec_server + "/decode", content=r.content, headers={**ui, "Origin": "http://evil.test"}, timeout=10)
    assert "Access-Control-Allow-Origin" not in other.headers


def _run_key(s3_run: S3Run) -> str:
    return next(k for k in s3_run.histories if k.rsplit("/", 1)[0] == RUN)
