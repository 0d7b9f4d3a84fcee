"""One rollout chunk as agent episodes, resumable turn by turn.

Every episode of a chunk advances in lock step: turn ``t`` of the chunk's still-active
episodes is generated as one batch (sampling seed ``derive_seed(chunk seed, "turn", t)``;
the batch is a pure function of the earlier turns, so it is the same batch — and, on
CPU, the same floats — on every attempt), stored, then each episode's calls run in order
(``turn_calls``: several a turn with a native parser), each call's result stored before the
next runs, and its finished turn is stored before the next turn uses it (``records``). A
retried rollout reloads every finished turn and call result, regenerates only a batch that
was never stored and runs only the calls that have no result: the resumed episode is
bitwise the fault-free one, and no tool runs twice for a call once its result is recorded.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_runtime.data.rows import opening_chat
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.rollout.agent import records as rec
from gpu_runtime.rollout.agent.counters import AttemptCounters
from gpu_runtime.rollout.agent.chat import IncrementalChat
from gpu_runtime.rollout.agent.tool_api import ToolResult
from gpu_runtime.rollout.agent.tool_parsers import get_parser
from gpu_runtime.rollout.agent.tools import load_environment_factory, load_tools
from gpu_runtime.rollout.agent.turn_calls import CallSource, EnvironmentCalls, ParsedCalls, TurnCall
from gpu_runtime.rollout.chunks import ChunkGenerator, ChunkPlan, generate_checked, sample_id
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import ObjectStore
from spec.agent import AgentSpec

log = logging.getLogger(__name__)


@dataclass
class AgentCounters(AttemptCounters):
    """What this rollout attempt did (not part of any artifact: a retry differs)."""

    turns_reused: int = 0  # finished turns loaded from the store
    model_turns_reused: int = 0  # model turn batches loaded from the store
    tools_run: int = 0  # tool executions by this attempt


@dataclass
class Episode:
    pos: int  # position in the chunk
    row: dict
    prompt_ids: list[int]
    env: CallSource
    turns: list[rec.TurnRecord] = field(default_factory=list)

    @property
    def outcome(self) -> str | None:
        return self.turns[-1].outcome if self.turns else None

    @property
    def response_len(self) -> int:
        return sum(len(t.model_ids) + len(t.env_ids) for t in self.turns)

    def context(self) -> list[int]:
        return self.prompt_ids + [i for t in self.turns for i in (*t.model_ids, *t.env_ids)]

    def seconds(self) -> float:
        return sum(t.seconds for t in self.turns)


def generate_agent_chunk(
    req: RolloutRequest, plan: ChunkPlan, rows: list[dict], tokenizer: Tokenizer, generate: ChunkGenerator,
    store: ObjectStore, counters: AgentCounters | None = None,
) -> art.RolloutChunk:
    settings = req.rollout.agent
    assert settings is not None
    counters = counters or AgentCounters()
    make_env, schemas = _call_sources(settings, tokenizer)
    chat = IncrementalChat(tokenizer, settings.tool_role, tools=schemas)
    prefix = rec.episodes_prefix(req.run_id, req.step, plan.chunk, req.round)
    episodes = [
        Episode(pos, rows[idx], chat.prompt(opening_chat(rows[idx])), make_env(rows[idx]))
        for pos, (idx, _g) in enumerate(plan.members)
    ]
    url = ""
    for t in range(settings.max_turns):
        active = [e for e in episodes if e.outcome is None]
        if not active:
            break
        done = {e.pos: store.exists(rec.turn_key(prefix, e.pos, t)) for e in active}
        if all(done.values()):
            for e in active:
                e.turns.append(art.get_model(store, rec.turn_key(prefix, e.pos, t), rec.TurnRecord))
            counters.add(turns_reused=len(active))
            continue
        batch = _model_turn(req, plan, settings, chat, store, prefix, t, active, generate, counters)
        url = batch.engine_url or url
        for e, out in zip(active, batch.outputs, strict=True):
            key = rec.turn_key(prefix, e.pos, t)
            if done[e.pos]:
                e.turns.append(art.get_model(store, key, rec.TurnRecord))
                counters.add(turns_reused=1)
                continue
            record = _finish_turn(e, t, out, batch.seconds, settings, chat, tokenizer, store, prefix, counters)
            art.put_model(store, key, record)  # recorded before the next turn uses it
            e.turns.append(record)
    samples = [_sample(req, plan, e, tokenizer) for e in episodes]
    return art.RolloutChunk(run_id=req.run_id, step=req.step, chunk=plan.chunk, seed=plan.seed,
                            weight_version=req.policy_version, engine_url=url, samples=samples)


def _call_sources(settings: AgentSpec, tokenizer: Tokenizer) -> tuple[Callable[[dict], CallSource], list[dict] | None]:
    """Each episode's source of calls, from its row: the configured tools read by ``agent.tool_parser``
    (shared: tools are stateless) or ``agent.environment``'s factory; and the tools' schemas when the
    prompt renders them (a native format: the template teaches it; tags prompts stay as they were)."""
    if settings.environment is not None:
        factory = load_environment_factory(settings.environment)
        return (lambda row: EnvironmentCalls(factory(row))), None
    parser = get_parser(settings.tool_parser, tokenizer.chat_template)
    source = ParsedCalls(load_tools(settings.tools, settings.tool_timeout_s), parser, settings.tool_timeout_s)
    return (lambda _row: source), (source.schemas if source.native else None)


def _model_turn(
    req: RolloutRequest, plan: ChunkPlan, settings: AgentSpec, chat: IncrementalChat, store: ObjectStore,
    prefix: str, t: int, active: list[Episode], generate: ChunkGenerator, counters: AgentCounters,
) -> rec.ModelTurnBatch:
    """Turn ``t`` of the active episodes: the stored batch, else generated and stored."""
    key = rec.model_turn_key(prefix, t)
    positions = [e.pos for e in active]
    if store.exists(key):
        batch = art.get_model(store, key, rec.ModelTurnBatch)
        if batch.episodes != positions:  # only a different run could have written it
            raise RuntimeError(f"{key}: holds episodes {batch.episodes}, turn {t} has {positions} active")
        counters.add(model_turns_reused=1)
        return batch
    budgets = [min(settings.max_tokens_per_turn, settings.max_episode_tokens - e.response_len) for e in active]
    params = {
        "max_new_tokens": max(budgets),
        "temperature": req.rollout.temperature,
        "top_p": req.rollout.top_p,
        "top_k": req.rollout.top_k,
        "sampling_seed": art.derive_seed(plan.seed, "turn", t),
        "stop_token_ids": [*chat.stop_ids, *(i for i in req.rollout.stop_token_ids if i not in chat.stop_ids)],
    }
    if req.rollout.stop:  # rollout.stop ends a model turn as it ends a single-turn response
        params["stop"] = list(req.rollout.stop)
    t0 = time.perf_counter()
    results, url = generate_checked(req, plan, [e.context() for e in active], params, generate)
    seconds = time.perf_counter() - t0
    outputs = []
    for (ids, lps, finish), budget in zip(results, budgets, strict=True):
        if len(ids) > budget:  # the batch ran to the longest budget: this episode's ends sooner
            ids, lps, finish = ids[:budget], lps[:budget], "length"
        outputs.append(rec.ModelOutput(ids=ids, logprobs=lps, finish_reason=finish))
    batch = rec.ModelTurnBatch(turn=t, episodes=positions, outputs=outputs, engine_url=url, seconds=seconds)
    art.put_model(store, key, batch)
    return batch


def _finish_turn(
    e: Episode, t: int, out: rec.ModelOutput, model_s: float, settings: AgentSpec, chat: IncrementalChat,
    tokenizer: Tokenizer, store: ObjectStore, prefix: str, counters: AgentCounters,
) -> rec.TurnRecord:
    """The turn's record: the model's tokens, then its calls in order (each run at most once here) and
    the tool turn that answers them."""
    text = tokenizer.decode(out.ids)
    r = rec.TurnRecord(turn=t, model_ids=out.ids, model_logprobs=out.logprobs, finish_reason=out.finish_reason,
                       model_text=text, seconds=model_s)
    truncated = out.finish_reason == "length"
    calls = e.env.calls(chat.turn_text(out.ids) if e.env.native else text)
    if not calls:
        r.outcome = "truncated" if truncated else "completed"
        return r
    r.calls = [rec.CallRecord(index=i, tool=c.tool, arguments=c.arguments, call_id=rec.call_id(t, i), error=c.error)
               for i, c in enumerate(calls)]
    if (truncated and any(c.error for c in calls)) or t == settings.max_turns - 1:  # cut off inside a call, or
        r.outcome = "truncated"  # no turn left to read the answers: none is run
        return r
    for i, c in enumerate(calls):
        r.calls[i] = done = _answer(e, t, i, c, r.calls[i], store, prefix, counters)
        if done.timed_out or (done.error and settings.on_tool_error == "stop"):
            break  # the episode ends here: the calls after this one are not run
    answered = [c for c in r.calls if c.observation is not None]
    r.seconds += sum(c.seconds for c in answered)
    rewards = [c.reward for c in answered if c.reward is not None]
    r.reward = sum(rewards) if rewards else None
    if any(c.timed_out for c in answered):
        r.outcome = "timeout"
    elif any(c.error for c in answered) and settings.on_tool_error == "stop":
        r.outcome = "tool_error"
    elif e.seconds() + r.seconds > settings.episode_timeout_s:
        r.outcome = "timeout"
    else:
        env_ids = _tool_turn(chat, out.ids, calls, r.calls, native=e.env.native)
        if e.response_len + len(out.ids) + len(env_ids) >= settings.max_episode_tokens:
            r.outcome = "truncated"  # no room left for another model turn
        else:
            r.env_ids = env_ids
    return r


def _answer(
    e: Episode, t: int, i: int, call: TurnCall, r: rec.CallRecord, store: ObjectStore, prefix: str,
    counters: AgentCounters,
) -> rec.CallRecord:
    """Call ``i``'s answer: its error when it is malformed, its recorded result when an earlier attempt
    ran it, else the tool's result, logged just before the tool runs and recorded before it is used."""
    if call.error:
        return r.model_copy(update={"observation": ToolResult.failed(call.error).observation()})
    key = rec.call_result_key(prefix, e.pos, t, i)
    if store.exists(key):
        return art.get_model(store, key, rec.CallRecord)
    execution = uuid.uuid4().hex
    art.put_json(store, rec.call_log_key(prefix, e.pos, t, i, execution),
                 {"tool": call.tool, "arguments": call.arguments, "index": i, "at": time.time(), "pid": os.getpid(),
                  "execution": execution})
    t0 = time.perf_counter()
    result = e.env.execute(call)
    seconds = time.perf_counter() - t0
    counters.add(tools_run=1)
    done = r.model_copy(update={
        "executed": True, "execution": execution, "observation": result.observation(), "error": result.error,
        "timed_out": result.timed_out, "reward": result.reward, "seconds": seconds})
    art.put_model(store, key, done)  # recorded before the next call or turn uses it
    return done


