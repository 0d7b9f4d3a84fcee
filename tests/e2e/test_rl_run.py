"""A whole RL run on the real Temporal dev server with real worker, trainer,
engine and router processes (the embedded CPU default)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import torch
import transformers
from safetensors.torch import load_file
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from bench._inproc import PlainLoop
from gpu_runtime.models.hf_factory import init_model_folder, train_bpe_tokenizer
from gpu_runtime.node.reclaim import run_paths
from milestone_cli.report import render_report
from spec.run import RunConfig
from tests.recorded_histories import record
from tests.browser import render
from tests.e2e.faults import assert_bitwise_equal
from tests.stack import Stack, tiny_config, wait_for
from workers.common import connect
from workflows.contracts.step import StepSummary
from workflows.run_state import RunProgress, RunSummary, TrainingRunInput
from workflows.queues import CONTROL_QUEUE
from workflows.stubs import CHECKPOINT, COMPUTE_REWARDS_ON_NODE, EVALUATE, ROLLOUT, TRAIN_STEP, UPDATE_WEIGHTS
from workflows.training_run import RUN_WORKFLOWS, TrainingRun

pytestmark = pytest.mark.e2e
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"  # git-ignored; CI keeps the UI screenshots here
STEP_ACTIVITIES = [ROLLOUT.name, COMPUTE_REWARDS_ON_NODE.name, TRAIN_STEP.name, UPDATE_WEIGHTS.name, CHECKPOINT.name]
LAST_STEP_ACTIVITIES = [*STEP_ACTIVITIES, EVALUATE.name]  # eval.every 0: the held-out eval after the last step only


async def run_to_end(client: Client, run_id: str, cfg: dict, timeout_s: float = 600) -> RunSummary:
    handle = await client.start_workflow(
        TrainingRun.run, TrainingRunInput(config=RunConfig.model_validate(cfg)), id=run_id, task_queue=CONTROL_QUEUE
    )
    return await asyncio.wait_for(handle.result(), timeout_s)


def activity_names(history: WorkflowHistory) -> list[str]:
    return [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]


def child_ids(history: WorkflowHistory) -> list[str]:
    return [
        e.start_child_workflow_execution_initiated_event_attributes.workflow_id
        for e in history.events
        if e.HasField("start_child_workflow_execution_initiated_event_attributes")
    ]


@dataclass(frozen=True)
class FinishedRun:
    run_id: str
    cfg: dict
    store: Path
    summary: RunSummary


@pytest.fixture(scope="module")
def e2e_run(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """A 3-step run, finished; the end-to-end checks and the browser check both read it."""
    store = tmp_path_factory.mktemp("e2e-run") / "store"
    cfg = tiny_config(store, steps=3)

    async def main() -> RunSummary:
        return await run_to_end(await connect(stack.server.address), "e2e-run", cfg)

    return FinishedRun("e2e-run", cfg, store, asyncio.run(main()))


def check_final_eval(stack: Stack, summary: RunSummary, progress: RunProgress) -> None:
    """The held-out eval of the final policy (greedy pass@1, pass@4), on the last step only:
    in the progress query, the run summary and the node's gauges alike."""
    last = progress.steps[-1]
    assert all(s.eval_greedy is None for s in progress.steps[:-1])
    assert (last.eval_k, last.eval_n) == (4, 8) and last.phase_seconds["eval"] > 0
    for value in (last.eval_greedy, last.eval_pass_at_k):
        assert value is not None and math.isfinite(value) and 0.0 <= value <= 1.0
    assert (summary.eval_step, summary.eval_greedy, summary.eval_pass_at_k) == (3, last.eval_greedy, last.eval_pass_at_k)
    # sampled accuracy (pass@1 at T) is the mean of the same samples pass@4 counts: never above it
    assert last.eval_sampled is not None and last.eval_pass_at_k is not None
    assert 0.0 <= last.eval_sampled <= last.eval_pass_at_k and summary.eval_sampled == last.eval_sampled
    gauges = stack.scrape("node0")
    assert gauges["milestone_eval_greedy_accuracy"] == last.eval_greedy
    assert gauges["milestone_eval_pass_at_k"] == last.eval_pass_at_k
    print(f"held-out eval after step 3: greedy {last.eval_greedy:.3f}, pass@4 {last.eval_pass_at_k:.3f}")


