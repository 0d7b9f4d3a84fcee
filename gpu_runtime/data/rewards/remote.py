"""Rewards from HTTP endpoints: a batch reward model (``http``) and a per-sample
judge (``judge``) whose results are recorded durably before they are used.

Both retry a request after a 5xx answer or a connection error (including a timeout)
with exponential backoff, ``max_retries`` times; then the scoring fails with a
retryable ``RewardError`` (the activity retries). A 4xx answer, a body that is not
JSON or not the expected shape fails with ``RewardFatal`` (retrying cannot help).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import httpx

from gpu_runtime.data.rewards.errors import RewardError, RewardFatal
from gpu_runtime.proc.http_client import http_client
from gpu_runtime.store.object_store import ObjectStore
from spec.reward import RewardTerm

log = logging.getLogger(__name__)
BACKOFF_S = 0.5  # first retry delay; doubles per retry, at most MAX_BACKOFF_S
MAX_BACKOFF_S = 8.0


@dataclass(frozen=True)
class RemoteItem:
    """What an endpoint sees of one sample (``index``: its position in the scored batch)."""

    index: int
    sample_id: str
    prompt: str
    response: str
    label: Any
    metadata: dict


def post_json(
    client: httpx.Client, url: str, payload: Any, *, timeout_s: float, max_retries: int, what: str,
    backoff_s: float = BACKOFF_S, headers: dict[str, str] | None = None,
) -> Any:
    """POST ``payload`` as JSON and return the decoded answer, retrying 5xx and connection errors."""
    last = ""
    for attempt in range(max_retries + 1):
        if attempt:
            time.sleep(min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
        try:
            resp = client.post(url, json=payload, timeout=timeout_s, headers=headers)
        except httpx.TransportError as err:  # refused, reset, timed out
            last = f"{type(err).__name__}: {err}"
            log.warning("%s: %s (attempt %d of %d)", what, last, attempt + 1, max_retries + 1)
            continue
        if resp.status_code >= 500:
            last = f"HTTP {resp.status_code}: {resp.text[:200]!r}"
            log.warning("%s: %s (attempt %d of %d)", what, last, attempt + 1, max_retries + 1)
            continue
        if not resp.is_success:
            raise RewardFatal(f"{what}: {url} answered HTTP {resp.status_code}: {resp.text[:200]!r}")
        try:
            return resp.json()
        except ValueError:
            raise RewardFatal(f"{what}: {url} answered something that is not JSON: {resp.text[:200]!r}") from None
    raise RewardError(f"{what}: {url} failed {max_retries + 1} times; last: {last}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def score_http(items: Sequence[RemoteItem], term: RewardTerm, *, backoff_s: float = BACKOFF_S) -> list[float]:
    """POST ``[{prompt, response, label, metadata}, ...]`` in batches of ``term.batch_size``;
    each answer must be a JSON list of as many finite numbers."""
    assert term.url and term.batch_size and term.max_retries is not None
    out: list[float] = []
    with http_client() as client:
        for start in range(0, len(items), term.batch_size):
            batch = items[start : start + term.batch_size]
            what = f"reward.kind http, samples {batch[0].sample_id}..{batch[-1].sample_id}"
            payload = [{"prompt": i.prompt, "response": i.response, "label": i.label, "metadata": i.metadata}
                       for i in batch]
            body = post_json(client, term.url, payload, timeout_s=term.timeout_s, max_retries=term.max_retries,
                             what=what, backoff_s=backoff_s)
            values = [_number(v) for v in body] if isinstance(body, list) else None
            if values is None or len(values) != len(batch) or any(v is None for v in values):
                raise RewardFatal(f"{what}: {term.url} must answer a JSON list of {len(batch)} finite numbers, "
                                  f"got {str(body)[:200]!r}")
            out.extend(v for v in values if v is not None)
    return out


class JudgeRecords:
    """The judge's durable per-sample results: ``<prefix>/<index>.json`` in the run's store,
    each naming its sample id and a hash of the response it judged."""

    def __init__(self, store: ObjectStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/")
        self._existing = set(store.list(self.prefix + "/"))
        self.written = 0  # results recorded by this pass (judged now)
        self._lock = threading.Lock()  # put() runs in the request threads

    def key(self, item: RemoteItem) -> str:
        return f"{self.prefix}/{item.index:06d}.json"

    @staticmethod
    def _digest(item: RemoteItem) -> str:
        return hashlib.sha256(item.response.encode()).hexdigest()

    def get(self, item: RemoteItem) -> float | None:
        key = self.key(item)
        if key not in self._existing:
            return None
        rec = json.loads(self.store.get_bytes(key))
        if rec.get("sample_id") != item.sample_id or rec.get("response_sha256") != self._digest(item):
            log.warning("judge record %s is for another sample (%s): judged again", key, rec.get("sample_id"))
            return None
        return float(rec["score"])

    def put(self, item: RemoteItem, score: float) -> None:
        rec = {"sample_id": item.sample_id, "response_sha256": self._digest(item), "score": score}
        self.store.put_bytes(self.key(item), json.dumps(rec, sort_keys=True).encode())
        with self._lock:
            self.written += 1


def score_judge(
    items: Sequence[RemoteItem], term: RewardTerm, records: JudgeRecords, *,
    backoff_s: float = BACKOFF_S,
) -> list[float]:
    """Each sample's judge score: recorded by an earlier attempt, else asked now. A sample's
    result is written to ``records`` as soon as its answer arrives, before anything else
    uses it; on a failure the requests in flight finish and are recorded, the ones not
    started are dropped, and the error is raised. Each request
    carries an ``Idempotency-Key`` header (the record's key) so an endpoint can tell a
    repeat of a call whose answer was lost (a timeout, a crash before the record)."""
    assert term.url and term.concurrency and term.max_retries is not None
    scores: dict[int, float] = {}
    todo = []
    for item in items:
        recorded = records.get(item)
        if recorded is None:
            todo.append(item)
        else:
            scores[item.index] = recorded
    if not todo:
        return [scores[i.index] for i in items]

    def judge(client: httpx.Client, item: RemoteItem) -> float:
        what = f"reward.kind judge, sample {item.sample_id}"
        payload = {"prompt": item.prompt, "response": item.response, "label": item.label,
                   "metadata": item.metadata, "sample_id": item.sample_id}
        body = post_json(client, term.url or "", payload, timeout_s=term.timeout_s, max_retries=term.max_retries or 0,
                         what=what, backoff_s=backoff_s, headers={"Idempotency-Key": records.key(item)})
        score = _number(body["score"] if isinstance(body, dict) and "score" in body else body)
        if score is None:
            raise RewardFatal(f"{what}: {term.url} must answer a finite number or {{\"score\": number}}, "
                              f"got {str(body)[:200]!r}")
        records.put(item, score)  # durable before it is used: a retry never asks again
        return score

    first_error: BaseException | None = None
    with http_client() as client, ThreadPoolExecutor(max_workers=term.concurrency) as pool:
        futures: dict[Future, RemoteItem] = {pool.submit(judge, client, item): item for item in todo}
        for fut in as_completed(futures):
            try:
                scores[futures[fut].index] = fut.result()
            except CancelledError:
                continue
            except BaseException as err:  # noqa: BLE001 - the first one is raised below
                if first_error is None:
                    first_error = err
                    for other in futures:
                        other.cancel()
    if first_error is not None:
        raise first_error
    return [scores[i.index] for i in items]
