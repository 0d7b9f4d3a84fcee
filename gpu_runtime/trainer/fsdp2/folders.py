"""Folders for a fsdp2 rank on another machine than its driver: carried as bytes through Ray.

A cell's calls name folders on the driver's machine: the model folder the ranks load, the
checkpoint folder every rank writes its shards into and reads them back from, the HF folder
rank 0 exports. A rank on the driver's Ray node uses the path as it is. A rank on another
node (``trainer.placement: spread`` over a cluster of several machines) does not see the
driver's files, so its call runs on a *stage*, a temporary folder of its own: a folder the
call reads is sent there first (``read_tree`` on the driver, ``write_tree`` on the rank),
and what the call wrote there comes back and is written into the driver's folder.

No shared filesystem is assumed (the multi-host test bed gives every host a private view,
as separate machines have). The price: a folder a remote rank reads travels whole, once
per call, through Ray's object store (a reshard reads slices of every shard, so no rank's
share is smaller than "all of it" in general).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

Tree = dict[str, bytes]  # relative POSIX path -> contents


def read_tree(folder: str | Path) -> Tree:
    """Every regular file under ``folder`` by its path relative to it (``{}`` where it is missing)."""
    root = Path(folder)
    if not root.is_dir():
        return {}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_tree(folder: str | Path, files: Tree) -> None:
    """Write ``files`` (``read_tree``'s form) under ``folder``, making directories as needed and
    replacing files of the same name. A path that leaves ``folder`` is refused."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        parts = PurePosixPath(rel).parts
        if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
            raise ValueError(f"a staged file's path must stay inside its folder, got {rel!r}")
        path = root.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.part")
        tmp.write_bytes(data)
        tmp.replace(path)


__all__ = ["Tree", "read_tree", "write_tree"]
