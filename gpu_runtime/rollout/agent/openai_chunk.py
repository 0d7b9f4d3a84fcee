"""One rollout chunk of OpenAI-kind episodes (``rollout.agent.kind: openai``): your agent code,
one child process per episode, calling the endpoint the chunk serves on the node's loopback.

Each episode's calls are recorded before they are answered (``openai_session``); an episode's
end is recorded when its agent returns (``openai_records.EpisodeEnd``). A retried rollout runs no
ended episode's agent again; it re-runs the others, whose recorded calls are answered from the
record without generating. An agent process killed from outside (a signal) is restarted in
place up to ``agent.agent_restarts`` times, replaying the same way.
"""

from __future__ import annotations

import functools
from contextlib import ExitStack
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from gpu_runtime.data.rows import opening_chat
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.rollout.agent import openai_records as orec
from gpu_runtime.rollout.agent import records as rec
from gpu_runtime.rollout.agent.agent_process import AgentExit, AgentZygote
from gpu_runtime.rollout.agent.openai_server import AgentEndpoint
from gpu_runtime.rollout.agent.openai_session import Chats, EpisodeSession, SessionCounters
from gpu_runtime.rollout.agent.tool_parsers import get_parser
from gpu_runtime.rollout.chunks import ChunkGenerator, ChunkPlan, Generated, generate_checked, sample_id
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import ObjectStore
from spec.agent import AgentSpec

log = logging.getLogger(__name__)

Pin = Callable[[str], ChunkGenerator]  # an episode's key -> a generator that keeps to one engine


@dataclass
class OpenAICounters(SessionCounters):
    episodes_reused: int = 0  # ended episodes loaded from the store (their agents not run again)
    agent_restarts: int = 0  # agent processes killed from outside and restarted in place
    agent_seconds: list[float] = field(default_factory=list)


def generate_openai_chunk(
    req: RolloutRequest, plan: ChunkPlan, rows: list[dict], tokenizer: Tokenizer, generate: ChunkGenerator,
    store: ObjectStore, counters: OpenAICounters | None = None, pin: Pin | None = None,
    zygote: AgentZygote | None = None,
) -> art.RolloutChunk:
    """The chunk's episodes; ``zygote``: the rollout's (shared by its chunks: the entrypoint is
    imported once a step), else one of the chunk's own."""
    settings = req.rollout.agent
    assert settings is not None and settings.entrypoint is not None
    counters = counters or OpenAICounters()
    prefix = rec.episodes_prefix(req.run_id, req.step, plan.chunk, req.round)
    parser = get_parser(settings.tool_parser, tokenizer.chat_template)
    chats = Chats(tokenizer, settings.tool_role)
    chats.get(None)  # a template the endpoint cannot continue fails the rollout here, as the built-in loop's does
    with ExitStack() as stack:
        endpoint = stack.enter_context(AgentEndpoint())
        if zygote is None:
            zygote = stack.enter_context(AgentZygote(settings.entrypoint))
        sessions = []
        for pos in range(len(plan.members)):
            gen = pin(f"{req.run_id}/{req.step}/{req.round}/{plan.chunk}/{pos}") if pin else generate
            sessions.append(EpisodeSession(
                pos=pos, seed=plan.seed, prefix=prefix, store=store, rollout=req.rollout, settings=settings,
                tokenizer=tokenizer, chats=chats, parser=parser, generate=functools.partial(_one, req, plan, gen),
                counters=counters))
        with ThreadPoolExecutor(max_workers=len(sessions), thread_name_prefix=f"agent-c{plan.chunk}") as pool:
            futures = [pool.submit(_episode, s, rows[plan.members[s.pos][0]], settings, endpoint, zygote, store,
                                   counters) for s in sessions]
            ends = [f.result() for f in futures]
        if endpoint.fatal is not None:
            raise endpoint.fatal
    samples = [_sample(req, plan, s.pos, s.records(), end, tokenizer, chats, rows[plan.members[s.pos][0]])
               for s, end in zip(sessions, ends)]
    url = next((r.engine_url for s in sessions for r in reversed(s.records()) if r.engine_url), "")
    return art.RolloutChunk(run_id=req.run_id, step=req.step, chunk=plan.chunk, seed=plan.seed,
                            weight_version=req.policy_version, engine_url=url, samples=samples)


def _one(req: RolloutRequest, plan: ChunkPlan, generate: ChunkGenerator, prompt: list[int],
         params: dict) -> tuple[Generated, str]:
    results, url = generate_checked(req, plan, [prompt], params, generate)
    return results[0], url


