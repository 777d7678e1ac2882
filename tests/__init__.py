"""Tests in two tiers: unit/ (in-process, fast) and recipe/ (real runs through torchrun, launch/*.sh or the CLIs;
their one launch helper is tests/recipe/launch.py)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = Path(os.environ.get("GRPO_TINY_MODEL", ROOT / "assets" / "tiny-flux"))


def snapshot(path: Path) -> dict | None:
    """Everything under `path` (names, sizes, mtimes, contents of small files); None if it does not exist. Tests
    compare two snapshots to show a run left a folder untouched."""
    if not path.exists():
        return None
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
            for p in sorted(path.rglob("*"))}
