"""``trainer.backend: megatron`` on CUDA (``gpu`` marker: skipped without a GPU; megatron-core
is a dev dependency, and the device run carries its wheel). The plain reference is the HF trainer,
``PolicyTrainer.train_step``, on the same folder and batch: the megatron trainer's first
step has its loss and grad norm to float32 noise (rel 1e-3: the GPTModel fuses q/k/v and
gate/up into one matmul each, so sums run in another order). Then what a run relies on:
the same seed twice gives the same weights bitwise after three steps, a checkpoint after
step 1 restored in a fresh trainer and replayed to step 3 gives them too, and the
published HF folder ``transformers`` loads is the trainer's weights bitwise.

The program (``tests/scripts/megatron_steps.py``) runs in a subprocess: megatron-core's
world of one and the process's default CUDA device (as ``trainer.server --device cuda:0``
sets it) stay out of pytest's process. Its CPU rehearsal (megatron-core's CUDA-only bits
shimmed) is ``tests/unit/test_megatron_trainer.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.models.model_folder import save_model_folder
from tests.engine_fixtures import REPO, tiny_model
from tests.megatron_fixtures import check_service, check_steps, run_service, run_steps

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch,tie", [("qwen2", True), ("llama", False)])
def test_megatron_trainer_on_cuda_matches_the_hf_trainer_and_replays_bitwise(arch: str, tie: bool,
                                                                             tmp_path: Path) -> None:
    model, tok = tiny_model(8, arch=arch, tie=tie)
    save_model_folder(model, tok, tmp_path / "m", weight_version=0)
    check_steps(run_steps(tmp_path / "m", tmp_path / "w", "cuda", REPO), rel=1e-3)


def test_a_megatron_run_through_the_trainer_service_restores_bitwise_on_cuda(tmp_path: Path) -> None:
    """``TrainerService`` as a ``--device cuda`` node's trainer process runs it: SFT -> GPTModel,
    two steps, a checkpoint; a second service restores and replays bitwise."""
    check_service(run_service(tmp_path, "cuda", REPO))