def _episode(session: EpisodeSession, row: dict, settings: AgentSpec, endpoint: AgentEndpoint, zygote: AgentZygote,
             store: ObjectStore, counters: OpenAICounters) -> orec.EpisodeEnd | None:
    """The episode's end: recorded by an earlier attempt, else from running its agent (restarted
    in place when a signal from outside killed it). ``None``: the rollout failed under it."""
    end_key = orec.end_key(session.prefix, session.pos)
    if store.exists(end_key):
        end = art.get_model(store, end_key, orec.EpisodeEnd)
        session.load(end.calls)
        counters.add(episodes_reused=1)
        return end
    attempts, exit_ = 0, AgentExit("killed")
    spent = 0.0
    while exit_.status == "killed" and attempts <= settings.agent_restarts:
        if attempts:
            counters.add(agent_restarts=1)
            log.warning("episode %d: the agent process was %s: restarting it (attempt %d), its calls replayed",
                        session.pos, exit_.error, attempts + 1)
        session.start_attempt()
        key = endpoint.admit(session)
        exit_ = zygote.run(
            endpoint.base_url, key, row, timeout_s=max(0.1, settings.episode_timeout_s - spent),
            on_start=functools.partial(_started, store, session, attempts),
            should_stop=lambda: endpoint.fatal is not None,
        )
        session.close()
        spent += exit_.seconds
        attempts += 1
    if endpoint.fatal is not None or exit_.status == "stopped":
        return None  # the rollout fails and is retried: this episode's end is not known
    calls = len(session.records())
    status = {"completed": "completed" if calls else "no_calls", "killed": "agent_error"}.get(exit_.status, exit_.status)
    end = orec.EpisodeEnd(status=status, answer=exit_.answer, error=exit_.error, calls=calls, attempts=attempts,
                          seconds=spent)
    art.put_model(store, end_key, end)
    with counters.lock:
        counters.agent_seconds.append(spent)
    return end


def _started(store: ObjectStore, session: EpisodeSession, attempt: int, pid: int) -> None:
    """Attempt ``attempt``'s agent process is ``pid`` (what an operator, or a fault test, kills)."""
    art.put_json(store, orec.attempt_key(session.prefix, session.pos, attempt),
                 {"pid": pid, "at": time.time(), "attempt": attempt})


def _sample(req: RolloutRequest, plan: ChunkPlan, pos: int, records: list[orec.CallRecord],
            end: orec.EpisodeEnd | None, tokenizer: Tokenizer, chats: Chats, row: dict) -> art.Sample:
    """The episode's training sample: its last segment of calls (docs/agents.md), token in token out,
    the loss on the model's tokens only."""
    assert end is not None
    idx, g = plan.members[pos]
    start = max((i for i, r in enumerate(records) if not r.extends), default=0)
    seg = records[start:]
    ids: list[int] = []
    lps: list[float] = []
    mask: list[int] = []
    if seg:
        prompt = seg[0].prompt_ids
        for a, b in zip(seg, [*seg[1:], None]):
            ids += a.completion_ids
            lps += a.logprobs
            mask += [1] * len(a.completion_ids)
            if b is not None:
                between = b.prompt_ids[len(a.prompt_ids) + len(a.completion_ids):]
                ids += between
                lps += [0.0] * len(between)
                mask += [0] * len(between)
        last = seg[-1].response["choices"][0]["message"].get("content") or ""
        finish = seg[-1].finish_reason
    else:  # no call: one untrained EOS, so the group keeps its size (the reward is the error policy's)
        prompt = chats.get(None).prompt(opening_chat(row))
        ids, lps, mask, last, finish = [tokenizer.eos_token_id], [0.0], [0], "", "stop"
    settings = req.rollout.agent
    assert settings is not None
    info = art.EpisodeInfo(
        outcome=end.status, turns=len(records), tool_calls=sum(r.tool_calls for r in records),
        tool_errors=sum(r.tool_errors for r in records), seconds=end.seconds, error=end.error,
        zero_reward=end.status != "completed" and settings.on_agent_error == "zero",
        segments=sum(not r.extends for r in records),
    )
    return art.Sample(
        sample_id=sample_id(req, idx, g), prompt_index=idx, group_index=g, prompt_ids=prompt, response_ids=ids,
        logprobs=lps, weight_version=req.policy_version, finish_reason=finish,
        prompt_text=tokenizer.decode(prompt, skip_special=False),
        response_text=end.answer if end.answer is not None else last, loss_mask=mask, episode=info,
    )
