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

from gpu_runtime.engine.generate import generate_batch
from gpu_runtime.models.causal_lm import export_state_dict
from gpu_runtime.models.model_folder import load_model_folder, save_model_folder
from gpu_runtime.weight_sync import shared_memory as shm
from tests.engine_fixtures import REPO, free_port, model_dirs_fixture, procs_fixture, started_engine, tiny_model  # noqa: F401
from tests.scripts.fsdp2_rank import cell_hparams, cell_samples

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


def test_cuda_engine_loads_from_disk_and_shared_memory(model_dirs, procs, tmp_path: Path) -> None:
    c = started_engine(procs, model_dirs["v1"], tmp_path / "e.log", "--device", "cuda:0", timeout_s=120,
                       up_within_s=300, what="cuda engine up")
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
def test_cuda_engine_receives_a_broadcast(backend: str, model_dirs, procs, tmp_path: Path) -> None:
    """``engines.weight_sync: distributed`` on the GPU: this process (rank 0, CUDA tensors)
    broadcasts v2 to an engine on cuda:0 (gloo, colocated: staged through host memory) or
    on cuda:1 (NCCL, disaggregated: needs 2 GPUs); the engine serves v2's checksum."""
    import threading

    from gpu_runtime.weight_sync.distributed import GroupSpec, WeightGroup, folder_manifest, group_backend

    engine_gpu = "cuda:0" if backend == "gloo" else "cuda:1"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL between the trainer and an engine needs two GPUs")
    assert group_backend("cuda:0", [engine_gpu]) == backend
    c = started_engine(procs, model_dirs["v1"], tmp_path / "e.log", "--device", engine_gpu, timeout_s=120,
                       up_within_s=300, what="cuda engine up")
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


def test_cuda_trainer_is_bitwise_repeatable_and_close_to_cpu(model_dirs, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tests.scripts.cuda_train_step", str(model_dirs["v1"])]
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    runs = [subprocess.run([*cmd, dev], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
            for dev in ("cuda:0", "cuda:0", "cpu")]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    (s1, l1), (s2, l2), (_, lc) = (r.stdout.split() for r in runs)
    assert s1 == s2 and l1 == l2  # the same step twice on the GPU: the same weights bitwise
    assert float(lc) > 0 and abs(float(l1) - float(lc)) <= 1e-4 * float(lc)  # the CPU's grad norm, to float32 noise


def test_megatron_forward_matches_hf_on_cuda(tmp_path: Path) -> None:
    model, tok = tiny_model(6)
    save_model_folder(model, tok, tmp_path / "m", weight_version=0)
    r = subprocess.run([sys.executable, "-m", "tests.scripts.megatron_forward_cuda", str(tmp_path / "m")],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.split()[-1]) < 1e-3


def test_megatron_grpo_step_matches_the_single_trainer_on_cuda(tmp_path: Path) -> None:
    """One GRPO step on a GPTModel (megatron.train) against ``PolicyTrainer.train_step`` on
    the HF model from the same folder: grad norm and loss agree to float32 noise, and the
    updated weights (converted back to HF names) are within an AdamW step's size."""
    model, tok = tiny_model(8)
    save_model_folder(model, tok, tmp_path / "m", weight_version=0)
    r = subprocess.run([sys.executable, "-m", "tests.scripts.megatron_step_cuda", str(tmp_path / "m")], capture_output=True,
                       text=True, timeout=600, cwd=REPO, env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert r.returncode == 0, r.stderr[-3000:]
    g_want, g_got, l_want, l_got, diff = (float(x) for x in r.stdout.split()[-5:])
    assert g_got == pytest.approx(g_want, rel=1e-3) and l_got == pytest.approx(l_want, rel=1e-3, abs=1e-6)
    assert diff < 3e-4  # lr 1e-4: a flipped near-zero gradient moves a weight by at most ~2 lr


# ---- fsdp2 cells on CUDA: one GPU per rank, NCCL (gpu_runtime.trainer.fsdp2.device) ----------
# A rank launched torchrun-style (RANK / LOCAL_RANK / MASTER_*), no Ray: the GPU image has
# none. The same CellRankTrainer, placement and determinism settings as a Ray actor rank
# (tests/scripts/fsdp2_rank.py).
def run_ranks(folder: Path, kind: str, world: int, precision: str, out: Path, single: bool = False) -> dict:
    """``world`` rank processes of a cell (``single``: one process, PolicyTrainer) on ``kind``;
    rank 0's weights and metrics after two GRPO steps."""
    port = free_port()
    procs_ = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(REPO),
               **({"SINGLE": "1"} if single else {})}
        procs_.append(subprocess.Popen([sys.executable, "-m", "tests.scripts.fsdp2_rank", str(folder), kind, precision,
                                        str(out)],
                                       cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for p in procs_:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs_:
            if p.poll() is None:
                p.kill()
                p.wait()
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp2_cell_on_cuda_matches_the_single_trainer(
        model_dirs, tmp_path: Path, precision: str) -> None:
    """A fsdp2 cell of 2 ranks on 2 GPUs (1 rank where the machine has one GPU), NCCL, against
    ``PolicyTrainer`` on cuda:0 from the same folder: the same metrics and weights up to the
    order of the gradient sums (the CPU cell's tolerance, tests/unit/test_trainer_cell.py),
    and the cell against itself bitwise."""
    world = 2 if torch.cuda.device_count() >= 2 else 1
    single = run_ranks(model_dirs["v1"], "cuda", 1, precision, tmp_path / "single.pt", single=True)
    cell = run_ranks(model_dirs["v1"], "cuda", world, precision, tmp_path / "cell.pt")
    again = run_ranks(model_dirs["v1"], "cuda", world, precision, tmp_path / "again.pt")
    assert all(torch.equal(cell["weights"][k], again["weights"][k]) for k in cell["weights"])
    for mine, theirs in zip(cell["metrics"], single["metrics"]):
        for k in ("loss", "grad_norm", "entropy", "tokens", "policy_version"):
            assert mine[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), k
    worst = max(float((cell["weights"][k] - single["weights"][k]).abs().max()) for k in single["weights"])
    assert worst <= (1e-5 if precision == "fp32" else 5e-5), f"max |cell - single| = {worst}"


def test_fsdp2_cell_on_cuda_through_ray(model_dirs, tmp_path: Path) -> None:
    """The driver's path: ``TrainerCell(device="cuda")`` reserves one GPU per rank in its Ray
    placement group and each actor trains on the GPU Ray assigned it."""
    from gpu_runtime.trainer.fsdp2.cell import TrainerCell
    from gpu_runtime.trainer.fsdp2.ray_runtime import RayRuntime

    world = 2 if torch.cuda.device_count() >= 2 else 1
    hp = cell_hparams("bf16")
    single = run_ranks(model_dirs["v1"], "cuda", 1, "bf16", tmp_path / "single.pt", single=True)
    rt = RayRuntime(num_cpus=world).start()
    try:
        cell = TrainerCell(world, model_dirs["v1"], hp, 0, device="cuda")
        try:
            assert [w["device"] for w in cell.where] == ["cuda:0"] * world  # each sees its one GPU as cuda:0
            metrics = [cell.train_step(*cell_samples(step), 4, hp) for step in (1, 2)]
            weights = cell.published_state()
        finally:
            cell.close()
    finally:
        rt.stop()
    assert [m["grad_norm"] for m in metrics] == pytest.approx([m["grad_norm"] for m in single["metrics"]], rel=1e-4)
    assert max(float((weights[k] - single["weights"][k]).abs().max()) for k in weights) <= 5e-5
