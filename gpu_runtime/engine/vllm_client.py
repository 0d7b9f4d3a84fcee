"""The engine calls the fleet makes, sent to a vLLM server through vLLM's own routes.

``EngineFleet`` speaks one engine contract (SGLang's native API, which the torch engine serves);
this client keeps that contract and translates each call:

- ``generate``: one ``/inference/v1/generate`` request per prompt (token ids in, token ids and the
  sampled tokens' logprobs out), all of a chunk's prompts in flight at once on the same server, which
  batches them. Prompt ``i`` of a chunk sampled with seed ``s`` samples with ``derive_seed(s, i)``,
  the seed the torch engine gives its row ``i``. vLLM labels every output token with the weight
  version that sampled it; a sample whose tokens span two versions is refused.
- ``check_health_generate``: a one-token generation, as SGLang's ``/health_generate`` does.
- ``update_weights_from_disk``: ``/pause`` (in-flight requests finish), the workers load the folder
  (``/collective_rpc milestone_load_folder``: vLLM's ``load_weights``; its own ``reload_weights``
  breaks a CPU model), ``/reset_prefix_cache`` (no KV computed by the old weights is reused),
  ``/update_weight_version``, ``/resume``.
- ``weights_checksum``: the worker extension ``vllm_worker.WeightsChecksum`` hashes the served weights
  the way ``model_folder.weights_checksum`` hashes the trainer's (``/collective_rpc``), and
  ``/weight_info`` gives the version.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.store.artifacts import derive_seed

GENERATE = "/inference/v1/generate"
CHECKSUM_METHOD = "milestone_weights_checksum"  # vllm_worker.WeightsChecksum
LOAD_METHOD = "milestone_load_folder"  # vllm_worker.WeightsChecksum
MAX_IN_FLIGHT = 64  # requests of one chunk sent at once (vLLM schedules them as one batch)


def vllm_sampling(sp: dict[str, Any], seed: int | None, return_logprob: bool) -> dict[str, Any]:
    """vLLM ``SamplingParams`` for one prompt from the engine contract's (SGLang's) names."""
    temperature = float(sp.get("temperature", 1.0))
    out: dict[str, Any] = {
        "max_tokens": int(sp.get("max_new_tokens", 128)),
        "temperature": temperature,
        "top_p": float(sp.get("top_p", 1.0)),
        "top_k": int(sp.get("top_k", -1)) if int(sp.get("top_k", -1)) > 0 else 0,  # 0: no top-k in vLLM
        "logprobs": 0 if return_logprob else None,  # the sampled token's own logprob only
        "detokenize": False,
    }
    if temperature > 0 and seed is not None:
        out["seed"] = seed
    stop = sp.get("stop")
    if stop:
        out["stop"] = [stop] if isinstance(stop, str) else list(stop)
        out["include_stop_str_in_output"] = True  # token ids keep every generated token either way
        out["detokenize"] = True  # stop strings are matched on text
    if sp.get("stop_token_ids"):
        out["stop_token_ids"] = [int(t) for t in sp["stop_token_ids"]]
    return out


def to_contract(choice: dict[str, Any], url: str) -> dict[str, Any]:
    """One vLLM choice as the engine contract's result (``output_ids``, ``meta_info``)."""
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    versions = {str(span["version"]) for span in choice.get("weight_versions") or []}
    if len(versions) > 1:
        raise EngineError(url, f"a sample's tokens came from weight versions {sorted(versions)}")
    meta: dict[str, Any] = {
        "finish_reason": {"type": choice.get("finish_reason") or "stop"},
        "completion_tokens": len(ids),
        "weight_version": versions.pop() if versions else None,
        "output_token_logprobs": [[float(c["logprob"]), int(c["token_id"]), None] for c in content],
    }
    if choice.get("stop_reason") is not None:
        meta["finish_reason"]["matched"] = choice["stop_reason"]
    return {"output_ids": ids, "meta_info": meta}


