"""``http`` and ``judge`` rewards against a real HTTP server started by the test on
127.0.0.1 (tests/reward_servers.py): batching, retries with backoff on 5xx, final errors on
4xx and bad answers, and the judge's durable per-sample records (a retry never asks twice)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.data.rewards import RewardError, RewardFatal, ScoreContext, ScoreStats, score_samples
from gpu_runtime.proc.processes import free_port
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.store.object_store import LocalStore
from spec.reward import RewardSpec
from tests.reward_servers import Behaviour, length_score, reward_server

ROWS = [{"id": f"r{i}", "prompt": f"{i}+1=", "messages": None, "answer": str(i + 1), "metadata": {"i": i}}
        for i in range(3)]
FAST = 0.01  # backoff of the retries here (production: 0.5 s doubling)


def samples(n: int = 6) -> list[Sample]:
    return [Sample(sample_id=f"s1-p{k % 3}-g{k // 3}", prompt_index=k % 3, group_index=k // 3, prompt_ids=[1],
                   response_ids=[2], logprobs=[0.0], weight_version=0, finish_reason="stop",
                   prompt_text=f"{k % 3}+1=", response_text=f"it is {k % 3 + 1 + k // 3}")
            for k in range(n)]


def expected(items: list[Sample]) -> list[float]:
    """What the server's scoring function gives, computed here without it (a fault-free run)."""
    return [length_score({"response": s.response_text, "label": ROWS[s.prompt_index]["answer"]}) for s in items]


def http(url: str, **kw: object) -> object:
    return RewardSpec(kind="http", url=url, **kw)


# ---- http ------------------------------------------------------------------------------
def test_http_batches_and_payload() -> None:
    seen: list[dict] = []

    def score(sample: dict) -> float:
        seen.append(sample)
        return length_score(sample)

    with reward_server(Behaviour(score=score)) as server:
        res = score_samples(samples(5), ROWS, http(server.url, batch_size=2))
    assert [r.reward for r in res] == pytest.approx(expected(samples(5)))
    assert server.log.batches == [2, 2, 1]
    assert seen[0] == {"prompt": "0+1=", "response": "it is 1", "label": "1", "metadata": {"i": 0}}
    assert [r.correct for r in res] == [True, True, True, False, False]  # integer labels: the math rule


def test_http_retries_5xx_with_backoff() -> None:
    with reward_server(Behaviour(fail_first=2)) as server:
        res = score_samples(samples(4), ROWS, http(server.url, batch_size=4, max_retries=3),
                            ScoreContext(backoff_s=FAST))
    assert [r.reward for r in res] == pytest.approx(expected(samples(4)))
    assert (server.log.requests, server.log.failed, server.log.batches) == (3, 2, [4])


def test_http_gives_up_after_max_retries_retryably() -> None:
    with reward_server(Behaviour(fail_first=10)) as server:
        with pytest.raises(RewardError) as err:
            score_samples(samples(2), ROWS, http(server.url, max_retries=2), ScoreContext(backoff_s=FAST))
    assert not isinstance(err.value, RewardFatal)
    assert "failed 3 times; last: HTTP 503" in str(err.value) and server.log.requests == 3


def test_http_connection_refused_is_retried_then_retryable() -> None:
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    with pytest.raises(RewardError, match="failed 2 times; last: ConnectError") as err:
        score_samples(samples(2), ROWS, http(url, max_retries=1), ScoreContext(backoff_s=FAST))
    assert not isinstance(err.value, RewardFatal)


@pytest.mark.parametrize(("behaviour", "needle"), [
    (Behaviour(status=422, body=b'{"detail": "label missing"}'), "answered HTTP 422: "),
    (Behaviour(body=b"<html>oops</html>"), "answered something that is not JSON: '<html>oops</html>'"),
    (Behaviour(body=b"[0.5]"), "must answer a JSON list of 2 finite numbers, got '[0.5]'"),
    (Behaviour(body=b'{"rewards": [1, 2]}'), "must answer a JSON list of 2 finite numbers"),
    (Behaviour(body=b'[1, "x"]'), "must answer a JSON list of 2 finite numbers"),
])
def test_http_4xx_and_bad_answers_are_final_and_not_retried(behaviour: Behaviour, needle: str) -> None:
    with reward_server(behaviour) as server:
        with pytest.raises(RewardFatal, match="reward.kind http, samples s1-p0-g0..s1-p1-g0") as err:
            score_samples(samples(2), ROWS, http(server.url, max_retries=5), ScoreContext(backoff_s=FAST))
    assert needle in str(err.value) and server.log.requests == 1


