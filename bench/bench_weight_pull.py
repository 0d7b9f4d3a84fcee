"""A policy version pulled from the trainer's node (``http_pull.pull_version``) against raw TCP on the same link.

A rollout node on another machine fetches each new version from the trainer's node over
HTTP (``gpu_runtime.weight_sync.http_server.WeightServer``), streamed into a local model
folder and checked tensor by tensor (sha256). This measures, in one run and taking turns so
the machine's drift falls on both:

- ``raw TCP``: the same byte count sent from memory by one socket and received into a
  preallocated buffer by another (``measure_raw_tcp``: the link's ceiling for one stream);
- ``pull``: ``pull_version`` of the version folder from a ``WeightServer`` (manifest cached:
  a version is hashed once on the server, however many nodes pull it), written to local disk
  and verified (``measure_pull``);
- ``pull (spare file)``: the same, its weights file written over a pruned version's
  (``spares``, as the trainer's export is written; ``model_folder.spares_for``);
- the first pull, which also waits for the server's manifest (every tensor hashed once);
- ``disk write``: the same bytes written to a fresh file beside the pulled folders: the
  puller's other bound (on this VM a fresh file's first pages are slow to allocate).

The model folder is written by the project's writer (``write_model_folder``) at a shape:
``demo`` (examples/demo.yaml's model) or ``0.36b`` (Qwen2-0.5B's trunk, ``bench_export``'s);
``--size-mb`` instead writes random tensors of about that many MB. Prints bytes, seconds,
GB/s, pull / raw TCP and the CPU seconds per GB (this process: both ends; less sensitive to a
shared machine's load than the wall time) per row (medians over ``--repeats``), and the JSON
with ``--out``.
Loopback here; ``measure_raw_tcp``, ``serve_raw_tcp`` and ``measure_pull`` are importable so
a bench across hosts or network namespaces can run each end where it belongs. Not a test.

    .venv/bin/python -m bench.bench_weight_pull [--shape demo|0.36b] [--size-mb N] [--repeats 5] \
        [--host 127.0.0.1] [--dir PATH] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from bench.gpu_check import FULL_SHAPE  # noqa: E402
from gpu_runtime.models.causal_lm import exported_tensors  # noqa: E402
from gpu_runtime.models.hf_factory import train_bpe_tokenizer  # noqa: E402
from gpu_runtime.models.model_folder import WEIGHTS_FILE, read_meta, write_model_folder  # noqa: E402
from gpu_runtime.models.safetensors_file import Spares  # noqa: E402
from gpu_runtime.models.tokenizer import Tokenizer  # noqa: E402
from gpu_runtime.weight_sync.http_pull import PullStats, pull_version  # noqa: E402
from gpu_runtime.weight_sync.http_server import WeightServer  # noqa: E402

SHAPES = {"0.36b": FULL_SHAPE,
          "demo": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 4}}
BUF_BYTES = 8 << 20
RUN_ID = "bench-pull"
ROWS = ("raw TCP", "pull", "pull (spare file)", "first pull (manifest computed)", "disk write (fresh file)")


def write_version_folder(folder: Path, shape: str | None, size_mb: int | None, version: int = 1) -> str:
    """A model folder at ``shape`` (random init), or with ~``size_mb`` MB of random tensors;
    returns its checksum."""
    cfg = Qwen2Config(vocab_size=2048, **SHAPES[shape or "demo"])
    torch.manual_seed(0)
    if size_mb is None:
        weights = {k: v.contiguous() for k, v in exported_tensors(Qwen2ForCausalLM(cfg).float()).items()}
    else:  # 16 MB tensors (the last one shorter): the count of tensors of a mid-size model's layers
        left, weights, i = size_mb * 10**6 // 4, {}, 0
        while left > 0:
            n = min(left, 4 * 2**20)
            weights[f"model.blob.{i}.weight"] = torch.randn(n)
            left, i = left - n, i + 1
    tok = Tokenizer(train_bpe_tokenizer(["1+2=3", "hello world", "the answer is 42"], 300))
    return write_model_folder(cfg, None, tok, folder, weight_version=version, weights=weights)


def send_to_first_client(srv: socket.socket, nbytes: int) -> None:
    """Send ``nbytes`` from memory to the first client of ``srv``, then close both."""
    with srv:
        conn, _ = srv.accept()
        with conn:
            data = memoryview(bytearray(BUF_BYTES))
            left = nbytes
            while left:
                n = min(left, len(data))
                conn.sendall(data[:n])
                left -= n


def serve_raw_tcp(host: str, nbytes: int) -> tuple[int, threading.Thread]:
    """A listening socket on ``host`` (a free port) that sends ``nbytes`` from memory to the
    first client and closes; (the port, the sending thread)."""
    srv = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    port = srv.getsockname()[1]

    def send() -> None:
        send_to_first_client(srv, nbytes)

    t = threading.Thread(target=send, name="raw-tcp-sender", daemon=True)
    t.start()
    return port, t


def measure_raw_tcp(host: str, nbytes: int, port: int | None = None) -> float:
    """Seconds to receive ``nbytes`` over one TCP stream into a preallocated buffer (from a
    ``serve_raw_tcp`` at ``host:port``; without ``port``, one started here)."""
    sender = None
    if port is None:
        port, sender = serve_raw_tcp(host, nbytes)
    buf = memoryview(bytearray(BUF_BYTES))
    with socket.create_connection((host, port)) as s:
        t0 = time.perf_counter()
        got = 0
        while got < nbytes:
            n = s.recv_into(buf, min(len(buf), nbytes - got))
            if not n:
                raise ConnectionError(f"raw TCP from {host}:{port}: closed after {got} of {nbytes} bytes")
            got += n
        seconds = time.perf_counter() - t0
    if sender is not None:
        sender.join()
    return seconds


def measure_pull(url: str, run_id: str, version: int, checksum: str, dst: Path, token: str | None = None,
                 spares: Spares | None = None) -> PullStats:
    """One ``pull_version`` into ``dst`` (removed first if there; with ``spares``, its weights
    file kept there to be written over, as a node prunes a version)."""
    if spares is not None and (dst / WEIGHTS_FILE).exists():
        spares.salvage(dst / WEIGHTS_FILE)
    shutil.rmtree(dst, ignore_errors=True)
    return pull_version(url, run_id, version, checksum, dst, token, spares=spares)


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``fn()``."""
    c0, t0 = os.times(), time.perf_counter()
    fn()
    c1, t1 = os.times(), time.perf_counter()
    return t1 - t0, c1.user - c0.user + c1.system - c0.system


