"""Supervise an ``sglang-router`` (PyPI ``sglang-router``, Rust) subprocess in front of a node's engines.

Measured on 0.3.2: it forwards a batch ``/generate`` body to one worker and returns that
worker's JSON list; ``sampling_params.sampling_seed`` survives; unknown sampling fields are
dropped. Membership: ``POST /workers {"url"}``, ``GET /workers``, ``DELETE /workers/{id}``.
A restarted worker gets no traffic until the circuit breaker times out (60 s) unless it is
deleted and re-added, so the fleet removes dead engines at once and re-adds restarted ones.

With a token (default ``$MILESTONE_ENGINE_TOKEN``) the router answers 401 to any request
without ``Authorization: Bearer <token>`` (its ``--api-key``, passed through the
environment by ``keyed_launch``), and each worker is registered with the same key, which
the router sends to it. 0.3.2 probes a worker's ``/health`` without the key, so engines
leave the health routes open (see ``gpu_runtime.engine.server``).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from gpu_runtime.engine.auth import ENGINE_TOKEN_ENV, bearer_headers, check_exposure, engine_token
from gpu_runtime.proc.http_client import http_client
from gpu_runtime.proc.processes import die_with_parent, free_port

log = logging.getLogger(__name__)
_ROOT = str(Path(__file__).resolve().parents[2])  # keyed_launch must import from any cwd


class RouterError(RuntimeError):
    pass


class RouterProcess:
    def __init__(
        self,
        port: int,
        worker_urls: list[str] | None = None,
        policy: str = "round_robin",
        health_check_interval_s: int = 1,
        health_failure_threshold: int = 2,
        log_path: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        prometheus_port: int | None = None,
        request_timeout_s: int = 1800,
        extra_args: list[str] | None = None,
        token: str | None = None,
    ) -> None:
        if policy == "cache_aware":
            log.warning("policy cache_aware keeps sending to dead workers in sglang-router 0.3.2")
        self.token = token or engine_token()
        check_exposure(host, self.token, "router")
        self.host = host
        self.port = port
        self.initial_workers = list(worker_urls or [])
        self.policy = policy
        self.health_check_interval_s = health_check_interval_s
        self.health_failure_threshold = health_failure_threshold
        self.log_path = Path(log_path) if log_path else None
        self.prometheus_port = prometheus_port
        self.request_timeout_s = request_timeout_s
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self._http = http_client(timeout=30.0, headers=bearer_headers(self.token))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "gpu_runtime.engine.keyed_launch", "sglang_router.launch_router",
            "--host", self.host, "--port", str(self.port),
            "--policy", self.policy,
            "--health-check-interval-secs", str(self.health_check_interval_s),
            "--health-failure-threshold", str(self.health_failure_threshold),
            "--request-timeout-secs", str(self.request_timeout_s),
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(self.prometheus_port or free_port()),
            "--log-level", "warn",
        ]
        if self.initial_workers:
            cmd += ["--worker-urls", *self.initial_workers]
        return cmd + self.extra_args

    def start(self, timeout_s: float = 60.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        cmd = self.command()
        log.info("starting router: %s", " ".join(cmd))
        if self.log_path:  # a node's first engines may start before anything else made its logs folder
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            env = {**os.environ, "PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
            if self.token:
                env[ENGINE_TOKEN_ENV] = self.token
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                preexec_fn=die_with_parent,  # the Rust router cannot watch our pid itself
            )
        finally:
            if not isinstance(out, int):  # the log file, not subprocess.DEVNULL
                out.close()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RouterError(f"router exited with {self.proc.returncode}; see {self.log_path}")
            try:
                r = self._http.get(self.url + "/workers", timeout=2.0)
                # initial workers are registered asynchronously: wait until all are listed
                listed = {w.get("url") for w in r.json().get("workers", [])} if r.status_code == 200 else set()
                if r.status_code == 200 and set(self.initial_workers) <= listed:
                    log.info("router ready at %s pid=%s", self.url, self.pid)
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RouterError(f"router at {self.url} not ready within {timeout_s}s; see {self.log_path}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        else:
            proc.wait()
        log.info("router pid=%d stopped", proc.pid)

    def _call(self, method: str, route: str, **kw: Any) -> httpx.Response:
        try:
            return self._http.request(method, self.url + route, **kw)
        except httpx.HTTPError as e:
            raise RouterError(f"{method} {self.url}{route}: {e!r}") from e

    def list_workers(self) -> list[dict[str, Any]]:
        r = self._call("GET", "/workers")
        if r.status_code != 200:
            raise RouterError(f"GET /workers: HTTP {r.status_code} {r.text[:200]}")
        return list(r.json().get("workers", []))

    def worker_urls(self) -> set[str]:
        return {w["url"] for w in self.list_workers()}

    def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """Register ``url`` and wait until the router lists it.

        0.3.2 registers in a background job that probes the worker's ``/health`` and
        retries every 5 s on its own. It is POSTed once: a second POST starts a second job,
        which can list the url again after ``remove_worker`` (measured). On a timeout the
        error carries the router's last warnings, which say which probe failed."""
        body = {"url": url, "api_key": self.token} if self.token else {"url": url}
        r = self._call("POST", "/workers", json=body)
        if r.status_code not in (200, 201, 202):
            raise RouterError(f"add worker {url}: HTTP {r.status_code} {r.text[:200]}")
        deadline = time.monotonic() + timeout_s
        while url not in self.worker_urls():
            if time.monotonic() > deadline:
                raise RouterError(f"worker {url} not listed by the router within {timeout_s}s{self._log_tail()}")
            time.sleep(0.05)
        log.info("router: added %s", url)

    def _log_tail(self, lines: int = 5) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))
        tail = [ln[:400] for ln in text.splitlines() if "WARN" in ln or "ERROR" in ln][-lines:]
        return ("; router log " + str(self.log_path) + ":\n  " + "\n  ".join(tail)) if tail else ""

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> bool:
        """Delete every entry with this url and wait until it is unlisted (the router
        removes asynchronously); returns whether one existed."""
        found = False
        for w in self.list_workers():
            if w.get("url") == url:
                found = True
                r = self._call("DELETE", f"/workers/{w['id']}")
                if r.status_code not in (200, 202, 204, 404):
                    raise RouterError(f"remove worker {url}: HTTP {r.status_code} {r.text[:200]}")
        deadline = time.monotonic() + timeout_s
        while found and url in self.worker_urls():
            if time.monotonic() > deadline:
                raise RouterError(f"worker {url} still listed by the router after {timeout_s}s")
            time.sleep(0.05)
        if found:
            log.info("router: removed %s", url)
        return found

    def sync(self, urls: list[str] | set[str]) -> None:
        """Make the router's membership exactly ``urls``."""
        want = set(urls)
        have = self.worker_urls()
        for u in sorted(have - want):
            self.remove_worker(u)
        for u in sorted(want - have):
            self.add_worker(u)
