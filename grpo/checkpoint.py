"""Resumable checkpoints: DeepSpeed ZeRO-3 state plus the run's own state, written atomically, verified on resume.

Layout under ``output_dir/checkpoints/``::

    step_00000010/                              the state after 10 completed GRPO steps
        zero_pp_rank_{r}_mp_rank_00_model_states.pt       DeepSpeed, one per rank (module buffers, counters)
        [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt  DeepSpeed, one per rank (fp32 master shard, Adam
                                                          moments, LR scheduler); LoRA: trainable weights only
        zero_to_fp32.py                                   DeepSpeed's recovery script
        grpo_rank{r:05d}.safetensors                      ours: RNG states of rank r, its EMA and lagging-policy
                                                          shards; rank 0's also the objective's state (grpo's
                                                          replay buffer "replay/*", the same on every rank)
        meta.json                                         ours, written last: step, world size, resolved config,
                                                          size + sha256 of every file above
    latest                                      name of the newest complete checkpoint (DeepSpeed's convention,
                                                so zero_to_fp32.py finds it); written after the rename
    .tmp-step_00000012/                         a checkpoint being written; never read, removed by the next save
    .universal-step_00000010/step_00000010/     DeepSpeed's universal conversion of a checkpoint resumed on another
                                                world size (possibly another run's); removed by the next save

Atomicity: every rank writes into ``.tmp-<name>``; after a barrier the ranks hash their share of the files (and fsync
them), rank 0 writes ``meta.json`` and renames the folder into place, then updates ``latest``. A kill at any moment
leaves either the previous checkpoints untouched or the new one complete. A checkpoint damaged later (truncated,
overwritten, a rank file lost) fails verification; ``resume: auto`` then warns and takes the previous one.

Resume is exact because everything random in a step is a pure function of (seed, step, sample index)
(grpo/data.py): restoring the step counter, the optimizer, the LR scheduler, the weights and each rank's global RNG
states continues the run as if it had never stopped.

World size: a checkpoint resumes on any number of processes that its global batch splits over (grpo/compat.py
refuses the others, naming the valid counts). On the writer's world size the load is DeepSpeed's own, bit for bit.
On another one, rank 0 first converts the checkpoint with DeepSpeed's ``ds_to_universal`` (a subprocess) into
``checkpoints/.universal-<name>/<name>/``, leaving the checkpoint itself untouched, and the engine, built with
``"checkpoint": {"load_universal": true}`` (:func:`engine_config`), re-partitions the fp32 master weights and Adam
moments for its ranks; the EMA and lagging-policy shards are re-cut from every writer's rank file by flat index
(:meth:`grpo.ema.ShardedEMA.load_resharded`). RNG: rank r restores the writer's rank r where it existed, a new rank
keeps its fresh ``seed + rank`` state (only LoRA dropout draws from them: samples are pure functions of the global
index). The converted folder is reused by a rerun on the same count and deleted by the next complete save.

Security: DeepSpeed's own ``load_checkpoint`` and ``zero_to_fp32`` unpickle their ``.pt`` files with
``torch.load(weights_only=False)``; everything this module writes and reads itself is JSON or safetensors. Only load
checkpoints you wrote.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from grpo import rng
from grpo.rng import RngState
from grpo.compat import check_compatible
from grpo.config import RecipeConfig, to_dict
from grpo.distributed import agreed_outside_failure
from grpo.errors import ConfigError, OutsideFailure, refused_write, unwritable
from grpo.lock import is_startup_entry

log = logging.getLogger(__name__)

FORMAT = 1
META = "meta.json"
LATEST = "latest"
UNIVERSAL = ".universal-"  # + checkpoint name: its DeepSpeed universal conversion, for a resume on another world size
# Free space a universal conversion needs, in checkpoint sizes (Checkpointer._check_conversion_space)
CONVERSION_FACTOR = 2
SOURCE = "source.json"  # in a universal folder: which checkpoint (path, sha256 of its meta.json) it was made from
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


# ------------------------------------------------------------------------------------------------ verification


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


# ------------------------------------------------------------------------------------------------ resolution


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


# ---------------------------------------------------------------------------------------------- save / load


@dataclass
class RunState:
    """What a checkpoint restores besides DeepSpeed's state."""

    step: int  # completed GRPO steps; training continues at this step index
    consecutive_skips: int = 0
    total_skips: int = 0


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _write_text_atomic(path: Path, text: str) -> None:
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


