"""A torch rollout engine speaking a subset of SGLang's native HTTP API.

    python -m gpu_runtime.engine.server --model-path DIR --port P [--host 127.0.0.1] [--threads N] [--device cuda:0]

Routes: POST /generate, GET /health, GET /health_generate,
POST /update_weights_from_disk, POST /update_weights_from_shared_memory (ours, not SGLang's),
POST /init_weights_update_group, POST /update_weights_from_distributed, POST /destroy_weights_update_group
(SGLang's distributed weight update, ``gpu_runtime.weight_sync.distributed``), POST /flush_cache, GET /get_model_info (and
/model_info), GET /get_server_info (and /server_info), GET /weights_checksum, POST /release_memory_occupation
and /resume_memory_occupation (SGLang's; ``gpu_runtime.engine.memory_occupation``).
Generation and weight updates are serialized by one lock; the info routes do
not take it, so they answer while a batch is decoding. Logs go to stderr; the
only stdout line is ``READY <url>``.

With ``$MILESTONE_ENGINE_TOKEN`` set every route but the two health probes answers
401 unless the request carries ``Authorization: Bearer <token>``; a non-loopback ``--host`` without a token
is refused at start (see ``gpu_runtime.engine.auth``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.proc.auth import authorized, check_exposure, engine_token, refuse_unauthorized
from gpu_runtime.engine.generate import GenResult, generate_batch
from gpu_runtime.engine.memory_occupation import EngineReleased, MemoryOccupation, release_route, resume_route
from transformers import PreTrainedModel

from gpu_runtime.proc.processes import exit_when_parent_dies
from gpu_runtime.proc.rpc import send_json, serve_until_interrupted
from gpu_runtime.models.causal_lm import load_exported_state_dict, to_device
from gpu_runtime.models.model_folder import load_model_folder, load_weights_into, model_checksum, weights_checksum
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.weight_sync import shared_memory
from gpu_runtime.weight_sync.distributed import EngineGroups, GroupError

log = logging.getLogger("gpu_runtime.engine.server")

# answered without a token, as SGLang's API-key check does: liveness only, no data;
# sglang-router 0.3.2 probes workers without credentials
OPEN_ROUTES = ("/health", "/health_generate")
# /health_generate answers 200 without queueing while a batch made progress this recently
BUSY_PROGRESS_OK_S = 5.0


class EngineState:
    def __init__(
        self, model_path: str, weight_version: str | None, step_delay_s: float = 0.0, device: str = "cpu"
    ) -> None:
        self.lock = threading.Lock()
        self.step_delay_s = step_delay_s
        self.device = device
        self.model_path = str(Path(model_path).resolve())
        model, tok, meta = load_model_folder(self.model_path)
        self.model: PreTrainedModel = to_device(model, device)  # float32 on every device (the checksum is of these bytes)
        self.tokenizer: Tokenizer = tok
        self.weight_version = str(weight_version if weight_version is not None else meta.get("weight_version", 0))
        self.checksum = model_checksum(model)
        self.busy = False
        self.last_progress = time.monotonic()
        self.num_generate_requests = 0
        self.num_generated_tokens = 0
        self.memory = MemoryOccupation(device)  # engines.release_memory: weights on the host between rollouts
        self.weight_groups = EngineGroups()  # engines.weight_sync distributed
        log.info("loaded %s version=%s checksum=%s", self.model_path, self.weight_version, self.checksum[:12])

    def _step(self, _step: int) -> None:
        self.last_progress = time.monotonic()
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)

    def generate(self, body: dict[str, Any]) -> Any:
        raw = body.get("input_ids")
        if raw is None:
            raise ValueError("input_ids is required (this engine takes token ids, not text)")
        is_batch = bool(raw) and isinstance(raw[0], list)
        prompts: list[list[int]] = raw if is_batch else [raw]
        sp = body.get("sampling_params") or {}
        if isinstance(sp, list):
            raise ValueError("sampling_params must be one dict for the whole batch")
        max_new = int(sp.get("max_new_tokens", 128))
        temperature = float(sp.get("temperature", 1.0))
        top_p = float(sp.get("top_p", 1.0))
        top_k = int(sp.get("top_k", -1))
        seed = int(sp.get("sampling_seed", 0) or 0)
        stop_ids = [int(t) for t in (sp.get("stop_token_ids") or [])]
        stop = sp.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)  # SGLang takes one string or a list
        if any(not isinstance(x, str) or not x for x in stop):
            raise ValueError("sampling_params.stop must be a non-empty string or a list of them")
        vocab = self.model.config.vocab_size
        for p in prompts:
            if not p or any((not isinstance(t, int)) or t < 0 or t >= vocab for t in p):
                raise ValueError(f"each prompt must be a non-empty list of token ids in [0, {vocab})")
        with self.lock:
            self.memory.refuse_if_released("generate")
            self.busy = True
            self.last_progress = time.monotonic()
            try:
                results = generate_batch(
                    self.model, prompts, max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                    top_k=top_k, seed=seed, eos_id=self.tokenizer.eos_token_id,
                    pad_id=self.tokenizer.pad_token_id, stop_token_ids=stop_ids, stop=stop,
                    decode=self.tokenizer.decode, on_step=self._step,
                )
            finally:
                self.busy = False
            version = self.weight_version
            self.num_generate_requests += 1
            self.num_generated_tokens += sum(len(r.output_ids) for r in results)
        want_lp = bool(body.get("return_logprob", False))
        out = [self._response(p, r, want_lp, version) for p, r in zip(prompts, results)]
        return out if is_batch else out[0]

    def _response(self, prompt: list[int], r: GenResult, want_lp: bool, version: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": {"type": r.finish_reason},
            "prompt_tokens": len(prompt),
            "completion_tokens": len(r.output_ids),
            "weight_version": version,
        }
        if r.finish_reason == "stop" and r.matched is not None:
            meta["finish_reason"]["matched"] = r.matched
        if want_lp:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.output_ids)]
        return {"text": self.tokenizer.decode(r.output_ids), "output_ids": r.output_ids, "meta_info": meta}

    def health_generate(self) -> bool:
        if self.memory.is_released:  # asleep on purpose, not dead: answered without the device
            return True
        if self.busy and time.monotonic() - self.last_progress < BUSY_PROGRESS_OK_S:
            return True
        with self.lock:
            generate_batch(self.model, [[self.tokenizer.eos_token_id]], max_new_tokens=1, temperature=0.0)
        return True

    def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("model_path")
        if not path:
            raise ValueError("model_path is required")
        path = str(Path(path).resolve())
        with self.lock:
            meta = load_weights_into(self.model, path)
            self.model_path = path
            self.weight_version = str(body.get("weight_version") or meta.get("weight_version", self.weight_version))
            self.checksum = model_checksum(self.model)
        log.info("updated weights from %s version=%s checksum=%s", path, self.weight_version, self.checksum[:12])
        return {"success": True, "message": f"loaded {path}", "num_paused_requests": 0}

    def update_weights_from_shared_memory(self, body: dict[str, Any]) -> dict[str, Any]:
        """Milestone's own route (``gpu_runtime.weight_sync.shared_memory``): load the
        segment at ``path``, refused unless it holds ``weight_version`` and its bytes match
        its checksum (the engine keeps its weights then)."""
        path, version = body.get("path"), body.get("weight_version")
        if not path or version is None:
            raise ValueError("path and weight_version are required")
        with self.lock:
            seg = shared_memory.load_into(self.model, path, version=str(version), checksum=body.get("checksum"))
            self.weight_version = seg.version
            self.checksum = model_checksum(self.model)
        log.info("updated weights from shared memory %s version=%s checksum=%s", path, self.weight_version,
                 self.checksum[:12])
        return {"success": True, "message": f"loaded {path}", "num_paused_requests": 0}

    def update_weights_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's route: receive every tensor of the manifest by broadcast from rank 0,
        then load them, refused (weights kept) unless their ``weights_checksum`` is the
        expected ``checksum`` (ours; SGLang has none). The receive does not hold the
        generation lock: the engine serves its old version until the new one is whole."""
        version = body.get("weight_version")
        if version is None:
            raise ValueError("weight_version is required")
        t0 = time.perf_counter()
        tensors = self.weight_groups.receive(body, self.device)
        got = weights_checksum(tensors)
        expected = body.get("checksum")
        if expected is not None and got != expected:
            raise ValueError(f"received weights hash to {got[:12]}, expected {str(expected)[:12]}: not loaded")
        with self.lock:
            with torch.no_grad():
                load_exported_state_dict(self.model, tensors)
            self.weight_version = str(version)
            self.checksum = model_checksum(self.model)
        log.info("updated weights from distributed group %s version=%s checksum=%s in %.3fs",
                 body.get("group_name"), self.weight_version, self.checksum[:12], time.perf_counter() - t0)
        return {"success": True, "message": f"received {len(tensors)} tensors", "num_paused_requests": 0}

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": self.weight_version,
        }

    def weights_by_name(self, body: dict[str, Any]) -> list:
        with self.lock:
            return _weights_by_name(self.model, body)

    def server_info(self) -> dict[str, Any]:
        return {
            "engine": "milestone-torch",
            "pid": os.getpid(),
            "model_path": self.model_path,
            "weight_version": self.weight_version,
            "checksum": self.checksum,
            "model_config": self.model.config.to_diff_dict() | {"model_type": self.model.config.model_type},
            "torch_threads": torch.get_num_threads(),
            "device": self.device,
            "busy": self.busy,
            "num_generate_requests": self.num_generate_requests,
            "num_generated_tokens": self.num_generated_tokens,
            "memory_occupation": self.memory.info(),
        }


