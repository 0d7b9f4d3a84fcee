"""Synchronous HTTP client for an engine (torch or SGLang) or a router in front of engines.

Every request carries ``Authorization: Bearer <token>`` when a token is given or
``$MILESTONE_ENGINE_TOKEN`` is set (see ``gpu_runtime.engine.auth``)."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from gpu_runtime.engine.auth import bearer_headers, engine_token
from gpu_runtime.proc.http_client import http_client

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request to an engine failed: connection error, timeout or a non-200 answer."""

    def __init__(self, url: str, message: str, *, status: int | None = None, timeout: bool = False) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status
        self.timeout = timeout


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0, *, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = http_client(timeout=timeout_s, headers=bearer_headers(token or engine_token()))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self, method: str, route: str, *, json: Any = None, timeout_s: float | None = None, text: bool = False,
    ) -> Any:
        """The answer's JSON (its text with ``text``), or EngineError."""
        url = self.base_url + route
        try:
            resp = self._http.request(method, url, json=json, timeout=timeout_s or self.timeout_s)
        except httpx.TimeoutException as e:
            raise EngineError(url, f"timed out: {e!r}", timeout=True) from e
        except httpx.HTTPError as e:
            raise EngineError(url, f"request failed: {e!r}") from e
        if resp.status_code != 200:
            raise EngineError(url, f"HTTP {resp.status_code}: {resp.text[:500]}", status=resp.status_code)
        if text:
            return resp.text
        try:
            return resp.json()
        except ValueError as e:
            raise EngineError(url, f"not JSON: {resp.text[:200]!r}", status=200) from e

    def generate(
        self, batch_input_ids: list[list[int]], sampling_params: dict[str, Any] | list[dict[str, Any]],
        return_logprob: bool = True,
    ) -> list[dict[str, Any]]:
        """``sampling_params``: one dict for the batch, or SGLang's list of one per prompt."""
        body = {"input_ids": batch_input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        out = self._request("POST", "/generate", json=body)
        if isinstance(out, dict):
            out = [out]
        if not isinstance(out, list) or len(out) != len(batch_input_ids):
            raise EngineError(self.base_url + "/generate", f"expected {len(batch_input_ids)} results, got {out!r:.200}")
        return out

    def health(self) -> bool:
        try:
            self._request("GET", "/health", timeout_s=min(self.timeout_s, 5.0), text=True)
            return True
        except EngineError:
            return False

    def check_health(self, timeout_s: float) -> None:
        """Raise EngineError unless ``/health`` answers 200 (an empty body on SGLang, which with
        ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` generates nothing for it)."""
        self._request("GET", "/health", timeout_s=timeout_s, text=True)

    def check_health_generate(self, timeout_s: float) -> None:
        """Raise EngineError (``.timeout`` set when it timed out) unless a 1-token generation works
        (SGLang answers 200 with an empty body, the torch engine JSON: the body is not read)."""
        self._request("GET", "/health_generate", timeout_s=timeout_s, text=True)

    def health_generate(self, timeout_s: float) -> bool:
        try:
            self.check_health_generate(timeout_s)
            return True
        except EngineError as e:
            log.debug("health_generate failed: %s", e)
            return False

    def update_weights_from_disk(self, path: str, version: int | str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": str(path)}
        if version is not None:
            body["weight_version"] = str(version)
        out = self._request("POST", "/update_weights_from_disk", json=body)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(self.base_url, f"update_weights_from_disk failed: {out.get('message')}")
        return out

    def update_weights_from_shared_memory(self, path: str, version: int | str, checksum: str | None = None) -> dict[str, Any]:
        """Load a ``gpu_runtime.weight_sync.shared_memory`` segment (torch engines only)."""
        body: dict[str, Any] = {"path": str(path), "weight_version": str(version)}
        if checksum is not None:
            body["checksum"] = checksum
        out = self._request("POST", "/update_weights_from_shared_memory", json=body)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(self.base_url, f"update_weights_from_shared_memory failed: {out.get('message')}")
        return out

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """SGLang's route: free the engine's weights and KV cache on its device (tags: both
        when None) until ``resume_memory_occupation``; generation is refused meanwhile."""
        return self._request("POST", "/release_memory_occupation", json={"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._request("POST", "/resume_memory_occupation", json={"tags": tags})

    # ---- SGLang's distributed weight update (gpu_runtime.weight_sync.distributed) -----
    def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str, timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Join the group as rank ``rank_offset``; answers once every member joined.
        ``timeout_s`` (ours, sent to torch engines only) bounds the engine's wait."""
        body: dict[str, Any] = {"master_address": master_address, "master_port": master_port,
                                "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
                                "backend": backend}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return self._checked("/init_weights_update_group", body, None if timeout_s is None else timeout_s + 30)

    def update_weights_from_distributed(
        self, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        version: int | str, checksum: str | None = None, timeout_s: float | None = None, bucket_bytes: int = 0,
    ) -> dict[str, Any]:
        """Receive the broadcast tensors; ``checksum`` (ours, torch engines) is the
        expected ``weights_checksum``: the engine keeps its weights unless they match;
        ``bucket_bytes`` (ours): tensors come packed (``distributed.Manifest``)."""
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": True, "weight_version": str(version)}
        if bucket_bytes:
            body["bucket_bytes"] = bucket_bytes
        if checksum is not None:
            body["checksum"] = checksum
        return self._checked("/update_weights_from_distributed", body, timeout_s)

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return self._checked("/destroy_weights_update_group", {"group_name": group_name}, 30.0)

    def _checked(self, route: str, body: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        out = self._request("POST", route, json=body, timeout_s=timeout_s)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(self.base_url + route, f"failed: {out.get('message')}")
        return out

    def flush_cache(self) -> str:
        """SGLang answers plain text ("Cache flushed. ..."), not JSON; returned as it is."""
        return str(self._request("POST", "/flush_cache", text=True))

    def model_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_model_info")

    def server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")

    def weights_checksum(self) -> tuple[str, str]:
        out = self._request("GET", "/weights_checksum")
        return str(out["checksum"]), str(out["weight_version"])

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        """SGLang only: a parameter's (truncated) values, for spot-checking weight sync."""
        return self._request("POST", "/get_weights_by_name", json={"name": name, "truncate_size": truncate_size})