def test_rl_run_end_to_end(stack: Stack, e2e_run: FinishedRun, tmp_path: Path) -> None:
    store, cfg, summary = e2e_run.store, e2e_run.cfg, e2e_run.summary

    async def main() -> None:
        client = await connect(stack.server.address)
        assert summary.steps == 3 and summary.policy_version == 3
        assert summary.data_cursor == 3 * cfg["rollout"]["prompts_per_step"]
        assert summary.final_weights_key == "runs/e2e-run/weights/v000003"

        progress = await client.get_workflow_handle("e2e-run").query(TrainingRun.progress)
        assert [s.step for s in progress.steps] == [1, 2, 3]
        for s in progress.steps:
            for value in (s.reward_mean, s.loss, s.kl, s.grad_norm, s.step_seconds, *s.phase_seconds.values()):
                assert math.isfinite(value)
            assert s.grad_norm > 0  # a real optimizer step happened
            assert 0 <= s.rollout_logprob_abs_diff <= s.rollout_logprob_abs_diff_max <= 1e-5  # engine ~ trainer

        check_final_eval(stack, summary, progress)

        # the report CLI renders the curves from the same query
        png = render_report(progress, tmp_path / "report.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

        # one RLStep child per step, each with the five activities in order
        run_history = await client.get_workflow_handle("e2e-run").fetch_history()
        assert child_ids(run_history) == ["e2e-run/step-1", "e2e-run/step-2", "e2e-run/step-3"]
        histories = [run_history]
        for child in child_ids(run_history):
            h = await client.get_workflow_handle(child).fetch_history()
            assert activity_names(h) == (LAST_STEP_ACTIVITIES if child.endswith("step-3") else STEP_ACTIVITIES)
            histories.append(h)

        # replaying the recorded histories against the current workflow code is deterministic
        replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
        for h in histories:
            await replayer.replay_workflow(h)
        record("training_run", run_history)  # tests/recorded_histories.py: with MILESTONE_RECORD_HISTORY
        record("rl_step", histories[1])
        record("rl_step_eval", histories[3])  # the last step: with its checkpoint and eval

    asyncio.run(main())

    # the weights changed, and every engine ended on the trainer's final weights
    v0 = load_file(str(store / "runs/e2e-run/weights/v000000/model.safetensors"))
    v3 = load_file(str(store / "runs/e2e-run/weights/v000003/model.safetensors"))
    assert v0.keys() == v3.keys()
    assert any(not torch.equal(v0[k], v3[k]) for k in v0)
    assert all(torch.isfinite(t).all() for t in v3.values())
    gap = assert_token_in_token_out(store, "e2e-run", step=1)
    print(f"max |engine logprob - transformers logprob| over step 1's response tokens: {gap:.2e}")


def test_a_completed_runs_node_files_are_reclaimed(stack: Stack, e2e_run: FinishedRun) -> None:
    """Once the run has closed, its node keeps none of its files (the trainer's versions,
    checkpoints, dataset and base model, the engines' versions, the rows cache), and says
    how many bytes it reclaimed; the store keeps everything resume and fork need."""
    node = stack.workdir / "nodes" / "node0"
    wait_for(lambda: not run_paths(node, e2e_run.run_id), 120, interval_s=0.5, what="e2e-run's node files reclaimed")
    line = wait_for(lambda: re.search(r"reclaimed (\d+) bytes of closed run e2e-run ", stack.log("gpu-node0")), 30)
    assert int(line.group(1)) > 100_000, line.group(0)  # a checkpoint alone is more
    assert (e2e_run.store / "runs" / "e2e-run" / "checkpoints").is_dir()


def test_the_run_is_bitwise_the_plain_one_process_loop(stack: Stack, e2e_run: FinishedRun, tmp_path: Path) -> None:
    """ML correctness against the simplest implementation: the run's recipe in one process
    (``bench._inproc.PlainLoop``: SFT, then per step the same chunks generated in-process,
    scored, ``train_step``, a weight copy), one torch thread like each engine and trainer
    process. Every step's loss and grad norm and the final weights are bitwise the run's:
    Temporal, the engine and trainer processes, the router and the store add nothing and
    lose nothing."""
    assert_bitwise_the_plain_loop(stack, e2e_run, tmp_path)


def assert_bitwise_the_plain_loop(stack: Stack, run: FinishedRun, tmp_path: Path) -> list[StepSummary]:
    """Every step's loss and grad norm and the final weights of ``run`` are bitwise those of
    ``PlainLoop`` on its config; the run's step summaries."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loop = PlainLoop(RunConfig.model_validate(run.cfg), tmp_path)
        plain = loop.run(run.summary.steps)
    finally:
        torch.set_num_threads(threads)

    async def main() -> RunProgress:
        client = await connect(stack.server.address)
        return await client.get_workflow_handle(run.run_id).query(TrainingRun.progress)

    steps = asyncio.run(main()).steps
    assert [(s.loss, s.grad_norm) for s in steps] == [(m["loss"], m["grad_norm"]) for m in plain]
    assert all(m["grad_norm"] > 0 for m in plain)  # each step trained on a signal
    final = load_file(str(run.store / f"runs/{run.run_id}/weights/v{run.summary.steps:06d}/model.safetensors"))
    state = loop.trainer.model.state_dict()
    assert final.keys() <= state.keys()
    assert_bitwise_equal(final, {k: state[k] for k in final})
    return steps


def test_a_run_at_temperature_0_7_trains_the_policy_that_sampled(stack: Stack, tmp_path: Path) -> None:
    """``rollout.temperature: 0.7`` end to end: the engines report log_softmax(logits / 0.7) of
    the tokens they sampled (against a transformers forward), the step batch carries 0.7 to
    the trainer process, the train-inference gap of every step is ~0 (both sides divide by
    the same T) and the run is bitwise the one-process loop at 0.7."""
    store = tmp_path / "store"
    cfg = tiny_config(store, steps=2, rollout={"temperature": 0.7}, eval={"enabled": False})
    run = FinishedRun("t07-run", cfg, store, asyncio.run(_run(stack, "t07-run", cfg)))
    assert json.loads((store / "runs/t07-run/steps/000001/step_batch.json").read_text())["temperature"] == 0.7
    assert_token_in_token_out(store, "t07-run", step=1)
    steps = assert_bitwise_the_plain_loop(stack, run, tmp_path / "plain")
    for s in steps:
        assert 0 <= s.rollout_logprob_abs_diff <= s.rollout_logprob_abs_diff_max <= 1e-5, s
    gauges = stack.scrape("node0")  # Prometheus: the node's last train step is this run's last
    assert gauges['milestone_train{metric="rollout_logprob_abs_diff_max"}'] == steps[-1].rollout_logprob_abs_diff_max


async def _run(stack: Stack, run_id: str, cfg: dict) -> RunSummary:
    return await run_to_end(await connect(stack.server.address), run_id, cfg)


def test_temporal_ui_shows_the_run_in_chromium(stack: Stack, e2e_run: FinishedRun, tmp_path: Path) -> None:
    """The Temporal web UI of the finished run, rendered by headless Chromium, lists the
    run's RLStep children by id and shows the run's search attributes with the values
    the run committed. The screenshots are kept in ``artifacts/`` (and the test's tmp dir)."""
    run_id = e2e_run.run_id

    async def server_side() -> tuple[str, dict, float]:
        handle = (await connect(stack.server.address)).get_workflow_handle(run_id)
        desc = await handle.describe()
        progress = await handle.query(TrainingRun.progress)
        attrs = {p.key.name: p.value for p in desc.typed_search_attributes if p.key.name.startswith("Rl")}
        return desc.run_id, attrs, progress.steps[-1].reward_mean

    temporal_run_id, attrs, last_reward = asyncio.run(server_side())
    expected = {"RlStep": 3, "RlPolicyVersion": 3, "RlStatus": "completed", "RlReward": last_reward}
    assert attrs == expected  # what Temporal itself holds; the page must show the same
    page_url = (f"http://127.0.0.1:{stack.server.ui_port}/namespaces/default/workflows/"
                f"{quote(run_id, safe='')}/{temporal_run_id}")
    browser_dir = tmp_path / "chromium"

    def children_listed():
        page = render(f"{page_url}/relationships", tmp_path / "temporal-ui-relationships.png", browser_dir)
        steps = {int(n) for n in re.findall(rf"RLStep {re.escape(run_id)}/step-(\d+)", page.text)}
        return page if steps == {1, 2, 3} and f"TrainingRun ID {run_id}" in page.text else None

    def attributes_shown():
        page = render(f"{page_url}/search-attributes", tmp_path / "temporal-ui-search-attributes.png", browser_dir)
        shown = {k: json.loads(v) for k, v in re.findall(r'"(Rl\w+)" : ("[^"]*"|[-+.\deE]+)', page.text)}
        return page if shown == expected else None

    # a page is rendered again until it shows what is expected (the UI loads its data asynchronously)
    pages = [wait_for(children_listed, timeout_s=240, interval_s=1, what="the RLStep children in the UI"),
             wait_for(attributes_shown, timeout_s=240, interval_s=1, what="the Rl* search attributes in the UI")]
    ARTIFACTS.mkdir(exist_ok=True)
    for page in pages:
        assert page.screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        shutil.copy(page.screenshot, ARTIFACTS / page.screenshot.name)
        print(f"UI screenshot: {ARTIFACTS / page.screenshot.name} ({page.url})")


def assert_token_in_token_out(store: Path, run_id: str, step: int) -> float:
    """The trainer trains exactly the ids the engines produced, and the engines'
    logprobs are those of the transformers model on those ids at the step's temperature
    (log_softmax(logits / T), the sampling policy). Returns the max gap."""
    run = store / "runs" / run_id
    batch = json.loads((run / "steps" / f"{step:06d}" / "step_batch.json").read_text())
    samples = [s for key in batch["chunk_keys"] for s in json.loads((store / key).read_text())["samples"]]
    assert samples and all(s["weight_version"] == step - 1 for s in samples)
    weights = run / "weights" / f"v{step - 1:06d}"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(weights), local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(weights), local_files_only=True)
    gap = 0.0
    for s in samples:
        assert tok.decode(s["response_ids"], skip_special_tokens=True) == s["response_text"]
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float() / batch.get("temperature", 1.0), -1)
        n = len(s["prompt_ids"])
        mine = [logp[n - 1 + j, t].item() for j, t in enumerate(s["response_ids"])]
        assert len(s["logprobs"]) == len(mine)
        gap = max(gap, *(abs(a - b) for a, b in zip(s["logprobs"], mine)))
    assert gap < 1e-4, gap
    return gap


