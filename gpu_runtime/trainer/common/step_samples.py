"""A step's samples and their rewards, as the trainer reads them from the store.

A ``StepBatch`` names them one of two ways: the chunks and the rewards of one rollout
(``chunk_keys``, ``rewards_key``), or, with dynamic sampling, a ``selection``: the rounds'
chunks and rewards and the (round, group) pairs trained, in order. A selection's chunks
are each read once and the kept groups taken in memory, in the workflow's order.
"""

from __future__ import annotations

from gpu_runtime.data.dynamic_sampling import assemble_groups
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import ObjectStore
from spec.trainer_rpc import StepBatch


def chunk_samples(store: ObjectStore, chunk_keys: list[str]) -> list[art.Sample]:
    """The samples of ``chunk_keys``, in order (one read per chunk)."""
    out: list[art.Sample] = []
    for key in chunk_keys:
        out.extend(art.get_model(store, key, art.RolloutChunk).samples)
    return out


def step_samples(store: ObjectStore, batch: StepBatch) -> tuple[list[art.Sample], list[art.SampleReward]]:
    """The samples ``batch`` trains on and their rewards, in training order. A ``ValueError``
    when the stored rewards are not the samples' (or a selected group does not exist)."""
    if batch.selection is None:
        samples = chunk_samples(store, batch.chunk_keys)
        rewards = art.get_model(store, batch.rewards_key, art.StepRewards).rewards
        if [r.sample_id for r in rewards] != [s.sample_id for s in samples]:
            raise ValueError(f"step {batch.step}: rewards do not match the rollout samples")
        return samples, rewards
    rounds = [
        (chunk_samples(store, r.chunk_keys), art.get_model(store, r.rewards_key, art.StepRewards).rewards)
        for r in batch.selection.rounds
    ]
    try:
        return assemble_groups(rounds, batch.selection.groups, batch.group_size)
    except ValueError as err:
        raise ValueError(f"step {batch.step}: {err}") from err
