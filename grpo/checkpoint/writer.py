"""Writing and loading checkpoints: DeepSpeed's state plus the run's own (RNG, counters and the stateful parts: EMA,
lagging policy, objective), written atomically into ``.tmp-<name>`` and renamed into place, the newest `keep` kept.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from grpo import rng
from grpo.checkpoint.files import (FORMAT, LATEST, META, _disk_full, _fsync_dir, _no_space, checkpoint_name,
                                   list_checkpoints, rank_file, read_meta, write_json_atomic, write_text_atomic)
from grpo.checkpoint.universal import UNIVERSAL, converted
from grpo.checkpoint.damage import _collective, _sha256, _share
from grpo.config import RecipeConfig, to_dict
from grpo.distributed import agreed_outside_failure
from grpo.errors import OutsideFailure
from grpo.rng import RngState

log = logging.getLogger("grpo.checkpoint")


@dataclass
class RunState:
    """What a checkpoint restores besides DeepSpeed's state."""

    step: int  # completed GRPO steps; training continues at this step index
    consecutive_skips: int = 0
    total_skips: int = 0


@contextlib.contextmanager
def _save_phase(device, root: Path, name: str):
    """One phase of a save that runs no collective inside: a full disk on any rank is raised on every rank."""
    with agreed_outside_failure(device), _disk_full(root, name):
        yield


class Stateful(Protocol):
    """A part of the run a checkpoint holds besides DeepSpeed's state: the EMA, the lagging policy, the objective.
    A part with `replicated = True` is the same on every rank: rank 0's file alone holds it (Saved.rank0)."""

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
                write_json_atomic(tmp / META, {
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
                write_text_atomic(self.root / LATEST, name)
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
            load_dir = converted(self.root, path, self.world, self.rank)
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
