"""``trainer.backend: megatron``'s trainer (``gpu_runtime.trainer.megatron.trainer``) on CPU.

megatron-core runs no forward on CPU, so the CPU tests split the trainer at that seam:

- its step (LR schedule, AdamW, GRPO loss, metrics, versions) runs around an HF model
  called the way a GPTModel is, against the plain reference ``PolicyTrainer.train_step``
  on the same model: always run (no megatron-core needed);
- a real GPTModel built on CPU from a tiny random Qwen2 / Llama folder (export to an HF
  folder ``transformers`` loads, bitwise; ``save_state`` / ``from_state`` with the optimizer
  and RNG, then the same optimizer step on both: bitwise) runs in its own process (a
  world of one) (megatron-core is a dev dependency: ``make test`` runs these);
- a real GPTModel *trained* on CPU, with megatron-core's three CUDA-only bits (its causal
  mask's and rotary frequencies' device, its dropout's CUDA RNG fork) shimmed
  (``tests.megatron_fixtures.shim_cpu_forward``): the CUDA test's script, rehearsed here,
  with the tolerance float32 on one CPU gives;
- the refusals: a CPU trainer process or a missing megatron-core is a ValueError naming
  what to do, raised when the run binds the trainer, before the run's store is touched.

The GPTModel's own forward and a few steps against the HF trainer on CUDA:
``tests/integration/test_megatron_cuda.py`` (gpu marker).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_runtime.models.model_folder import save_model_folder
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.megatron import trainer as mtrainer
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.service import TrainerService
from spec.model import ModelSpec
from spec.run import CheckpointSpec
from spec.train import SFTSpec, TrainSpec
from spec.trainer import TrainerSpec
from spec.trainer_rpc import RunSetup
from tests.engine_fixtures import REPO, tiny_model
from tests.megatron_fixtures import HFAsGPT, check_service, check_steps, run_service, run_steps
from workflows.stubs import TRAIN_STEP

def _batch(step: int) -> tuple[list[Sample], list[float]]:
    samples = [Sample(sample_id=f"s{step}-p{p}-g{g}", prompt_index=p, group_index=g, prompt_ids=[1, 5 + p, 6 + step],
                      response_ids=[7, 8, 9 + g, 10][: 1 + (g + p + step) % 4],
                      logprobs=[-1.0] * (1 + (g + p + step) % 4), weight_version=step - 1, finish_reason="length")
               for p in range(2) for g in range(4)]
    rewards = [float((g + p * step) % 3) / 2 for p in range(2) for g in range(4)]
    return samples, rewards


def test_train_step_is_the_single_trainers_step(tmp_path: Path) -> None:
    """Three steps (LR warm-up, micro-batches, seq-mean aggregation, clipping) of the megatron
    trainer around the reference's own model: the same metrics by name, the same values,
    the same weights after each step as ``PolicyTrainer.train_step``."""
    model, tok = tiny_model(7)
    save_model_folder(model, tok, tmp_path / "m", weight_version=0)
    hp = TrainSpec(lr=1e-3, warmup_steps=2, micro_batch_size=3, grad_clip=0.5,
                                    loss_agg="seq_mean_token_mean")
    ref = PolicyTrainer.create(tmp_path / "m", hp, 0)
    hf = copy.deepcopy(ref.model)
    mine = mtrainer.MegatronTrainer(HFAsGPT(hf), hf.config, None, ref.tokenizer, hp, 0)
    for step in (1, 2, 3):
        samples, rewards = _batch(step)
        want = ref.train_step(samples, rewards, 4, hp)
        got = mine.train_step(samples, rewards, 4, hp)
        assert set(got) == set(want)
        timing = {"step_seconds", "tokens_per_s"}
        for k in set(want) - timing:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (step, k)
        assert got["lr"] == ref.lr_at(step - 1, hp) and got["policy_version"] == step == mine.opt_steps
        for (name, a), b in zip(hf.state_dict().items(), ref.model.state_dict().values()):
            assert torch.allclose(a, b, atol=1e-6), (step, name)
    assert mine.optimizer.param_groups[0]["lr"] == hp.lr  # past the warm-up


def test_train_step_refuses_what_the_loss_does_not_implement(tmp_path: Path) -> None:
    """A knob ``set_hparams`` could change mid-run is refused by name (the workflow's validator
    refuses it first; this is the trainer's own guard)."""
    model, tok = tiny_model(7)
    hp = TrainSpec()
    mine = mtrainer.MegatronTrainer(HFAsGPT(model), model.config, None, tok, hp, 0)
    samples, rewards = _batch(1)
    refused = r"trainer.backend megatron does not support train.kl_coef > 0 \(no frozen reference model is kept\); train.tis_cap"
    with pytest.raises(ValueError, match=refused):
        mine.train_step(samples, rewards, 4, hp.model_copy(update={"kl_coef": 0.1, "tis_cap": 2.0}))
    assert mine.policy_version == 0
    with pytest.raises(ValueError, match="mode sft"):
        mine.sft_step([], hp)


def test_a_cpu_trainer_or_a_missing_megatron_core_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "needs the node's trainer on CUDA" in (mtrainer.runtime_problem() or "")
    assert "workers.gpu --device cuda" in (mtrainer.runtime_problem() or "")
    assert mtrainer.runtime_problem(need_cuda=False) is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n.startswith("megatron") else real(n, *a))
    problem = mtrainer.runtime_problem(need_cuda=False)
    assert problem is not None and "needs megatron-core (pip install 'milestone[gpu]')" in problem