def test_run_trains_a_users_llama_folder(stack: Stack, tmp_path: Path) -> None:
    """``model.path``: a Hugging Face folder the user brings (here a Llama made locally,
    its own BPE tokenizer and chat template) is the model; the final folder is still a Llama
    with the user's tokenizer."""
    user = tmp_path / "my-llama"
    texts = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    init_model_folder(user, arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tokenizer=train_bpe_tokenizer(texts, 300), seed=5, tie_word_embeddings=False)
    store = tmp_path / "store"
    cfg = tiny_config(store, steps=2)
    cfg["model"] = {"path": str(user)}

    async def main() -> None:
        summary = await run_to_end(await connect(stack.server.address), "llama-run", cfg)
        assert summary.steps == 2

    asyncio.run(main())
    final = store / "runs" / "llama-run" / "weights" / "v000002"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (final / "tokenizer.json").read_bytes() == (user / "tokenizer.json").read_bytes()
    assert_token_in_token_out(store, "llama-run", step=2)


def test_engine_settings_follow_the_run(stack: Stack, tmp_path: Path) -> None:
    """A later run on the same node agent gets the engine count it asks for."""
    store = tmp_path / "store"

    async def main() -> None:
        client = await connect(stack.server.address)
        await run_to_end(client, "two-engines", tiny_config(store, steps=1))
        await run_to_end(client, "one-engine", tiny_config(store, steps=1, engines={"num_engines": 1}))
        p = await client.get_workflow_handle("one-engine").query(TrainingRun.progress)
        assert [e.slot for e in p.engines] == [0] and p.engines[0].state == "healthy"

    asyncio.run(main())
