"""Building a version of the bound run's policy: trainer state at version v = last durable
checkpoint c + replay of the stored artifacts of steps c+1..v (DESIGN §6), or, with nothing
durable, the deterministic SFT warm-up from the seed (version 0, checkpointed at once).

Policy version v is produced by step v (version 0 is the SFT warm-up), so checkpoint
``step-v`` holds version v. A replayed step is the trainer's ``replay_step`` of the stored
``step_batch.json``: bitwise the step that committed.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from gpu_runtime.data.datasets import prompts_for_step
from gpu_runtime.store import artifacts as art
from gpu_runtime.trainer.common.step_samples import step_samples
from gpu_runtime.trainer.fsdp2.errors import CellFailed
from gpu_runtime.trainer.layouts import TrainerLayouts
from gpu_runtime.trainer.protocol import Trainer
from gpu_runtime.trainer.run_binding import RunBinding
from gpu_runtime.trainer.version_publisher import VersionPublisher
from spec.trainer_rpc import Rebuild, StepBatch

log = logging.getLogger(__name__)


class VersionBuilder:
    def __init__(self, run: RunBinding, layouts: TrainerLayouts, publisher: VersionPublisher) -> None:
        self.run = run
        self.layouts = layouts
        self.publisher = publisher  # the warm-up's version 0 is published before its checkpoint

    def build(self, target: int) -> tuple[Trainer, Rebuild, dict[str, float]]:
        """The run's trainer at ``target``: restored + replayed, or SFT from scratch; how it was
        rebuilt and the warm-up's metrics (empty unless it ran)."""
        restored, sft_metrics, trainer = self._restore_at_or_below(target)
        rebuild = Rebuild(restored_from_step=restored, replayed_steps=self._replay_to(trainer, target))
        return trainer, rebuild, sft_metrics

    def _restore_at_or_below(self, target: int) -> tuple[int | None, dict[str, float], Trainer]:
        run = self.run
        for info, ckpts in reversed(run.durable_at_or_below(target)):
            folder = Path(tempfile.mkdtemp(dir=run.work_dir, prefix="restore-"))
            try:
                got = ckpts.restore(folder, step=info.step)
                trainer = self.layouts.new(run.setup, run.base_folder())
                trainer.load_state(folder)
                run.trainer = trainer
                log.info("restored checkpoint step %d (v%d)", got.step, trainer.policy_version)
                return got.step, {}, trainer
            except CellFailed as err:  # the cell, not the checkpoint: an older one would not help
                self.layouts.cell_failed(err)
                raise
            except Exception as err:  # corrupt / missing: fall back to an older one
                log.warning("checkpoint step %d unusable: %s", info.step, err)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
                run.absorb_events(ckpts)  # an ancestor's corrupt checkpoint is this run's event too
        # nothing durable: deterministic SFT warm-up from the seed -> version 0
        s = run.setup
        sft = self.layouts.sft_trainer(s, run.base_folder())
        rows = run.rows()
        metrics = sft.sft_warmup(
            rows, s.sft.steps, s.sft.batch_size, s.sft.lr, s.seed, s.sft.grad_clip, betas=s.sft.betas)
        trainer = run.trainer = self.layouts.after_sft(s, sft)
        self.publisher.publish(run, trainer)  # checkpoint 0 uploads v0's model folder with it
        run.saver.save(trainer, 0, data_cursor=0, sync=True, checksum=self.publisher.checksum(run.run_id, 0))
        return None, metrics, trainer

    def _replay_to(self, trainer: Trainer, target: int) -> list[int]:
        run = self.run
        replayed = []
        while trainer.policy_version < target:
            step = trainer.policy_version + 1
            key = art.step_batch_key(run.owner(step), step)
            if not run.store.exists(key):
                raise RuntimeError(f"cannot replay step {step}: {key} missing from the store")
            train(run, trainer, StepBatch.model_validate_json(run.store.get_bytes(key)), replay=True)
            replayed.append(step)
        if trainer.policy_version != target:
            raise RuntimeError(f"trainer at v{trainer.policy_version} is ahead of target v{target}")
        return replayed


def train(run: RunBinding, trainer: Trainer, batch: StepBatch, *, replay: bool = False) -> dict[str, float]:
    """One step of ``batch`` on ``trainer`` (``replay``: again, as it committed); its metrics."""
    trainer.reclaim_optimizer()
    if batch.sft is not None:  # SFT mode: the rows at the step's data positions
        rows = run.rows()
        picked = prompts_for_step(len(rows), run.setup.seed, batch.sft.data_cursor, batch.sft.n_rows)
        return trainer.sft_step([rows[i] for i in picked], batch.hparams)
    samples, rewards = step_samples(run.store, batch)
    scores = [r.reward for r in rewards]
    if replay:
        step = trainer.policy_version + 1
        return trainer.replay_step(samples, scores, batch.group_size, batch.hparams, batch.temperature,
                                   lambda: run.committed_metrics(step))
    return trainer.train_step(samples, scores, batch.group_size, batch.hparams, batch.temperature)


__all__ = ["VersionBuilder", "train"]
