"""The CUDA paths of ``--device cuda`` (run where a GPU is lent; skipped here by the
``gpu`` marker): the engine's generation and weight loads on the GPU, the trainer on its
default CUDA device, and megatron-core's forward against the HF model. Each compares the
GPU against a plain reference: the same call again (bitwise), or the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_runtime.engine.client import EngineClient
from gpu_runtime.engine.generate import generate_batch
from gpu_runtime.models.causal_lm import export_state_dict
from gpu_runtime.models.model_folder import load_model_folder, save_model_folder
from gpu_runtime.weight_sync import shared_memory as shm
from tests.engine_fixtures import REPO, free_port, model_dirs, procs, start_engine, tiny_model, wait_for  # noqa: F401

pytestmark = pytest.mark.gpu
PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 10, 11]]


def test_cuda_generation_is_seeded_like_cpu() -> None:
    """Sampling draws from CPU generators on every device: the same seed twice on the GPU
    gives the same tokens bitwise, and greedy tokens match the CPU's (peaked tiny model)."""
    model, tok = tiny_model(1)
    kw = dict(max_new_tokens=16, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    cpu = generate_batch(model, PROMPTS, temperature=0.0, **kw)
    gpu_model = model.to("cuda:0")
    gpu = generate_batch(gpu_model, PROMPTS, temperature=0.0, **kw)
    assert [r.output_ids for r in gpu] == [r.output_ids for r in cpu]
    a = generate_batch(gpu_model, PROMPTS, temperature=1.0, seed=7, **kw)
    b = generate_batch(gpu_model, PROMPTS, temperature=1.0, seed=7, **kw)
    assert [(r.output_ids, r.logprobs) for r in a] == [(r.output_ids, r.logprobs) for r in b]


def test_cuda_engine_loads_from_disk_and_shared_memory(model_dirs, procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    procs.append(start_engine(model_dirs["v1"], port, tmp_path / "e.log", "--device", "cuda:0"))
    c = EngineClient(f"http://127.0.0.1:{port}", timeout_s=120)
    wait_for(c.health, 300, "cuda engine up")
    assert c.server_info()["device"] == "cuda:0"
    assert c.weights_checksum() == (model_dirs["c1"], "1")
    c.update_weights_from_disk(str(model_dirs["v2"]), 2)
    assert c.weights_checksum() == (model_dirs["c2"], "2")
    m1, _, _ = load_model_folder(model_dirs["v1"])
    seg = shm.publish(export_state_dict(m1), 3, tag="cudatest", root=tmp_path)
    c.update_weights_from_shared_memory(str(seg.path), 3, seg.checksum)
    assert c.weights_checksum() == (model_dirs["c1"], "3")
    sp = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3}
    again = [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in c.generate(PROMPTS, sp)]
    assert again == [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in c.generate(PROMPTS, sp)]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_cuda_engine_receives_a_broadcast(backend: str, model_dirs, procs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``engines.weight_sync: distributed`` on the GPU: this process (rank 0, CUDA tensors)
    broadcasts v2 to an engine on cuda:0 (gloo, colocated: staged through host memory) or
    on cuda:1 (NCCL, disaggregated: needs 2 GPUs); the engine serves v2's checksum."""
    import threading

    from gpu_runtime.weight_sync.distributed import GroupSpec, WeightGroup, folder_manifest, group_backend

    engine_gpu = "cuda:0" if backend == "gloo" else "cuda:1"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL between the trainer and an engine needs two GPUs")
    assert group_backend("cuda:0", [engine_gpu]) == backend
    port = free_port()
    procs.append(start_engine(model_dirs["v1"], port, tmp_path / "e.log", "--device", engine_gpu))
    c = EngineClient(f"http://127.0.0.1:{port}", timeout_s=120)
    wait_for(c.health, 300, "cuda engine up")
    m2, _, _ = load_model_folder(model_dirs["v2"])
    state = {k: v.to("cuda:0") for k, v in export_state_dict(m2).items()}
    manifest = folder_manifest(model_dirs["v2"])
    spec = GroupSpec("127.0.0.1", free_port(), 2, f"cuda-{backend}", backend)
    errors: list[BaseException] = []

    def engine_side() -> None:
        try:
            c.init_weights_update_group(master_address=spec.master_address, master_port=spec.master_port,
                                        rank_offset=1, world_size=2, group_name=spec.group_name, backend=backend,
                                        timeout_s=60)
            c.update_weights_from_distributed(**manifest.as_request(), group_name=spec.group_name, version=2,
                                              checksum=model_dirs["c2"])
            c.destroy_weights_update_group(spec.group_name)
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    t = threading.Thread(target=engine_side)
    t.start()
    torch.cuda.set_device(0)
    group = WeightGroup(spec, 0, timeout_s=60)
    try:
        group.send(state, manifest)
    finally:
        group.close()
        t.join()
    assert not errors, errors
    assert c.weights_checksum() == (model_dirs["c2"], "2")


_TRAIN = """
import sys, torch
from gpu_runtime.trainer.server import use_device
use_device(sys.argv[2])
torch.use_deterministic_algorithms(True)
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.api import TrainerHParams
from gpu_runtime.trainer.policy import PolicyTrainer
from workflows.config import TrainSpec
hp = TrainerHParams(**TrainSpec(lr=1e-3, micro_batch_size=2).model_dump())
t = PolicyTrainer.create(sys.argv[1], hp, 0)
assert next(t.model.parameters()).device.type == sys.argv[2].split(":")[0]
samples = [Sample(sample_id=f"s1-p0-g{g}", prompt_index=0, group_index=g, prompt_ids=[1, 5, 6], response_ids=[7, 8, 9 + g],
                  logprobs=[-1.0] * 3, weight_version=0, finish_reason="length") for g in range(4)]
m = t.train_step(samples, [1.0, 0.0, 0.5, 0.0], 4, hp)
print(t.checksum(), repr(m["grad_norm"]))
"""


def test_cuda_trainer_is_bitwise_repeatable_and_close_to_cpu(model_dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cmd = [sys.executable, "-c", _TRAIN, str(model_dirs["v1"])]
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    runs = [subprocess.run([*cmd, dev], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
            for dev in ("cuda:0", "cuda:0", "cpu")]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    (s1, l1), (s2, l2), (_, lc) = (r.stdout.split() for r in runs)
    assert s1 == s2 and l1 == l2  # the same step twice on the GPU: the same weights bitwise
    assert float(lc) > 0 and abs(float(l1) - float(lc)) <= 1e-4 * float(lc)  # the CPU's grad norm, to float32 noise


def test_megatron_forward_matches_hf_on_cuda(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    model, tok = tiny_model(6)
    save_model_folder(model, tok, tmp_path / "m", weight_version=0)
    script = f"""
import torch
from gpu_runtime.models.causal_lm import load_causal_lm
from gpu_runtime.trainer.megatron import model as mm
mm.init_single_process()
gpt, cfg = mm.from_folder({str(tmp_path / "m")!r})
gpt = gpt.cuda().float()
hf = load_causal_lm({str(tmp_path / "m")!r}).cuda()
ids = torch.tensor([[1, 5, 6, 7, 8, 9]], device="cuda")
pos = torch.arange(6, device="cuda")[None]
with torch.no_grad():
    a = gpt(input_ids=ids, position_ids=pos, attention_mask=None).float()
    b = hf(input_ids=ids).logits.float()
print(float((a - b).abs().max()))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.split()[-1]) < 1e-3


_MEGATRON_STEP = """
import sys, torch
from gpu_runtime.trainer.server import use_device
use_device("cuda:0")
from gpu_runtime.models.model_folder import weights_checksum
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.api import TrainerHParams
from gpu_runtime.trainer.megatron import model as mm
from gpu_runtime.trainer.megatron.train import grpo_step
from gpu_runtime.trainer.policy import PolicyTrainer
from workflows.config import TrainSpec
hp = TrainerHParams(**TrainSpec(lr=1e-4, micro_batch_size=4).model_dump())
samples = [Sample(sample_id=f"s1-p0-g{g}", prompt_index=0, group_index=g, prompt_ids=[1, 5, 6],
                  response_ids=[7, 8, 9 + g][: 1 + g % 3], logprobs=[-1.0] * (1 + g % 3), weight_version=0,
                  finish_reason="length") for g in range(4)]
rewards = [1.0, 0.0, 0.5, 0.0]
ref = PolicyTrainer.create(sys.argv[1], hp, 0)
want = ref.train_step(samples, rewards, 4, hp)
mm.init_single_process()
gpt, cfg = mm.from_folder(sys.argv[1])
gpt = gpt.cuda().float()
opt = torch.optim.AdamW(gpt.parameters(), lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay, foreach=False)
got = grpo_step(gpt, opt, samples, rewards, 4, hp, ref.tokenizer.pad_token_id)
after = mm.export_hf_weights(gpt, cfg)
mine = ref.published_state()
diff = max(float((after[k].float() - mine[k].float()).abs().max()) for k in mine)
print(want["grad_norm"], got["grad_norm"], want["loss"], got["loss"], diff)
"""


def test_megatron_grpo_step_matches_the_single_trainer_on_cuda(tmp_path: Path) -> None:
    """One GRPO step on a GPTModel (megatron.train) against ``PolicyTrainer.train_step`` on
    the HF model from the same folder: grad norm and loss agree to float32 noise, and the
    updated weights (converted back to HF names) are within an AdamW step's size."""
    pytest.importorskip("megatron.core")
    model, tok = tiny_model(8)
    save_model_folder(model, tok, tmp_path / "m", weight_version=0)
    r = subprocess.run([sys.executable, "-c", _MEGATRON_STEP, str(tmp_path / "m")], capture_output=True, text=True,
                       timeout=600, cwd=REPO, env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert r.returncode == 0, r.stderr[-3000:]
    g_want, g_got, l_want, l_got, diff = (float(x) for x in r.stdout.split()[-5:])
    assert g_got == pytest.approx(g_want, rel=1e-3) and l_got == pytest.approx(l_want, rel=1e-3, abs=1e-6)
    assert diff < 3e-4  # lr 1e-4: a flipped near-zero gradient moves a weight by at most ~2 lr