def test_the_trainer_refuses_a_megatron_run_when_it_binds(tmp_path: Path) -> None:
    """On this CPU node (with or without megatron-core) the first call of a megatron run is a
    ValueError (the activity fails the run as invalid input, no retries), and nothing is
    written to the run's store."""
    store = tmp_path / "store"
    setup = RunSetup(
        run_id="r", store_uri=f"file://{store}", seed=5, model=ModelSpec(), sft=SFTSpec(), hparams=TrainSpec(),
        dataset_key="runs/r/data/train.jsonl", keep_last=CheckpointSpec().keep_last, config_hash="abc", distill=None,
        trainer=TrainerSpec(backend="megatron"),
    )
    svc = TrainerService(tmp_path / "work")
    with pytest.raises(ValueError, match="trainer.backend megatron needs (megatron-core|the node's trainer on CUDA)"):
        svc.ensure_version(setup, 0)
    assert svc.setup is None and not store.exists()


@pytest.mark.parametrize("arch,tie", [("qwen2", True), ("llama", False)])
def test_a_real_gpt_model_exports_and_checkpoints_bitwise(arch: str, tie: bool, tmp_path: Path) -> None:
    model, tok = tiny_model(6, arch=arch, tie=tie)
    save_model_folder(model, tok, tmp_path / "m", weight_version=0)
    (tmp_path / "w").mkdir()
    proc = subprocess.run([sys.executable, "-m", "tests.scripts.megatron_real_model", str(tmp_path / "m"),
                           str(tmp_path / "w")], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert "needs the node's trainer on CUDA" in out["cpu_refused"]
    assert {"config.json", "model.safetensors", "milestone.json", "tokenizer.json"} <= set(out["files"])
    assert out["meta"]["weight_version"] == 0
    assert out["export_bitwise"] and out["checksums"] == [True, True]
    assert out["moved"]
    assert out["restored"] == [True, 2, 2, 0] and out["optimizer_bitwise"] and out["rng_restored"]
    assert out["replay_bitwise"] and out["trained_export_bitwise"]
    assert "field 'backend' is 'megatron'" in out["hf_refuses"]
    assert "field 'backend' is 'single'" in out["megatron_refuses"]


@pytest.mark.parametrize("arch,tie", [("qwen2", True), ("llama", False)])
def test_a_real_gpt_model_trains_like_the_hf_trainer_on_cpu(arch: str, tie: bool, tmp_path: Path) -> None:
    """The CUDA test's three steps on CPU: step 1's loss / grad norm / entropy against
    ``PolicyTrainer.train_step`` (rel 1e-5: the fused q/k/v and gate/up matmuls sum in
    another order), same-seed and restore-at-step-1-and-replay bitwise, the published
    folder bitwise."""
    model, tok = tiny_model(8, arch=arch, tie=tie)
    save_model_folder(model, tok, tmp_path / "m", weight_version=0)
    check_steps(run_steps(tmp_path / "m", tmp_path / "w", "cpu", REPO), rel=1e-5)


def test_a_megatron_run_through_the_trainer_service_restores_bitwise(tmp_path: Path) -> None:
    """What the node's trainer process runs, with CUDA shimmed as above (and its CUDA check
    off): SFT on the HF trainer, the post-SFT weights into a GPTModel (checkpoint v0), two
    RL steps from in-process rollouts on the published folders, a checkpoint at step 1; a
    second service (the trainer process after a crash) restores step 1 and replays step 2
    to the same checksum bitwise."""
    check_service(run_service(tmp_path, "cpu", REPO))


def test_set_hparams_refuses_what_megatron_does_not_implement_mid_run() -> None:
    """The workflow's ``set_hparams`` validator (stand-in activities, a real test server):
    a knob the megatron loss lacks is refused by name before it reaches a step; an
    implemented one is accepted."""
    from temporalio.client import WorkflowUpdateFailedError

    from spec.train import HParamUpdate
    from tests.unit.workflow_harness import Cluster, finish, run_config, scenario, start_run
    from workflows.training_run import TrainingRun

    cluster = Cluster()
    held = cluster.gate(TRAIN_STEP, 1)

    async def body(env, nodes) -> None:
        handle = await start_run(env, run_config(steps=2, trainer={"backend": "megatron"}))
        await held.wait_reached()
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await handle.execute_update(TrainingRun.set_hparams, HParamUpdate(entropy_coef=0.01))
        assert "trainer.backend megatron does not support train.entropy_coef > 0" in str(err.value.cause)
        train = await handle.execute_update(TrainingRun.set_hparams, HParamUpdate(lr=1e-3))
        assert train["lr"] == 1e-3 and train["entropy_coef"] == 0.0
        held.release.set()
        await finish(handle)
        assert [t.batch.hparams.entropy_coef for t in cluster.train_inputs] == [0.0, 0.0]

    scenario(cluster, body)