# ---- judge -----------------------------------------------------------------------------
def judge(url: str, **kw: object) -> object:
    return RewardSpec(kind="judge", url=url, **kw)


def ctx(store_dir: Path, prefix: str = "runs/r/steps/000001/judge") -> ScoreContext:
    return ScoreContext(store=LocalStore(store_dir), judge_prefix=prefix, backoff_s=FAST)


def test_judge_records_each_sample_and_a_retry_asks_only_for_the_rest(tmp_path: Path) -> None:
    """The endpoint fails once after 3 judgements (no retries allowed: the pass fails, as an
    activity attempt would); the next pass judges only the samples without a record. Every
    sample is judged exactly once and the scores equal a fault-free pass."""
    items = samples(8)
    with reward_server(Behaviour(fail_once_after=3)) as server:
        spec = judge(server.url, concurrency=2, max_retries=0)
        with pytest.raises(RewardError, match="reward.kind judge, sample .* failed 1 times; last: HTTP 500"):
            score_samples(items, ROWS, spec, ctx(tmp_path / "store"))
        recorded = len(list((tmp_path / "store" / "runs/r/steps/000001/judge/judge").glob("*.json")))
        assert 3 <= recorded < 8  # those before the failure, and any in flight then
        stats = ScoreStats()
        res = score_samples(items, ROWS, spec, ctx(tmp_path / "store"), stats)
        assert stats.judged == 8 - recorded
        again = ScoreStats()
        assert score_samples(items, ROWS, spec, ctx(tmp_path / "store"), again) == res and again.judged == 0
    assert server.log.judged == {s.sample_id: 1 for s in items}
    assert server.log.failed == 1 and server.log.requests == 9
    assert [r.reward for r in res] == pytest.approx(expected(items))
    # each request named its record (Idempotency-Key): 8 keys, the one that got the 500 asked twice
    assert len(server.log.keys) == 8 and sorted(server.log.keys.values()) == [1] * 7 + [2]
    assert all(k.startswith("runs/r/steps/000001/judge/judge/0000") for k in server.log.keys)
    with reward_server() as fresh:
        clean = score_samples(items, ROWS, judge(fresh.url), ctx(tmp_path / "fresh"))
    assert [r.reward for r in clean] == [r.reward for r in res]


def test_judge_retries_a_5xx_in_process(tmp_path: Path) -> None:
    with reward_server(Behaviour(fail_first=1)) as server:
        res = score_samples(samples(2), ROWS, judge(server.url, concurrency=1), ctx(tmp_path))
    assert [r.reward for r in res] == pytest.approx(expected(samples(2)))
    assert server.log.requests == 3 and server.log.judged == {"s1-p0-g0": 1, "s1-p1-g0": 1}


def test_judge_record_for_another_response_is_judged_again(tmp_path: Path) -> None:
    items = samples(2)
    with reward_server() as server:
        score_samples(items, ROWS, judge(server.url), ctx(tmp_path))
        changed = [items[0].model_copy(update={"response_text": "it is 9"}), items[1]]
        res = score_samples(changed, ROWS, judge(server.url), ctx(tmp_path))
    assert server.log.judged == {"s1-p0-g0": 2, "s1-p1-g0": 1}
    assert [r.reward for r in res] == pytest.approx(expected(changed))


def test_judge_bad_answer_is_final(tmp_path: Path) -> None:
    with reward_server(Behaviour(body=b'{"verdict": "good"}')) as server:
        with pytest.raises(RewardFatal, match=r'must answer a finite number or \{"score": number\}'):
            score_samples(samples(1), ROWS, judge(server.url), ctx(tmp_path))


def test_judge_needs_a_store() -> None:
    with pytest.raises(RewardFatal, match="needs a store"):
        score_samples(samples(1), ROWS, judge("http://127.0.0.1:1/"))


def test_judge_in_a_weighted_reward_records_under_its_term_name(tmp_path: Path) -> None:
    with reward_server() as server:
        spec = RewardSpec(kind="weighted", terms=[
            {"kind": "math_answer", "weight": 1.0}, {"kind": "judge", "url": server.url, "weight": 0.5, "name": "llm"}])
        res = score_samples(samples(2), ROWS, spec, ctx(tmp_path))
    assert [r.terms["llm"] for r in res] == pytest.approx(expected(samples(2)))
    assert [r.reward for r in res] == pytest.approx([1.0 + 0.5 * v for v in expected(samples(2))])
    assert sorted(p.name for p in (tmp_path / "runs/r/steps/000001/judge/llm").iterdir()) == ["000000.json", "000001.json"]
