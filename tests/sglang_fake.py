"""A stand-in for one SGLang 0.5.23 server (``sglang.launch_server``), which needs CUDA: an
in-process HTTP server that answers the routes the fleet calls the way SGLang's
``python/sglang/srt/entrypoints/http_server.py`` does (read in the 0.5.23 wheel), records every
request for the contract check (tests/sglang_contract_check.py, against SGLang's own request
classes) and flags what would go wrong on a real one:

- ``GET /health`` and ``GET /health_generate`` answer 200 with an empty body; both run a
  one-token generation, ``/health`` only while ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``
  (default true) is on in the server's environment;
- a generation (``/generate`` or a generating probe) while the memory is released, or on weights
  lost by a release (``--enable-memory-saver`` without CPU backup) and not pushed since, is
  recorded in ``violations``;
- ``sampling_seed`` is honoured only under ``--enable-deterministic-inference``
  (``deterministic``); a single ``sampling_params`` dict is copied to every prompt;
- ``/get_weights_by_name`` answers ``param[:truncate_size]`` for Llama-family models (HF names,
  mapped by SGLang to its fused tensors' slices) and fails (HTTP 400) for Qwen2, which has no
  such method;
- ``/flush_cache`` answers plain text; the memory routes answer ``null``.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from safetensors import safe_open

FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. "
           "(When there are running or waiting requests, the operation will not be performed.)\n")
READABLE = {"LlamaForCausalLM", "MistralForCausalLM"}


class FakeSGLang:
    def __init__(self, folder: str | Path, version: str, *, env: dict[str, str] | None = None,
                 deterministic: bool = False, keep_old_weights: bool = False) -> None:
        self.deterministic = deterministic
        flag = (env or {}).get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower()
        self.health_generates = flag not in ("false", "0", "no", "n")
        self.keep_old_weights = keep_old_weights  # a broken engine: answers success, loads nothing
        self.requests: list[tuple[str, str, Any]] = []
        self.violations: list[str] = []
        self.released = self.weights_lost = False
        self.generations = 0
        self._load(str(folder), version)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _load(self, folder: str, version: str | None) -> None:
        self.model_path, self.weight_version = folder, version
        config = json.loads((Path(folder) / "config.json").read_text())
        self.readable = bool(READABLE & set(config.get("architectures") or []))
        with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
            self.weights = {n: f.get_tensor(n) for n in f.keys()}
        self.weights_lost = False

    # ---- what a route does ----------------------------------------------------------
    def _generation(self, what: str) -> None:
        self.generations += 1
        if self.released:
            self.violations.append(f"{what} generated on released memory")
        elif self.weights_lost:
            self.violations.append(f"{what} generated on weights lost by a release and not pushed since")

    def generate(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        self._generation("/generate")
        prompts = body["input_ids"]
        sp = body.get("sampling_params") or {}
        per_prompt = sp if isinstance(sp, list) else [sp] * len(prompts)  # SGLang copies one dict to each
        return [self._sample(p, params) for p, params in zip(prompts, per_prompt, strict=True)]

    def _sample(self, prompt: list[int], sp: dict[str, Any]) -> dict[str, Any]:
        seed = sp.get("sampling_seed") if self.deterministic else None
        rng = random.Random(f"{prompt}/{seed}" if seed is not None else None)  # no seed: fresh entropy
        ids = [rng.randrange(3, 50) for _ in range(min(int(sp.get("max_new_tokens", 128)), 4))]
        meta = {"id": hashlib.sha256(str(rng.random()).encode()).hexdigest()[:16],
                "finish_reason": {"type": "length", "length": len(ids)}, "prompt_tokens": len(prompt),
                "completion_tokens": len(ids), "weight_version": self.weight_version,
                "output_token_logprobs": [[-0.5, t, None] for t in ids]}
        return {"text": "", "output_ids": ids, "meta_info": meta}

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        self.requests.append((method, path, body))
        if path in ("/health", "/health_generate"):
            if path == "/health_generate" or self.health_generates:
                self._generation(f"GET {path}")
            return 200, b""
        if path == "/generate":
            return 200, self.generate(body)
        if path == "/get_model_info":
            return 200, {"model_path": self.model_path, "weight_version": self.weight_version,
                         "is_generation": True}
        if path == "/update_weights_from_disk":
            if not self.keep_old_weights:
                self._load(body["model_path"], body.get("weight_version"))
            return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        if path == "/get_weights_by_name":
            return self._weights_by_name(body)
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            self.released = path.startswith("/release")
            self.weights_lost = self.weights_lost or self.released  # no CPU backup of the weights
            return 200, None
        if path == "/flush_cache":
            return 200, FLUSHED.encode()
        if path in ("/init_weights_update_group", "/update_weights_from_distributed",
                    "/destroy_weights_update_group"):
            return 200, {"success": True, "message": "ok"}
        return 404, {"detail": "Not Found"}

    def _weights_by_name(self, body: dict[str, Any]) -> tuple[int, Any]:
        if not self.readable:  # Qwen2ForCausalLM has no get_weights_by_name: the runner answers None
            return 400, {"error": {"message": "Get parameter by name failed"}}
        t = self.weights[body["name"]]
        rows = (t * 0 if self.weights_lost else t)[: int(body.get("truncate_size", 100))]
        return 200, rows.float().tolist()


def _handler(engine: FakeSGLang) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            status, out = engine.route(self.command, self.path, json.loads(raw) if raw else None)
            data = out if isinstance(out, bytes) else json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _serve

        def log_message(self, *args: Any) -> None:
            pass

    return Handler