def _weights_by_name(model: PreTrainedModel, body: dict[str, Any]) -> list:
    """SGLang's ``/get_weights_by_name``: ``param[:truncate_size]`` as nested lists."""
    name = body.get("name")
    params = dict(model.named_parameters())
    if name not in params:
        raise ValueError(f"unknown parameter name {name!r}")
    rows = int(body.get("truncate_size", 100))
    return params[name].detach()[:rows].tolist()


Route = Callable[[dict[str, Any]], Any]  # the request's JSON body -> the 200 answer


def _bodiless(answer: Callable[[], Any]) -> Route:
    return lambda _body: answer()


def engine_routes(state: EngineState) -> dict[tuple[str, str], Route]:
    """(method, path) -> what answers it."""

    def health() -> dict[str, str]:
        return {"status": "released" if state.memory.is_released else "ok"}

    def health_generate() -> dict[str, str]:
        state.health_generate()
        return health()

    model_info, server_info = _bodiless(state.model_info), _bodiless(state.server_info)
    return {
        ("GET", "/health"): _bodiless(health),
        ("GET", "/health_generate"): _bodiless(health_generate),
        ("POST", "/generate"): state.generate,
        ("POST", "/update_weights_from_disk"): state.update_weights_from_disk,
        ("POST", "/update_weights_from_shared_memory"): state.update_weights_from_shared_memory,
        ("POST", "/release_memory_occupation"): lambda b: release_route(state, b),
        ("POST", "/resume_memory_occupation"): lambda b: resume_route(state, b),
        ("POST", "/init_weights_update_group"): state.weight_groups.init,
        ("POST", "/update_weights_from_distributed"): state.update_weights_from_distributed,
        ("POST", "/destroy_weights_update_group"): state.weight_groups.destroy,
        ("POST", "/flush_cache"): _bodiless(lambda: {"success": True, "message": "cache flushed (no prefix cache)"}),
        ("GET", "/get_model_info"): model_info,
        ("GET", "/model_info"): model_info,
        ("GET", "/get_server_info"): server_info,
        ("GET", "/server_info"): server_info,
        ("POST", "/get_weights_by_name"): state.weights_by_name,
        ("GET", "/weights_checksum"): _bodiless(
            lambda: {"checksum": state.checksum, "weight_version": state.weight_version}
        ),
    }