def _tool_turn(
    chat: IncrementalChat, model_ids: list[int], calls: list[TurnCall], answers: list[rec.CallRecord], *, native: bool,
) -> list[int]:
    """The tokens that answer the turn: one tool message per call, after the calls as the template
    renders them (a native format); a tags or environment turn's single call keeps its one message."""
    if not native:
        (answer,) = answers
        return chat.tool_turn(model_ids, answer.observation or "")
    tool_calls = [{"id": a.call_id, "type": "function", "function": {"name": c.tool, "arguments": c.parsed or {}}}
                  for c, a in zip(calls, answers, strict=True)]
    messages = [{"role": chat.role, "content": a.observation or "", "tool_call_id": a.call_id, "name": c.tool}
                for c, a in zip(calls, answers, strict=True)]
    return chat.continuation(model_ids, messages, tool_calls=tool_calls)


def _sample(req: RolloutRequest, plan: ChunkPlan, e: Episode, tokenizer: Tokenizer) -> art.Sample:
    idx, g = plan.members[e.pos]
    ids, lps, mask = [], [], []
    for t in e.turns:
        ids += t.model_ids + t.env_ids
        lps += t.model_logprobs + [0.0] * len(t.env_ids)
        mask += [1] * len(t.model_ids) + [0] * len(t.env_ids)
    last = e.turns[-1]
    info = art.EpisodeInfo(
        outcome=last.outcome or "truncated", turns=len(e.turns),
        tool_calls=sum(t.tool_calls for t in e.turns), tool_errors=sum(t.tool_errors for t in e.turns),
        max_calls_per_turn=max(len(t.calls) for t in e.turns),
        turn_rewards=[t.reward for t in e.turns], seconds=e.seconds(),
    )
    return art.Sample(
        sample_id=sample_id(req, idx, g), prompt_index=idx, group_index=g, prompt_ids=e.prompt_ids,
        response_ids=ids, logprobs=lps, weight_version=req.policy_version, finish_reason=last.finish_reason,
        prompt_text=tokenizer.decode(e.prompt_ids, skip_special=False), response_text=last.model_text,
        loss_mask=mask, episode=info,
    )
