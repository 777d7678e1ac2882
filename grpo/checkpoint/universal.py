"""A resume on another number of processes: DeepSpeed's universal checkpoint. Rank 0 converts the checkpoint with
``ds_to_universal`` (a subprocess) into ``checkpoints/.universal-<name>/<name>/``, leaving the checkpoint itself
untouched, after checking the disk can hold it; the engine, built with ``"checkpoint": {"load_universal": true}``
(:func:`engine_config`), re-partitions the fp32 master weights and Adam moments for its ranks. The converted folder
is reused by a rerun on the same count and deleted by the next complete save.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from grpo.checkpoint.files import _FULL_TEXT, META, _disk_full, _no_space, read_meta, write_json_atomic
from grpo.checkpoint.damage import _sha256
from grpo.errors import OutsideFailure

log = logging.getLogger("grpo.checkpoint")

UNIVERSAL = ".universal-"  # + checkpoint name: its DeepSpeed universal conversion, for a resume on another world size
# Free space a universal conversion needs, in checkpoint sizes (check_conversion_space)
CONVERSION_FACTOR = 2
SOURCE = "source.json"  # in a universal folder: which checkpoint (path, sha256 of its meta.json) it was made from


def engine_config(ds_config: dict, resume_from: Path | None, world_size: int) -> dict:
    """The policy engine's DeepSpeed JSON for this start: DeepSpeed loads a universal checkpoint only when the engine
    was built with ``checkpoint.load_universal``, so it is set when `resume_from` was written by another world
    size (and only then: the same world size keeps DeepSpeed's exact per-rank load)."""
    if resume_from is None or read_meta(resume_from)["world_size"] == world_size:
        return ds_config
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def check_conversion_space(root: Path, path: Path, meta: dict, world: int) -> None:
    """Refuse a universal conversion that cannot fit, before it starts (one line, exit 1 as the full-disk check
    before a save): ds_to_universal first extracts every rank's fp32 weights and Adam moments into per-parameter
    fragments (``tmp/``), then merges them into ``zero/`` and deletes ``tmp/`` only at the end, so at its peak it
    holds the optimizer state, most of a checkpoint, twice. Measured on the tiny LoRA: 2.5 x the checkpoint (its
    thousands of small fragment files cost more than their data); a conversion that outgrows the estimate still
    ends with the full-disk line."""
    need = CONVERSION_FACTOR * sum(size for size, _ in meta["files"].values())
    folder = root
    while not folder.is_dir() and folder != folder.parent:  # a new output_dir resuming another run's checkpoint
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < need:
        raise OutsideFailure(
            f"checkpoint.resume: converting {path} (written by {meta['world_size']} processes) for this run's "
            f"{world} needs about {need / 2**20:.1f} MiB free under {root} ({CONVERSION_FACTOR} x the "
            f"checkpoint: DeepSpeed's ds_to_universal), {free / 2**20:.1f} MiB free; free space there or move "
            f"output_dir to a larger disk and rerun, or resume on {meta['world_size']} processes, which needs no "
            "conversion")


def converted(root: Path, path: Path, world: int, rank: int) -> Path:
    """Called by every rank: the folder holding `path`'s DeepSpeed universal conversion (``<name>/`` inside it),
    made by rank 0 unless a complete one of the same checkpoint is there. The other ranks wait on the file system,
    not in a collective: converting a 12B full fine-tune can outlast faults.comm_timeout_s (a dead rank 0 ends
    the job through the launcher)."""
    folder = root / f"{UNIVERSAL}{path.name}"
    source = {"checkpoint": str(path.resolve()), "meta_sha256": _sha256(path / META)}

    def ready() -> bool:
        try:
            return json.loads((folder / SOURCE).read_text()) == source
        except (OSError, ValueError):
            return False

    if rank == 0 and not ready():
        tmp = root / f".tmp{UNIVERSAL}{path.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)  # of another checkpoint of that step (another run, replaced)
        meta = read_meta(path)
        check_conversion_space(root, path, meta, world)
        tmp.mkdir(parents=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(path),
               "--output_folder", str(tmp / path.name), "--num_extract_workers",
               str(max(1, min(meta["world_size"], (os.cpu_count() or 1) // 2))), "--num_merge_workers", "1"]
        log.info("checkpoint %s was written by %d processes, this run has %d: converting it to a DeepSpeed "
                 "universal checkpoint in %s", path, meta["world_size"], world, folder)
        started = time.monotonic()
        with _disk_full(root, folder.name), open(tmp / "convert.log", "w") as out:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            if any(t in (tmp / "convert.log").read_text(errors="replace") for t in _FULL_TEXT):
                raise OutsideFailure(_no_space(root, folder.name, "while converting it for this world size"))
            raise RuntimeError(f"DeepSpeed's ds_to_universal failed on {path} (exit {done.returncode}); its "
                               f"output: {tmp / 'convert.log'}\n{(tmp / 'convert.log').read_text()[-3000:]}")
        write_json_atomic(tmp / SOURCE, source)
        tmp.rename(folder)
        log.info("converted in %.1f s", time.monotonic() - started)
    while not ready():
        time.sleep(0.5)
    return folder
