"""The node's device choice (``gpu_runtime.proc.devices``) and how it reaches the
processes it starts: pure logic, tested with a GPU count passed in (no CUDA here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpu_runtime.engine.backends import SGLangEngineBackend, TorchEngineBackend
from gpu_runtime.proc.devices import Placement, child_env, gpu_list, parse_gpu_list, plan_placement
from gpu_runtime.node.runtime import NodeRuntime


def test_cpu_places_everything_on_the_cpu() -> None:
    p = plan_placement("cpu", 0)
    assert p == Placement("cpu", ("cpu",)) and not p.uses_cuda
    assert p.engine_device(3) == "cpu"


def test_cuda_default_is_colocated_on_the_trainer_gpu() -> None:
    p = plan_placement("cuda", 1)
    assert p.trainer == "cuda:0" and p.engines == ("cuda:0",) and p.uses_cuda
    p = plan_placement("cuda", 4, trainer_gpu=2)
    assert p.trainer == "cuda:2" and [p.engine_device(i) for i in range(3)] == ["cuda:2"] * 3


def test_cuda_disaggregated_engines_cycle_over_their_gpus() -> None:
    p = plan_placement("cuda", 4, trainer_gpu=0, engine_gpus=[1, 2, 3])
    assert [p.engine_device(i) for i in range(5)] == ["cuda:1", "cuda:2", "cuda:3", "cuda:1", "cuda:2"]


def test_fsdp2_cell_ranks_never_take_an_engines_gpu() -> None:
    """``cell_gpus``: the trainer's GPU first, then every GPU no engine holds."""
    assert plan_placement("cpu", 0).cell_gpus == ()
    assert plan_placement("cuda", 4).cell_gpus == (0, 1, 2, 3)  # colocated: engines share the trainer's GPU
    assert plan_placement("cuda", 4, trainer_gpu=2).cell_gpus == (2, 0, 1, 3)
    assert plan_placement("cuda", 8, trainer_gpu=0, engine_gpus=[6, 7]).cell_gpus == (0, 1, 2, 3, 4, 5)
    # an engine on the trainer's GPU shares it (release_memory), so a rank may too
    assert plan_placement("cuda", 4, trainer_gpu=0, engine_gpus=[0, 3]).cell_gpus == (0, 1, 2)


@pytest.mark.parametrize("device,count,kw,needle", [
    ("cuda", 0, {}, "no CUDA device"),
    ("cuda", 2, {"trainer_gpu": 2}, "out of range"),
    ("cuda", 2, {"engine_gpus": [0, 5]}, "[5] out of range"),
    ("cpu", 0, {"engine_gpus": [0]}, "--engine-gpus needs --device cuda"),
    ("tpu", 0, {}, "cpu or cuda"),
])
def test_bad_placements_name_the_flag(device: str, count: int, kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        plan_placement(device, count, **kw)
    assert needle in str(err.value)


def test_parse_gpu_list() -> None:
    assert parse_gpu_list(None) is None and parse_gpu_list(" ") is None
    assert parse_gpu_list("0, 2") == [0, 2]
    for bad in ("a,b", "-1"):
        with pytest.raises(ValueError, match="--engine-gpus"):
            parse_gpu_list(bad)
    with pytest.raises(ValueError, match="--cell-gpus"):
        parse_gpu_list("x", "--cell-gpus")
    assert gpu_list((0, 2)) == "0,2" and parse_gpu_list(gpu_list([3, 1])) == [3, 1]


def test_cuda_children_get_cublas_determinism_and_cpu_children_do_not() -> None:
    assert child_env("cuda:0", {})["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in child_env("cpu", {})
    assert child_env("cuda:1", {"CUBLAS_WORKSPACE_CONFIG": ":16:8"})["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_engine_backends_put_each_slot_on_its_device() -> None:
    torch_backend = TorchEngineBackend(devices=("cuda:1", "cuda:2"))
    assert torch_backend.slot_args(0) == ["--device", "cuda:1"] and torch_backend.slot_args(3) == ["--device", "cuda:2"]
    assert torch_backend.env()["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert TorchEngineBackend().slot_args(0) == []
    assert SGLangEngineBackend(gpus=(0, 1)).slot_args(1) == ["--base-gpu-id", "1"]
    assert SGLangEngineBackend().slot_args(0) == []


def test_node_runtime_hands_the_placement_to_trainer_and_engines(tmp_path) -> None:
    rt = NodeRuntime("n", "b", tmp_path, placement=plan_placement("cuda", 3, trainer_gpu=0, engine_gpus=[1]))
    assert rt.trainer.device == "cuda:0" and rt.trainer.command()[-4:] == ["--device", "cuda:0", "--cell-gpus", "0,2"]
    backend = rt.engines._backend("torch")
    assert isinstance(backend, TorchEngineBackend) and backend.slot_args(0) == ["--device", "cuda:1"]
    sg = rt.engines._backend("sglang")
    assert isinstance(sg, SGLangEngineBackend) and sg.gpus == (1,)


def test_agent_refuses_cuda_without_a_gpu_before_connecting() -> None:
    """On this CPU machine ``--device cuda`` is refused with the reason (exit 2, argparse)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = subprocess.run([sys.executable, "-m", "workers.gpu", "--device", "cuda", "--address", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no CUDA device" in out.stderr


def test_trainer_on_a_missing_gpu_dies_at_start_with_the_reason(tmp_path) -> None:
    """The device reaches the trainer process: ``cuda:0`` on this CPU machine stops it before READY."""
    import torch

    from gpu_runtime.trainer.process import TrainerDied, TrainerProcess

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    tp = TrainerProcess(tmp_path, tmp_path / "t.log", device="cuda:0")
    with pytest.raises(TrainerDied):
        tp.start()
    assert "--device cuda:0: no CUDA device visible to the trainer" in (tmp_path / "t.log").read_text()


def test_generation_ignores_torchs_default_device() -> None:
    """A CUDA trainer process makes its GPU torch's default device (``use_device``); the
    engine code it shares (eval generation) must still build its inputs and draw its
    samples on the CPU generators. ``meta`` stands in for the GPU here: any tensor that
    followed the default device would fail; the tokens and logprobs must not change."""
    import torch

    from gpu_runtime.engine.generate import generate_batch
    from tests.engine_fixtures import tiny_model

    model, tok = tiny_model(1)
    kw = dict(max_new_tokens=6, temperature=1.0, seed=3, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    prompts = [[1, 5, 6, 7], [1, 9]]
    plain = generate_batch(model, prompts, **kw)
    with torch.device("meta"):
        moved = generate_batch(model, prompts, **kw)
    assert [(r.output_ids, r.logprobs) for r in moved] == [(r.output_ids, r.logprobs) for r in plain]
