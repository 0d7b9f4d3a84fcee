"""One rank of a sharded trainer cell: the RL train step of ``PolicyTrainer`` over FSDP2.

A cell is ``world`` ranks in one ``torch.distributed`` group (gloo on CPU, NCCL on CUDA).
Each rank holds the policy sharded with ``fully_shard`` per decoder layer plus the root,
and trains on its share of the step's micro-batches: micro-batch ``k`` belongs to rank
``k % world`` (a fixed order, so a step is reproducible for a given rank count). Every
rank computes the whole batch's loss weights and advantages (cheap: masks and rewards),
so the per-micro-batch losses are the single trainer's; FSDP sums the gradients over the
ranks (divide factor 1) and AdamW steps each rank's shard, which is elementwise and so the
same arithmetic as one process. Only the order of float sums differs from ``single``.

The loss code is ``PolicyTrainer.train_step`` itself; this class overrides the share, the
metric reduction (the shared optimizer step reads the DTensor grad norm), and saves/restores its state with
``torch.distributed.checkpoint`` (each rank writes its shards).

``train.precision: bf16`` is the single trainer's: autocast around each forward, not FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. The sharded parameters are
all-gathered in float32 and autocast rounds the same matmul inputs the single trainer
rounds, so a micro-batch's forward is the single trainer's bitwise and the comparison with
``single`` keeps its float32 tolerance; gradients are float32 (their parameters are), so the
reduce-scatter is float32 as ``reduce_dtype=fp32`` would make it. The price is float32
all-gathers (twice the bytes of a bf16 ``param_dtype``), and a policy that casts whole
layers to bf16 (norms, residual adds) would compute a different model than the single trainer.
"""

from __future__ import annotations

import random
from pathlib import Path
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from gpu_runtime.models.causal_lm import load_causal_lm, shape_summary, tied_embeddings
from gpu_runtime.models.model_folder import save_model_folder, weights_checksum
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.store.artifacts import Sample, derive_seed
from gpu_runtime.trainer.common.batches import cell_reduced
from gpu_runtime.trainer.common.state_io import read_meta, restore_progress, write_meta
from gpu_runtime.trainer.policy.trainer import PolicyTrainer, frozen_copy
from spec.train import TrainSpec
from spec.trainer import train_conflicts

CELL_META_FILE = "cell_meta.json"  # written by rank 0 after every rank's shards
CELL_FORMAT_VERSION = 1


def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The transformer blocks ``fully_shard`` wraps one by one (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers to shard per decoder layer")
    return list(layers)


def shard(model: PreTrainedModel) -> PreTrainedModel:
    """FSDP2 over the cell's default group: each decoder layer, then the root; gradients
    are summed over the ranks (each rank's loss is already its share of the batch's)."""
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM), no divide
    return model