class EngineHandler(BaseHTTPRequestHandler):
    """One HTTP request to the engine, answered by its ``routes`` (``make_handler`` sets them and the ``token``)."""

    protocol_version = "HTTP/1.1"
    routes: dict[tuple[str, str], Route] = {}
    token: str | None = None

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, code: int, obj: Any) -> None:
        send_json(self, code, obj)

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        if n == 0:
            return {}
        obj = json.loads(self.rfile.read(n))
        if not isinstance(obj, dict):
            raise ValueError("request body must be a JSON object")
        return obj

    def _refuse(self) -> None:
        self.close_connection = True  # the unread body must not be taken for the next request
        refuse_unauthorized(self, "unauthorized: send Authorization: Bearer <token>")

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        token = self.token
        if token is not None and path not in OPEN_ROUTES and not authorized(self.headers.get("Authorization"), token):
            log.warning("%s %s from %s refused: no valid bearer token", method, path, self.address_string())
            self._refuse()
            return
        try:
            body = self._body() if method == "POST" else {}
            route = self.routes.get((method, path))
            if route is None:
                self._send(404, {"error": f"no route {method} {path}"})
            else:
                self._send(200, route(body))
        except EngineReleased as e:  # asleep between rollouts: retry after the resume
            log.warning("%s %s refused: %s", method, path, e)
            self._send(503, {"success": False, "error": str(e), "message": str(e)})
        except (ValueError, KeyError, FileNotFoundError, json.JSONDecodeError, GroupError) as e:
            log.warning("%s %s failed: %s", method, path, e)
            self._send(400, {"success": False, "error": str(e), "message": str(e)})
        except Exception as e:  # noqa: BLE001 - report any engine failure as 500
            log.exception("%s %s crashed", method, path)
            self._send(500, {"success": False, "error": repr(e), "message": repr(e)})

    def do_GET(self) -> None:  # noqa: N802
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")


def make_handler(state: EngineState, token: str | None = None) -> type[BaseHTTPRequestHandler]:
    """The request handler class of an engine serving ``state`` (``token``: the bearer token every
    route but ``OPEN_ROUTES`` requires)."""
    return type("Handler", (EngineHandler,), {"routes": engine_routes(state), "token": token})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--weight-version", default=None, help="override the folder's weight_version")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the model runs (sampling stays on CPU)")
    ap.add_argument("--step-delay-ms", type=float, default=0.0, help="fault-injection aid: sleep per decode step")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    token = engine_token()
    try:
        check_exposure(args.host, token)
    except ValueError as err:
        ap.error(str(err))
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(),
        format=f"%(asctime)s engine:{args.port} %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(max(1, args.threads))
    state = EngineState(args.model_path, args.weight_version, args.step_delay_ms / 1000.0, args.device)
    if args.parent_pid:
        exit_when_parent_dies(args.parent_pid)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state, token))
    server.daemon_threads = True
    url = f"http://{args.host}:{args.port}"
    log.info("serving %s pid=%d", url, os.getpid())
    serve_until_interrupted(server, url)


if __name__ == "__main__":
    main()