@contextlib.contextmanager
def _save_phase(device, root: Path, name: str):
    """One phase of a save that runs no collective inside: a full disk on any rank is raised on every rank."""
    with agreed_outside_failure(device), _disk_full(root, name):
        yield


class Stateful(Protocol):
    """A part of the run a checkpoint holds besides DeepSpeed's state: the EMA, the lagging policy, the objective."""

    def state_dict(self) -> tuple[dict[str, Any], dict[str, str]]:
        """This rank's share: safetensors tensors, named under the part's own prefix, and string metadata."""

    def load_state_dict(self, saved: Saved) -> None:
        """Restore from the checkpoint's rank files."""


@dataclass
class Saved:
    """A checkpoint's rank files as the stateful parts read them."""

    tensors: dict  # this rank's file; {} for a rank the writer did not have
    files: list[Path]  # every writer rank's file, in rank order
    resharded: bool  # written by another number of processes: a sharded part re-cuts its shards from `files`
    rank: int

    def rank0(self) -> dict:
        """Rank 0's file: where a part that is the same on every rank (`replicated`) is saved."""
        return self.tensors if self.rank == 0 else load_file(str(self.files[0]))


class Checkpointer:
    """Saves, prunes and loads the checkpoints of one run (collective methods: call on every rank)."""

    def __init__(self, cfg: RecipeConfig, rank: int, world_size: int):
        self.cfg = cfg
        self.rank, self.world = rank, world_size
        self.root = Path(cfg.output_dir) / "checkpoints"

    def due(self, steps_done: int) -> bool:
        every = self.cfg.checkpoint.every
        return every > 0 and (steps_done % every == 0 or steps_done == self.cfg.max_steps)

    def has(self, steps_done: int) -> bool:
        """Collective: a complete checkpoint of `steps_done` steps is there (rank 0's view, which every rank takes)."""
        found = [(self.root / checkpoint_name(steps_done) / META).is_file()]
        if _collective():
            dist.broadcast_object_list(found, src=0)
        return found[0]

    def save(self, engine, state: RunState, parts: dict[str, Stateful | None] | None = None,
             rng_state: RngState | None = None) -> Path:
        """Write the checkpoint of `state.step` completed steps atomically; returns its folder. `parts`: the run's
        stateful parts besides DeepSpeed's by name (None: not in this run), e.g. "ema", "lagging", "objective": each
        rank's file holds its share, or rank 0's alone a part that is the same on every rank (`replicated`), and
        meta.json says which parts it holds. `rng_state`: this rank's RNG state to store (rng.rng_state; default:
        the current one).

        A full disk raises an OutsideFailure on every rank (one line, exit 1; see :func:`_disk_full`), the previous
        checkpoints untouched. It is caught before anything is written when the last checkpoint's size is not free
        any more; while DeepSpeed writes its files, only the rank that met it knows (its peers then fail in
        DeepSpeed's collectives); in our own phases the ranks agree (grpo.distributed.agreed_outside_failure, which
        also stands for the barriers between them)."""
        name = checkpoint_name(state.step)
        tmp, final = self.root / f".tmp-{name}", self.root / name
        parts = parts or {}

        def phase():
            return _save_phase(engine.device, self.root, name)

        with phase():
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # left by a run killed (or stopped by a full disk) while saving
                    shutil.rmtree(tmp)
            self._check_space(name)
        with _disk_full(self.root, name):
            engine.save_checkpoint(str(self.root), tag=tmp.name, save_latest=False,
                                   exclude_frozen_parameters=self.cfg.lora is not None)
        with phase():
            tensors, meta = rng_state or rng.snapshot()
            tensors, meta = dict(tensors), dict(meta)  # a given state is kept as it was
            for part in parts.values():
                if part is not None and (self.rank == 0 or not getattr(part, "replicated", False)):
                    part_tensors, part_meta = part.state_dict()
                    tensors.update(part_tensors)
                    meta.update(part_meta)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / rank_file(self.rank)),
                      metadata=meta)
        names = sorted(p.name for p in tmp.iterdir() if p.is_file())
        mine = {n: [(tmp / n).stat().st_size, _sha256(tmp / n, fsync=True)] for n in _share(names, self.rank,
                                                                                              self.world)}
        shares: list[dict] = [{}] * self.world
        dist.all_gather_object(shares, mine)
        with phase():
            if self.rank == 0:
                files = {k: v for share in shares for k, v in share.items()}
                _write_json_atomic(tmp / META, {
                    "format": FORMAT, "step": state.step, "world_size": self.world,
                    "consecutive_skips": state.consecutive_skips, "total_skips": state.total_skips,
                    "lora": self.cfg.lora is not None, **{k: part is not None for k, part in parts.items()},
                    "transformer_config": {k: v for k, v in dict(engine.module.config).items()
                                           if not k.startswith("_")},
                    "config": to_dict(self.cfg), "files": files, "time": time.time(),
                })
                _fsync_dir(tmp)
                if final.exists():  # e.g. a corrupted checkpoint of the same step left behind
                    shutil.rmtree(final)
                tmp.rename(final)
                _write_text_atomic(self.root / LATEST, name)
                _fsync_dir(self.root)
                self._prune()  # only now: the new checkpoint is complete and `latest` names it
        return final

    def _check_space(self, name: str) -> None:
        """Refuse to start a checkpoint that cannot fit: the newest complete one's size must be free (every one of a
        run has the same files and sizes). Nothing to compare with before the first one."""
        for previous in list_checkpoints(self.root):
            try:
                need = sum(size for size, _ in read_meta(previous)["files"].values())
            except ValueError:
                continue
            free = shutil.disk_usage(self.root).free
            if free < need:
                raise OutsideFailure(_no_space(self.root, name, f"needs about {need / 2**20:.1f} MiB, the size of "
                                                                f"{previous.name}; {free / 2**20:.1f} MiB free"))
            return

    def _check_conversion_space(self, path: Path, meta: dict) -> None:
        """Refuse a universal conversion that cannot fit, before it starts (one line, exit 1 as the full-disk check
        before a save): ds_to_universal first extracts every rank's fp32 weights and Adam moments into per-parameter
        fragments (``tmp/``), then merges them into ``zero/`` and deletes ``tmp/`` only at the end, so at its peak it
        holds the optimizer state, most of a checkpoint, twice. Measured on the tiny LoRA: 2.5 x the checkpoint (its
        thousands of small fragment files cost more than their data); a conversion that outgrows the estimate still
        ends with the full-disk line."""
        need = CONVERSION_FACTOR * sum(size for size, _ in meta["files"].values())
        folder = self.root
        while not folder.is_dir() and folder != folder.parent:  # a new output_dir resuming another run's checkpoint
            folder = folder.parent
        free = shutil.disk_usage(folder).free
        if free < need:
            raise OutsideFailure(
                f"checkpoint.resume: converting {path} (written by {meta['world_size']} processes) for this run's "
                f"{self.world} needs about {need / 2**20:.1f} MiB free under {self.root} ({CONVERSION_FACTOR} x the "
                f"checkpoint: DeepSpeed's ds_to_universal), {free / 2**20:.1f} MiB free; free space there or move "
                f"output_dir to a larger disk and rerun, or resume on {meta['world_size']} processes, which needs no "
                "conversion")

    def _prune(self) -> None:
        """Delete checkpoints beyond the newest `keep`, and folders of saves that a kill interrupted."""
        for old in list_checkpoints(self.root)[self.cfg.checkpoint.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        # A run on a new world size needs its conversion only until it has a checkpoint of its own, i.e. now.
        for converted in [*self.root.glob(UNIVERSAL + "*"), *self.root.glob(".tmp" + UNIVERSAL + "*")]:
            shutil.rmtree(converted, ignore_errors=True)

    def load(self, path: Path, engine, parts: dict[str, Stateful | None] | None = None) -> RunState:
        """Restore DeepSpeed's state, this rank's RNG and the stateful `parts` (as given to :meth:`save`; on any
        world size); returns the run counters. A part the checkpoint was saved without (e.g. no EMA then) keeps its
        fresh state, with a warning.

        Written by another number of processes: DeepSpeed's universal checkpoint re-partitions the optimizer (the
        engine must come from :func:`engine_config`), the averages are re-cut by flat index (see the module doc)."""
        meta = read_meta(path)
        written = meta["world_size"]
        load_dir = path.parent
        if written != self.world:
            if not engine.load_universal_checkpoint():
                raise RuntimeError("resuming on another world size needs the engine built from "
                                   "grpo.checkpoint.engine_config (checkpoint.load_universal)")
            load_dir = self._universal(path)
        load_path, _ = engine.load_checkpoint(str(load_dir), tag=path.name, load_module_strict=False,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {path}")
        files = [path / rank_file(r) for r in range(written)]
        # A rank the writer did not have keeps its fresh seed + rank state (nothing of a step's samples depends on it)
        tensors = load_file(str(files[self.rank])) if self.rank < written else {}
        if tensors:
            from safetensors import safe_open

            with safe_open(str(files[self.rank]), framework="pt") as f:
                file_meta = f.metadata()
            _, set_rng = rng.device_rng()
            rng.set_rng_state(tensors, file_meta, set_rng)
        if written != self.world and self.rank == 0:
            log.info("resharded %s from %d to %d processes (DeepSpeed universal checkpoint %s)", path, written,
                     self.world, load_dir / path.name)
        saved = Saved(tensors, files, resharded=written != self.world, rank=self.rank)
        for name, part in (parts or {}).items():
            if part is None:
                continue
            # meta.json names every part of its run (False: not in it); a part it does not name came later (e.g.
            # "objective": its tensors, if any, are read as they were). lagging: part of the training math
            # (algorithm nft/awm), so the config check made it present
            if meta.get(name, True) is False:
                log.warning("checkpoint %s has no %s state; it starts afresh from the current weights", path, name)
                continue
            part.load_state_dict(saved)
        return RunState(step=meta["step"], consecutive_skips=meta.get("consecutive_skips", 0),
                        total_skips=meta.get("total_skips", 0))

    def _universal(self, path: Path) -> Path:
        """Called by every rank: the folder holding `path`'s DeepSpeed universal conversion (``<name>/`` inside it),
        made by rank 0 unless a complete one of the same checkpoint is there. The other ranks wait on the file system,
        not in a collective: converting a 12B full fine-tune can outlast faults.comm_timeout_s (a dead rank 0 ends
        the job through the launcher)."""
        folder = self.root / f"{UNIVERSAL}{path.name}"
        source = {"checkpoint": str(path.resolve()), "meta_sha256": _sha256(path / META)}

        def ready() -> bool:
            try:
                return json.loads((folder / SOURCE).read_text()) == source
            except (OSError, ValueError):
                return False

        if self.rank == 0 and not ready():
            tmp = self.root / f".tmp{UNIVERSAL}{path.name}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)  # of another checkpoint of that step (another run, replaced)
            meta = read_meta(path)
            self._check_conversion_space(path, meta)
            tmp.mkdir(parents=True)
            cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(path),
                   "--output_folder", str(tmp / path.name), "--num_extract_workers",
                   str(max(1, min(meta["world_size"], (os.cpu_count() or 1) // 2))), "--num_merge_workers", "1"]
            log.info("checkpoint %s was written by %d processes, this run has %d: converting it to a DeepSpeed "
                     "universal checkpoint in %s", path, meta["world_size"], self.world, folder)
            started = time.monotonic()
            with _disk_full(self.root, folder.name), open(tmp / "convert.log", "w") as out:
                done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
            if done.returncode != 0:
                if any(t in (tmp / "convert.log").read_text(errors="replace") for t in _FULL_TEXT):
                    raise OutsideFailure(_no_space(self.root, folder.name, "while converting it for this world size"))
                raise RuntimeError(f"DeepSpeed's ds_to_universal failed on {path} (exit {done.returncode}); its "
                                   f"output: {tmp / 'convert.log'}\n{(tmp / 'convert.log').read_text()[-3000:]}")
            _write_json_atomic(tmp / SOURCE, source)
            tmp.rename(folder)
            log.info("converted in %.1f s", time.monotonic() - started)
        while not ready():
            time.sleep(0.5)
        return folder


def engine_config(ds_config: dict, resume_from: Path | None, world_size: int) -> dict:
    """The policy engine's DeepSpeed JSON for this start: DeepSpeed loads a universal checkpoint only when the engine
    was built with ``checkpoint.load_universal``, so it is set when `resume_from` was written by another world
    size (and only then: the same world size keeps DeepSpeed's exact per-rank load)."""
    if resume_from is None or read_meta(resume_from)["world_size"] == world_size:
        return ds_config
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
