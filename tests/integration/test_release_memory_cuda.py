"""``engines.release_memory`` on a GPU (``gpu`` marker: skipped without CUDA): what the
CPU tests cannot see, that the device memory really goes and comes back. In process, so
``torch.cuda.memory_allocated`` sees the engine's tensors and the optimizer's state."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.engine.memory_occupation import release_route, resume_route
from gpu_runtime.engine.server import EngineState
from gpu_runtime.trainer.common.offload import OptimizerOffload
from tests.engine_fixtures import model_dirs_fixture, tiny_model  # noqa: F401

pytestmark = pytest.mark.gpu
BODY = {"input_ids": [[1, 5, 6, 7], [1, 9]], "sampling_params": {"max_new_tokens": 8, "temperature": 1.0,
                                                                  "sampling_seed": 5}, "return_logprob": True}


def test_engine_release_frees_its_weights_and_resume_brings_them_back(model_dirs) -> None:
    state = EngineState(str(model_dirs["v1"]), None, device="cuda:0")
    before = state.generate(BODY)
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in state.model.parameters())
    release_route(state, {})
    assert all(p.device.type == "cpu" and p.is_pinned() for p in state.model.parameters())
    assert loaded - torch.cuda.memory_allocated() >= weights  # every parameter left the device
    resumed = resume_route(state, {})
    assert resumed["checksum"] == model_dirs["c1"]
    assert all(p.device == torch.device("cuda:0") for p in state.model.parameters())
    assert torch.cuda.memory_allocated() >= loaded - 4096  # and came back (buffers included)
    again = state.generate(BODY)
    assert [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in again] == \
           [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in before]


def test_optimizer_offload_frees_adamw_state_and_grads_on_the_gpu() -> None:
    model, _ = tiny_model(3)
    model = model.to("cuda:0")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    snapshot = {(id(p), k): t.clone() for p, st in opt.state.items() for k, t in st.items()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    off = OptimizerOffload()
    off.offload([opt])
    # exp_avg + exp_avg_sq (2x the weights) and the grads (1x) left the device
    assert before - torch.cuda.memory_allocated() >= 3 * params
    off.onload()
    for p, st in opt.state.items():
        for k, t in st.items():
            assert torch.equal(t, snapshot[(id(p), k)]) and (t.dim() == 0 or t.device == p.device)
