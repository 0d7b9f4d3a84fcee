"""Version exports written over a pruned version's file (``gpu_runtime.models.safetensors_file``):
the same bytes ``safetensors.save_file`` writes, over the old file's pages; and a file is only
reused when no other folder (an engine's, a checkpoint upload's) links to it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.models.model_folder import (
    SPARES_DIR,
    WEIGHTS_FILE,
    prune_version_folders,
    read_meta,
    spares_for,
    weights_checksum,
    write_model_folder,
)
from gpu_runtime.models.safetensors_file import Spares, write_safetensors
from gpu_runtime.models.tokenizer import Tokenizer
from tests.engine_fixtures import _tokenizer


def _tensors(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(8 * scale, 4, generator=g),
        "model.embed_tokens.weight": torch.randn(16, 4, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(4, generator=g).to(torch.float16),
        "b.scalar": torch.tensor(3.5, dtype=torch.float64),
        "c.steps": torch.arange(5, dtype=torch.int64),
        "d.mask": torch.tensor([True, False, True]),
        "e.codes": torch.arange(7, dtype=torch.uint8),
        "f.i32": torch.arange(3, dtype=torch.int32),
        "g.empty": torch.zeros(0, 4),
    }


def test_the_bytes_are_save_files(tmp_path: Path) -> None:
    t = _tensors(0)
    save_file(t, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    write_safetensors(tmp_path / "ours.safetensors", t, metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()


@pytest.mark.parametrize("old_scale", [1, 4, 0], ids=["same size", "old file longer", "old file shorter"])
def test_written_over_an_existing_file(tmp_path: Path, old_scale: int) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"\xff" * (4096 * old_scale + 3))
    inode = path.stat().st_ino
    t = _tensors(1)
    write_safetensors(path, t, metadata={"format": "pt"})
    save_file(t, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    assert path.stat().st_ino == inode  # the same file, not a new one
    assert path.read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    back = load_file(str(path))
    assert all(torch.equal(back[k], v) for k, v in t.items())


def test_a_non_contiguous_tensor_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="w: only contiguous"):
        write_safetensors(tmp_path / "x.safetensors", {"w": torch.randn(4, 4).t()})


def test_a_spare_linked_elsewhere_is_not_kept(tmp_path: Path) -> None:
    spares = Spares(tmp_path / "spares", keep=1)
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "b").write_bytes(b"b")
    os.link(tmp_path / "b", tmp_path / "b-engine")  # an engine's folder still holds it
    spares.salvage(tmp_path / "b")
    assert not (tmp_path / "b").exists() and list(spares.folder.iterdir()) == []
    assert (tmp_path / "b-engine").read_bytes() == b"b"
    spares.salvage(tmp_path / "a")
    (tmp_path / "c").write_bytes(b"c")
    spares.salvage(tmp_path / "c")  # keep=1: one spare is enough
    assert [p.read_bytes() for p in spares.folder.iterdir()] == [b"a"]
    spares.salvage(tmp_path / "gone")  # pruned meanwhile: nothing to do
    assert spares.take(tmp_path / "taken") and (tmp_path / "taken").read_bytes() == b"a"
    assert not spares.take(tmp_path / "again")


def _export(folder: Path, version: int, t: dict[str, torch.Tensor], tok: Tokenizer) -> str:
    from transformers import GenerationConfig, Qwen2Config

    return write_model_folder(Qwen2Config(), GenerationConfig(), tok, folder, weight_version=version, weights=t)


def test_exports_write_over_pruned_versions_never_over_a_linked_one(tmp_path: Path) -> None:
    """The trainer's exports (``trainer/v<N>``) and an engines' folder (``engines/v<N>``, hard links),
    pruned as ``TrainerService`` and ``NodeRuntime.local_weights`` prune them."""
    tok = _tokenizer()
    trainer, engines = tmp_path / "trainer", tmp_path / "engines"
    spares = spares_for(trainer / "v000001")
    assert spares.folder == trainer / SPARES_DIR
    inodes: dict[int, int] = {}
    for v in range(1, 6):
        t = _tensors(v)
        checksum = _export(trainer / f"v{v:06d}", v, t, tok)
        assert checksum == weights_checksum(t) == read_meta(trainer / f"v{v:06d}")["checksum"]
        inodes[v] = (trainer / f"v{v:06d}" / WEIGHTS_FILE).stat().st_ino
        prune_version_folders(trainer, v)
        # the engines load v: links, then their folder is pruned into the trainer's spares
        (engines / f"v{v:06d}").mkdir(parents=True)
        os.link(trainer / f"v{v:06d}" / WEIGHTS_FILE, engines / f"v{v:06d}" / WEIGHTS_FILE)
        prune_version_folders(engines, v, spares=spares)
        if v == 2:  # a checkpoint uploads v2 for the rest of the run: its file is never written over
            (tmp_path / "upload").mkdir()
            os.link(trainer / "v000002" / WEIGHTS_FILE, tmp_path / "upload" / WEIGHTS_FILE)
        for kept in (v - 1, v):  # every folder still there holds the bytes it was written with
            for root in (trainer, engines):
                if kept >= 1:
                    got = load_file(str(root / f"v{kept:06d}" / WEIGHTS_FILE))
                    assert all(torch.equal(got[k], x) for k, x in _tensors(kept).items()), (root.name, kept, v)
    # v1's file was linked by the engines' v1 until they pruned it at v3: v4 is the first export over it
    assert inodes[4] == inodes[1]
    assert inodes[3] not in (inodes[1], inodes[2]) and inodes[5] not in (inodes[1], inodes[2], inodes[3])
    got = load_file(str(tmp_path / "upload" / WEIGHTS_FILE))
    assert all(torch.equal(got[k], x) for k, x in _tensors(2).items())
