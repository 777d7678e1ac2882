"""Damage checks: a checkpoint's files against the sizes and sha256 its meta.json lists, split over the ranks
(collective), or its structure alone (meta.json readable, every file present with its size) for the start-up checks.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch.distributed as dist

from grpo.checkpoint.files import read_meta


def _sha256(path: Path, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _share(names: list[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` hashes or verifies: every world-th one, so the work is split evenly."""
    return sorted(names)[rank::world]


def verify_share(path: Path, meta: dict, rank: int = 0, world: int = 1, hashes: bool = True) -> str | None:
    """Check this rank's share of a checkpoint's files against meta.json; None if fine, else the reason.
    hashes=False: presence and sizes only (what :func:`structure` checks)."""
    for name in _share(list(meta["files"]), rank, world):
        size, digest = meta["files"][name]
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, expected {size} (truncated?)"
        if hashes and _sha256(f) != digest:
            return f"{name} does not match its sha256 (corrupted)"
    return None


def structure(path: str | Path) -> str | None:
    """The structural part of :func:`verify`, for the start-up checks before any rank starts: meta.json readable, every
    file it lists present with its size. Never hashes (minutes for FLUX.1-dev) and is never collective."""
    try:
        return verify_share(Path(path), read_meta(path), hashes=False)
    except ValueError as e:
        return str(e)


def _collective() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def verify(path: str | Path) -> str | None:
    """Verify a whole checkpoint: None if valid, else the first reason found.

    Collective when torch.distributed runs with several processes (every rank checks its share, then the verdicts
    are gathered); a single process (tools.export, tools.eval) checks every file itself.
    """
    path = Path(path)
    rank, world = (dist.get_rank(), dist.get_world_size()) if _collective() else (0, 1)
    try:
        meta = read_meta(path)
        reason = verify_share(path, meta, rank, world)
    except ValueError as e:
        reason = str(e)
    if world > 1:
        reasons: list[str | None] = [None] * world
        dist.all_gather_object(reasons, reason)
        reason = next((r for r in reasons if r is not None), None)
    return reason