class VLLMEngineClient(EngineClient):
    def __init__(self, base_url: str, timeout_s: float = 600.0, *, token: str | None = None) -> None:
        super().__init__(base_url, timeout_s, token=token)
        self._fanout: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._fanout is not None:
            self._fanout.shutdown(wait=False, cancel_futures=True)
            self._fanout = None
        super().close()

    def _one(self, prompt: list[int], params: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        out = self._request("POST", GENERATE, json={"token_ids": prompt, "sampling_params": params,
                                                    "output_mode": "tokens"}, timeout_s=timeout_s)
        choices = out.get("choices") if isinstance(out, dict) else None
        if not choices:
            raise EngineError(self.base_url + GENERATE, f"no choices in {out!r:.200}")
        return to_contract(choices[0], self.base_url)

    def generate(
        self, batch_input_ids: list[list[int]], sampling_params: dict[str, Any] | list[dict[str, Any]],
        return_logprob: bool = True,
    ) -> list[dict[str, Any]]:
        """The chunk's prompts at once; prompt ``i`` seeded ``derive_seed(sampling_seed, i)`` (a list of
        sampling params: each prompt's own ``sampling_seed``, as given)."""
        per_row = sampling_params if isinstance(sampling_params, list) else None
        if per_row is not None and len(per_row) != len(batch_input_ids):
            raise ValueError(f"{len(per_row)} sampling params for {len(batch_input_ids)} prompts")
        params = []
        for i in range(len(batch_input_ids)):
            sp = per_row[i] if per_row is not None else sampling_params
            assert isinstance(sp, dict)
            seed = sp.get("sampling_seed")
            row_seed = None if seed is None else (int(seed) if per_row is not None else derive_seed(int(seed), i))
            params.append(vllm_sampling(sp, row_seed, return_logprob))
        if self._fanout is None:
            self._fanout = ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT, thread_name_prefix="vllm-client")
        futures = [self._fanout.submit(self._one, p, sp) for p, sp in zip(batch_input_ids, params)]
        return [f.result() for f in futures]

    def check_health_generate(self, timeout_s: float) -> None:
        self._one([0], {"max_tokens": 1, "temperature": 0.0, "detokenize": False}, timeout_s=timeout_s)

    def _post(self, route: str, body: Any = None, method: str = "POST", timeout_s: float | None = None) -> Any:
        """An empty (not JSON) 200 answer is None (vLLM answers some routes, /health among them, with no body)."""
        try:
            return self._request(method, route, json=body, timeout_s=timeout_s)
        except EngineError as e:
            if e.status != 200:
                raise
            return None

    def health(self) -> bool:
        try:
            self._post("/health", method="GET", timeout_s=min(self.timeout_s, 5.0))
            return True
        except EngineError:
            return False

    def update_weights_from_disk(self, path: str, version: int | str | None = None) -> dict[str, Any]:
        self._post("/pause?mode=wait")
        try:
            self._rpc(LOAD_METHOD, path=str(path))
            self._post("/reset_prefix_cache")
            if version is not None:
                self.set_weight_version(version)
        finally:
            self._post("/resume")
        return {"success": True}

    def set_weight_version(self, version: int | str) -> None:
        self._post("/update_weight_version", {"new_version": str(version)})

    def _rpc(self, method: str, **kwargs: str) -> list[Any]:
        out = self._post("/collective_rpc", {"method": method, "kwargs": kwargs})
        return list((out or {}).get("results") or [])

    def weights_checksum(self) -> tuple[str, str]:
        sums = self._rpc(CHECKSUM_METHOD)
        if len(sums) != 1:  # one worker (tensor parallel 1): its weights are whole
            raise EngineError(self.base_url, f"{len(sums)} workers answered the checksum; one expected")
        version = self._request("GET", "/weight_info").get("weight_version")
        return str(sums[0]), str(version)

    def flush_cache(self) -> str:
        """vLLM's /reset_prefix_cache answers no body: an empty text where SGLang answers plain text."""
        self._post("/reset_prefix_cache")
        return ""
