"""A checkpoint on disk: its folder and file names, meta.json, atomic writes, and what a full or refused disk
becomes (one line). The layout (grpo/checkpoint/__init__.py has the whole story)::

    output_dir/checkpoints/step_00000010/   zero_pp_rank_*_model_states.pt, [bf16_]zero_pp_rank_*_optim_states.pt
                                            (DeepSpeed's), grpo_rank{r:05d}.safetensors (ours), meta.json (last)
    output_dir/checkpoints/latest           name of the newest complete checkpoint
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from grpo.errors import OutsideFailure, refused_write, unwritable

FORMAT = 1
META = "meta.json"
LATEST = "latest"
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(path: str | Path) -> int | None:
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def rank_file(rank: int) -> str:
    return f"grpo_rank{rank:05d}.safetensors"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete-looking checkpoint folders under `root`, newest first (temporary folders are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=lambda p: checkpoint_step(p), reverse=True)


def read_meta(path: str | Path) -> dict:
    """meta.json of a checkpoint; raises ValueError when it is missing or unreadable."""
    f = Path(path) / META
    try:
        meta = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f.name} missing or unreadable ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise ValueError(f"{f.name} is not a grpo checkpoint description (format {FORMAT})")
    return meta


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


def write_text_atomic(path: Path, text: str) -> None:
    """`text` into `path` whole or not at all: a temp file beside it, fsynced, renamed over it (a kill -9 or a full
    disk leaves the previous file). The one atomic text writer of the checkpoints, manifest, reports and evals."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FULL_TEXT = ("No space left", "Disk quota exceeded")


def _is_disk_full(err: BaseException, root: Path) -> bool:
    """ENOSPC or EDQUOT, however the writer reports it: an OSError from safetensors and our own files; torch.save's
    C++ zip writer says only "file write failed" (a RuntimeError), so then the disk itself is asked."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    if any(t in text for t in _FULL_TEXT):
        return True
    if "write failed" not in text:
        return False
    try:
        return shutil.disk_usage(root).free < 16 << 20  # what a failed write leaves: (almost) nothing
    except OSError:
        return False


@contextlib.contextmanager
def _disk_full(root: Path, name: str):
    """A full disk, or a file system that refuses writes (remounted read-only, permissions changed), while a
    checkpoint is written becomes one OutsideFailure line (exit 1: neither undoes itself, so not "retry later").
    Nothing else needs undoing: the checkpoint was going into .tmp-<name>, which is never resumed and is removed by
    the next save of that step, and pruning runs only after a complete save."""
    try:
        yield
    except Exception as err:
        if _is_disk_full(err, root):
            raise OutsideFailure(_no_space(root, name, f"while writing it ({type(err).__name__})")) from err
        refused = refused_write(err, root)
        if refused is None:
            raise
        raise OutsideFailure(unwritable(refused, root, f"checkpoint {name}", _kept(root))) from err


def _kept(root: Path) -> str:
    try:
        previous = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    except OSError:
        previous = None
    return f"the previous checkpoint {root / previous} is intact" if previous else "no checkpoint was written yet"


def _no_space(root: Path, name: str, how: str) -> str:
    return (f"checkpoint: no space left on the device of {root} for {name} ({how}); {_kept(root)}. Free space there "
            "(or lower checkpoint.keep, or move output_dir to a larger disk), then rerun with checkpoint.resume=auto")