class CellRankTrainer(PolicyTrainer):
    """``PolicyTrainer`` on one rank of a cell; every rank must call each method in the same order."""

    rank: int = 0
    world: int = 1

    @classmethod
    def create_rank(cls, base_folder: str | Path, hparams: TrainSpec, seed: int) -> CellRankTrainer:
        """The rank's trainer over the model folder (every rank loads the same weights, then
        keeps its shard). The KL reference, when there is one, is a full frozen copy per rank."""
        if not dist.is_initialized():
            raise RuntimeError("CellRankTrainer.create_rank: torch.distributed is not initialised")
        if bad := train_conflicts("fsdp2", hparams):
            raise ValueError(f"trainer.backend fsdp2 does not support {'; '.join(bad)}")
        tokenizer = Tokenizer.load(base_folder)
        model = load_causal_lm(base_folder)
        torch.manual_seed(derive_seed("trainer", seed) % (1 << 63))
        random.seed(derive_seed("trainer-py", seed))
        model.train()
        ref = frozen_copy(model) if hparams.kl_coef > 0 else None
        trainer = cls(shard(model), tokenizer, hparams, seed, ref)  # the optimizer is built over the shards
        trainer.rank, trainer.world = dist.get_rank(), dist.get_world_size()
        return trainer

    # ------------------------------------------------------------ the step
    def train_step(self, samples: list[Sample], rewards: list[float], group_size: int,
                   hparams: TrainSpec, temperature: float = 1.0) -> dict[str, float]:
        if bad := train_conflicts("fsdp2", hparams):  # ``set_hparams`` may change ``train`` mid-run
            raise ValueError(f"trainer.backend fsdp2 does not support {'; '.join(bad)}")
        return super().train_step(samples, rewards, group_size, hparams, temperature)

    def micro_batch_share(self, n: int) -> list[int]:
        if n % self.world:
            # FSDP's collectives need the same number of forward/backward passes on every rank
            raise ValueError(
                f"trainer.ranks_per_cell={self.world} must divide the step's {n} micro-batches "
                "(samples per step / train.micro_batch_size, rounded up)"
            )
        return list(range(self.rank, n, self.world))

    def reduce_over_cell(self, sums: dict[str, float]) -> dict[str, float]:
        return cell_reduced(sums, self.rank, self.world, dist.all_reduce)

    def sft_warmup(self, *args: object, **kwargs: object) -> dict[str, float]:
        raise NotImplementedError("trainer.backend fsdp2: the SFT warm-up runs before the cell (sft.steps: 0)")

    # ------------------------------------------------- weights, full and sharded
    def published_state(self) -> dict[str, torch.Tensor]:
        """The full weights, gathered to CPU on rank 0 only (other ranks get ``{}``): one
        full copy, on the rank that publishes. Every rank must call it (it all-gathers)."""
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.model, options=opts)
        if self.rank != 0:
            return {}
        if tied_embeddings(self.model):
            full.pop("lm_head.weight", None)  # ``export_state_dict`` naming: a tied head is left out
        return {k: cast(torch.Tensor, v).contiguous() for k, v in full.items()}  # a model's state: tensors

    def checksum(self) -> str:
        """The published weights' checksum, the same on every rank."""
        sd = self.published_state()
        out = [weights_checksum(sd) if self.rank == 0 else ""]
        dist.broadcast_object_list(out, src=0)
        return str(out[0])

    def export_model_folder(self, folder: str | Path) -> str:
        """This version as a plain HF folder, written by rank 0 from the gathered weights (every
        rank calls it). The returned checksum is rank 0's."""
        sd = self.published_state()
        out = [""]
        if self.rank == 0:
            out = [save_model_folder(self.model, self.tokenizer, folder, weight_version=self.policy_version, weights=sd)]
        dist.broadcast_object_list(out, src=0)
        return str(out[0])

    def collective_seconds(self, reps: int) -> dict[str, float]:
        """What the cell's collectives cost here (bench/bench_trainer_cell.py), median of
        ``reps``: the full state dict gathered to CPU for publication, and one all-gather /
        reduce-scatter of a flat float32 buffer the size of the parameters (FSDP2 runs one
        all-gather per forward and per backward and one reduce-scatter per backward of every
        micro-batch, layer by layer). Every rank must call it."""
        import statistics
        import time

        n = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in self.model.parameters())  # this shard
        full = torch.zeros(n * self.world, dtype=torch.float32)
        local = torch.ones(n, dtype=torch.float32)

        def timed(fn: Callable[[], object]) -> float:
            out = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return statistics.median(out)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "gather_state_dict": timed(lambda: get_model_state_dict(self.model, options=opts)),
            "all_gather": timed(lambda: dist.all_gather_into_tensor(full, local)),
            "reduce_scatter": timed(lambda: dist.reduce_scatter_tensor(local, full)),
            "param_mib": n * self.world * 4 / 2**20,
        }

    # ------------------------------------------------------------- state
    def _state(self, with_optimizer: bool) -> dict[str, Any]:
        """The sharded state. A fresh optimizer (no step taken yet) is left out: reading its
        state dict would initialise it (a zero step that shifts AdamW's bias correction)."""
        out: dict[str, Any] = {"model": get_model_state_dict(self.model)}  # dcp.load fills it in place
        if with_optimizer:
            out["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return out

    def save_state(self, folder: str | Path) -> None:
        """The cell's state into ``folder``: every rank's shards (``torch.distributed.checkpoint``),
        the reference's full weights and the meta (rank 0), meta last."""
        folder = Path(folder)
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        with_optimizer = bool(self.optimizer.state)  # the same on every rank (they step together)
        dcp.save(self._state(with_optimizer), checkpoint_id=str(folder / "shards"))
        checksum = self.checksum()
        if self.rank == 0:
            if self.ref_model is not None:
                torch.save(self.ref_model.state_dict(), folder / "reference.pt")
            self.tokenizer.save(folder)
            self.model.config.save_pretrained(str(folder))
            write_meta(folder, {
                "ranks": self.world, "policy_version": self.policy_version,
                "opt_steps": self.opt_steps, "seed": self.seed, "model_config": shape_summary(self.model),
                "hparams": self.hparams.model_dump(mode="json"), "has_reference": self.ref_model is not None,
                "optimizer_state": with_optimizer, "checksum": checksum,
            }, CELL_META_FILE, CELL_FORMAT_VERSION)
        torch.save(torch.get_rng_state(), folder / f"rng-rank{self.rank}.pt")
        dist.barrier()

    def load_state(self, folder: str | Path) -> None:
        """Restore the state ``save_state`` wrote: bitwise with the same rank count; into another
        rank count (reshard) the same tensors, each rank reading its slice. (The optimizer's
        state is loaded in place: ``get_optimizer_state_dict`` returns views of its shards.)"""
        folder = Path(folder)
        path = folder / CELL_META_FILE
        meta = read_meta(folder, CELL_META_FILE, CELL_FORMAT_VERSION, "cell state")
        # a different rank count reshards: DCP reads each rank's slice of every saved tensor
        if meta["model_config"] != shape_summary(self.model):
            raise ValueError(f"{path}: field 'model_config' does not match this cell's model")
        self.hparams = TrainSpec.model_validate(meta["hparams"])
        self.optimizer = self.new_optimizer(self.hparams)
        state = self._state(bool(meta["optimizer_state"]))
        dcp.load(state, checkpoint_id=str(folder / "shards"))
        set_model_state_dict(self.model, state["model"])
        if "optim" in state:  # else: saved before the first step, the fresh optimizer is the state
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        if meta["has_reference"]:
            if self.ref_model is None:
                raise ValueError(f"{path}: the checkpoint has a KL reference, this cell was built without one")
            self.ref_model.load_state_dict(torch.load(folder / "reference.pt", weights_only=True))
        rng = folder / f"rng-rank{self.rank}.pt"  # a rank the saving cell did not have: rank 0's
        torch.set_rng_state(torch.load(rng if rng.exists() else folder / "rng-rank0.pt", weights_only=True))
        restore_progress(self, meta, folder / "shards")
        self.model.train()


__all__ = ["CellRankTrainer", "shard"]
