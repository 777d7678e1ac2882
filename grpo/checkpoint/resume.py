"""Where a run starts: the checkpoint to resume (a folder, a run folder's newest valid one, or `auto`), checked for
damage and compatibility before anything is written, and the newer damaged ones set aside once the run holds
output_dir's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from grpo.checkpoint.files import META, checkpoint_name, checkpoint_step, list_checkpoints, read_meta
from grpo.checkpoint.damage import _collective, verify
from grpo.compat import check_compatible
from grpo.config import RecipeConfig
from grpo.errors import ConfigError
from grpo.lock import is_startup_entry

log = logging.getLogger("grpo.checkpoint")


def _warn(msg: str, *args) -> None:
    if not _collective() or dist.get_rank() == 0:
        log.warning(msg, *args)


def _quarantine(path: Path) -> None:
    """Move an invalid checkpoint aside (kept for inspection) so it is neither resumed nor counted as kept."""
    if not _collective() or dist.get_rank() == 0:
        target = path.parent / f".invalid-{path.name}-{int(time.time())}"
        try:
            path.rename(target)
        except OSError as e:  # read-only storage: leave it, it is skipped again next time
            log.warning("could not move %s aside (%s)", path, e)
    if _collective():
        dist.barrier()


def newest_valid(root: Path, move_aside: bool = False,
                 check: Callable[[Path], str | None] = verify) -> Path | None:
    """The newest checkpoint under `root` that passes `check` (:func:`verify`; :func:`structure` checks quietly);
    newer invalid ones are reported (and, when resuming, moved aside to `.invalid-<name>-<time>` so that they are
    neither tried again nor counted among the kept ones)."""
    for path in list_checkpoints(root):
        reason = check(path)
        if reason is None:
            return path
        if check is verify:
            _warn("checkpoint %s is incomplete or corrupted (%s); using the previous one", path, reason)
        if move_aside:
            _quarantine(path)
    return None


# What to tell the user, per setting naming the path: (no valid checkpoint in a run folder, path missing, unusable).
_FIXES = {
    "checkpoint": ("train with checkpoint.every > 0", "give output_dir/checkpoints/step_... or a run folder",
                   "use an older one"),
    "checkpoint.resume": (f"give a checkpoint folder such as {{path}}/checkpoints/{checkpoint_name(10)}, or auto",
                          "give a checkpoint folder (output_dir/checkpoints/step_...), a run folder, auto, or null",
                          "pick an older one under its checkpoints/ folder, or use auto"),
}


def find_checkpoint(path: str | Path, setting: str = "checkpoint", required: bool = True,
                    move_aside: bool = False, check: Callable[[Path], str | None] = verify) -> Path | None:
    """A verified checkpoint folder from a checkpoint folder or a run folder (its newest valid checkpoint).

    Args:
        path: ``output_dir/checkpoints/step_...`` or a run folder (an output_dir holding ``checkpoints/``).
        setting: The config key or argument to name in errors (``checkpoint`` or ``checkpoint.resume``).
        required: False: None instead of an error when the path or a valid checkpoint in it is missing.
        move_aside: Move invalid newer checkpoints of a run folder aside (see :func:`newest_valid`).
        check: :func:`verify` (collective under torch.distributed), or :func:`structure` (no hashing).

    Raises:
        ConfigError: The path does not exist, a run folder holds no valid checkpoint, or the checkpoint fails
            verification.
    """
    path = Path(path)
    no_valid, missing, unusable = _FIXES[setting]
    if checkpoint_step(path) is None and (path / "checkpoints").is_dir():  # a run folder
        found = newest_valid(path / "checkpoints", move_aside=move_aside, check=check)
        if found is None and required:
            raise ConfigError(f"{setting}: {path} holds no valid checkpoint; {no_valid.format(path=path)}")
        return found
    if not path.is_dir():
        if not required:
            return None
        raise ConfigError(f"{setting}: {path} does not exist; {missing}")
    if checkpoint_step(path) is None and not (path / META).exists():
        raise ConfigError(f"{setting}: {path} is neither a checkpoint (no {META}) nor a run folder (no checkpoints/); "
                          f"{missing}")
    reason = check(path)
    if reason is not None:
        raise ConfigError(f"{setting}: {path} is not a usable checkpoint ({reason}); {unusable}")
    return path


def _non_empty(out: Path) -> bool:
    """output_dir holds something besides what a starting job puts there (grpo/lock.py), or is a file."""
    return out.exists() and (not out.is_dir() or any(not is_startup_entry(p.name) for p in out.iterdir()))


def resume_point(cfg: RecipeConfig, world_size: int, check: Callable[[Path], str | None] = verify,
                 move_aside: bool | None = None) -> Path | None:
    """Where this run starts: None for a fresh start, else a verified, compatible checkpoint folder.

    Runs before any model is loaded and never writes, except moving an invalid checkpoint aside under
    `checkpoint.resume: auto`. Collective under torch.distributed. check=:func:`structure`: the start-up checks'
    version (grpo/inputs.py), which neither hashes nor moves anything. move_aside=False: verify but move nothing (the
    recipe, which refuses before it writes anything and calls :func:`set_aside_newer` once it holds the lock).

    `auto` starts from step 0 only when output_dir has never held a checkpoint: when every one is damaged, the run
    stops instead of silently dropping its progress (to start over: checkpoint.resume=null and a new output_dir).

    Raises:
        ConfigError: output_dir holds files but checkpoint.resume is null; every checkpoint of an `auto` run is
            damaged; the resume path does not exist, is not a checkpoint, fails verification, or was written by
            another preset, or by a world size this one cannot continue (grpo/compat.py).
    """
    out, resume = Path(cfg.output_dir), cfg.checkpoint.resume
    if resume is None:
        if _non_empty(out):
            raise ConfigError(
                f"output_dir: {out} is not empty; set checkpoint.resume=auto to continue that run, or choose a new "
                "output_dir"
            )
        return None
    moving = check is verify if move_aside is None else move_aside
    if resume == "auto":
        root = out / "checkpoints"
        path = newest_valid(root, move_aside=moving, check=check)
        if path is None:
            damaged = [p.name for p in root.iterdir() if checkpoint_step(p) is not None
                       or p.name.startswith(".invalid-step_")] if root.is_dir() else []
            if damaged:
                raise ConfigError(
                    f"checkpoint.resume: auto finds no valid checkpoint under {root}, only damaged ones "
                    f"({len(damaged)}{', moved aside as .invalid-*' if moving else ''}); resuming would drop the run's "
                    "progress. To start over, set checkpoint.resume=null and choose a new output_dir"
                )
            if moving:
                _warn("checkpoint.resume=auto: no checkpoint under %s yet; starting from step 0", root)
            return None
    else:
        path = find_checkpoint(resume, "checkpoint.resume", check=check,
                               move_aside=moving and Path(resume).resolve() == out.resolve())
    check_compatible(path, read_meta(path), cfg, world_size)
    return path


def set_aside_newer(cfg: RecipeConfig, resume_from: Path | None) -> None:
    """Collective: after ``resume_point(..., move_aside=False)``, move aside the checkpoints of output_dir newer than
    `resume_from`, which it found invalid (see :func:`newest_valid`), when it resumes output_dir's own newest one."""
    out, resume = Path(cfg.output_dir), cfg.checkpoint.resume
    if resume_from is None or (resume != "auto" and Path(resume).resolve() != out.resolve()):
        return
    newer = [p for p in list_checkpoints(out / "checkpoints") if checkpoint_step(p) > checkpoint_step(resume_from)]
    if _collective():
        dist.barrier()  # every rank has listed them before rank 0 renames the first
    for path in newer:
        _quarantine(path)