def measure_disk_write(folder: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` from memory to a fresh file in ``folder`` (then deleted)."""
    path = folder / "disk-write.bin"
    buf = memoryview(bytearray(BUF_BYTES))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, buf[:min(left, len(buf))])
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.36b", choices=sorted(SHAPES))
    ap.add_argument("--size-mb", type=int, default=None, help="random tensors of about this size instead of a shape")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--dir", default=None, help="where the served and the pulled folders go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(a.dir or tempfile.mkdtemp(prefix="bench-pull-"))
    shutil.rmtree(root, ignore_errors=True)
    src, pulled = root / "served" / "v000001", root / "pulled"
    pulled.mkdir(parents=True)
    checksum = write_version_folder(src, None if a.size_mb else a.shape, a.size_mb)
    assert read_meta(src)["checksum"] == checksum
    os.sync()  # the folder's writeback, out of the measured window
    server = WeightServer(a.host, resolve=lambda run, version, c: src).start()
    spares = Spares(root / "spares")
    first: list[PullStats] = []
    rows: dict[str, list[tuple[float, float]]] = {k: [] for k in ROWS}
    try:
        rows["first pull (manifest computed)"].append(
            _timed(lambda: first.append(measure_pull(server.url, RUN_ID, 1, checksum, pulled / "v000001"))))
        nbytes = first[0].bytes
        for _ in range(a.repeats):  # taking turns
            rows["raw TCP"].append(_timed(lambda: measure_raw_tcp(a.host, nbytes)))
            rows["pull"].append(_timed(lambda: measure_pull(server.url, RUN_ID, 1, checksum, pulled / "v000001")))
            rows["pull (spare file)"].append(_timed(lambda: measure_pull(server.url, RUN_ID, 1, checksum,
                                                                         pulled / "v000002", spares=spares)))
            rows["disk write (fresh file)"].append(_timed(lambda: measure_disk_write(pulled, nbytes)))
    finally:
        server.stop()
    wall = {k: statistics.median(w for w, _ in v) for k, v in rows.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in rows.items()}
    tcp, gb = wall["raw TCP"], nbytes / 1e9
    what = f"--size-mb {a.size_mb}" if a.size_mb else a.shape
    print(f"\n{what}: {gb:.3f} GB in {first[0].files} files, {a.host}, {os.cpu_count()} CPUs, median of {a.repeats}")
    print(f"{'':<32} {'seconds':>8} {'GB/s':>7} {'/ raw TCP':>10} {'CPU s/GB':>9}")
    out: dict[str, object] = {"shape": what, "bytes": nbytes, "files": first[0].files, "host": a.host,
                              "repeats": a.repeats, "cpus": os.cpu_count(), "rows": {}}
    for k in ROWS:
        print(f"{k:<32} {wall[k]:>8.3f} {gb / wall[k]:>7.2f} {tcp / wall[k]:>9.0%} {cpu[k] / gb:>9.2f}")
        out["rows"][k] = {"seconds": round(wall[k], 4), "gb_s": round(gb / wall[k], 3),  # type: ignore[index]
                          "fraction_of_raw_tcp": round(tcp / wall[k], 3), "cpu_s_per_gb": round(cpu[k] / gb, 3),
                          "all": rows[k]}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
