"""The images of tools.eval and tools.bench, sampled and scored in shards over N processes, each shard saved as it
finishes, so that a rerun does only what is left.

A shard is one rollout micro-batch of consecutive image ids (grpo/eval.py: image j shows prompt j % n_prompts from
the noise of id j alone). Shards are cut the same way whatever the number of processes, and rank r takes shards r,
r + N, r + 2N, ...: the same micro-batches go through the same model, so 1 and N processes give the same images and
scores, and a rerun on another N reuses what the first one finished. Each process holds the whole (replicated)
transformer: inference needs no optimizer state nor gradients, and a 12B FLUX transformer in bf16 (~24 GB) fits one
64 GB device, so the shards need no ZeRO-3.

A shard file (``<results>/shards/<key>/<shard>.safetensors``, written atomically) holds its images' raw reward
components, the reward names and weights, and the images the results keep (the grid's). `key` hashes everything
the shard's numbers depend on (:func:`shard_key`): the resolved settings, the prompt file's bytes, the base model's
files, the shard size and, for a checkpoint, the sha256 of its files (meta.json) and the weights picked (EMA or
not). A rerun with another protocol, preset, reward or checkpoint gets another key and never reads stale shards.

    rank, world, device = join()                      # torchrun's job, or this process alone
    store = ShardStore(out / "shards", shard_key(...))
    relaunch("tools.bench", argv, nproc=2)            # the tool again, under tools.torchrun
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from grpo import device as dev
from grpo.config import RecipeConfig, to_dict
from grpo.errors import ConfigError

log = logging.getLogger(__name__)

FORMAT = 1  # of the shard files; part of the key, so a change of format never reads old files


def join() -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process: a rank of the torchrun job that started it (WORLD_SIZE > 1: the
    process group is initialised), else the only process, on the first device, without a process group."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        info = dev.init_distributed()
        return info.rank, info.world_size, info.device
    return 0, 1, dev.device_for_local_rank(0)


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def relaunch(module: str, argv: list[str], nproc: int) -> int:
    """Runs ``python -m module argv`` as `nproc` processes under tools.torchrun (as launch/run.sh runs the recipe)
    and returns the job's exit code (2: bad input, whose line rank 0 printed). On CPU the cores are split between
    the processes, as launch/run.sh does."""
    from tools.launch import launch_env, torchrun_cmd

    kind, count = dev.local_devices()
    if kind != "cpu" and nproc > count:
        raise ConfigError(f"nproc: {nproc}, but this machine has {count} {kind} devices; use nproc={count} or fewer")
    threads = None if kind != "cpu" or "OMP_NUM_THREADS" in os.environ else max(1, (os.cpu_count() or 1) // nproc)
    # accelerator None: DeepSpeed detects the device as for the recipe (unset stays unset). launch_env also sets
    # HF_HUB_OFFLINE: the check here resolved the model (a download, if any, happened once, in this process).
    env = launch_env(accelerator=None, job=False, threads=threads)
    cmd = torchrun_cmd(nproc, ["-m", module, *argv])
    log.info("%s x %d processes: %s", kind, nproc, " ".join(cmd))
    return subprocess.run(cmd, env=env).returncode


def nproc_of(value: str | None) -> int:
    """The tools' nproc=N (default 1)."""
    try:
        n = int(value) if value else 1
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"nproc: {value!r}; the number of processes to sample on, 1 or more (e.g. the devices here)")
    return n


def _sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _stat(f: Path) -> list:
    return [f.stat().st_size, f.stat().st_mtime_ns]


def _files_signature(path: str) -> list | str:
    """The base model's files by name, size and modification time (hashing a 24 GB model at every bench would cost
    minutes; a rebuilt or replaced model changes these); a hub name that is no folder stands for itself."""
    folder = Path(path)
    if not folder.is_dir():
        return path
    return sorted([str(f.relative_to(folder)), *_stat(f)] for f in folder.rglob("*") if f.is_file())


def shard_key(cfg: RecipeConfig, model_path: str, shard_size: int, checkpoint_meta: dict | None,
              sources: list[str] = ()) -> dict:
    """What the shards' numbers depend on, as a dict (its hash names the shards' folder: :func:`key_name`).

    Args:
        cfg: the resolved settings (protocol applied), whole: a change of any setting gets new shards.
        model_path: the local folder of the base model (or its hub name).
        shard_size: images per shard (the rollout micro-batch).
        checkpoint_meta: the checkpoint's meta.json with the weights picked (grpo.export.weights_meta); None: the
            base model.
        sources: the image files the prompts' rows name (an editing set's source images), by size and time as
            the model's files.
    """
    key = {"format": FORMAT, "settings": to_dict(cfg), "prompts_sha256": _sha256_file(cfg.data.eval_prompts),
           "model": _files_signature(model_path), "shard_size": shard_size,
           "sources": [[f, *_stat(Path(f))] for f in sources]}
    if checkpoint_meta is not None:
        # meta.json lists the sha256 of every file of the checkpoint: its content, not its path or name
        key["checkpoint"] = {"files": checkpoint_meta["files"], "weights": checkpoint_meta["weights"]}
    return key


def key_name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


class ShardStore:
    """The finished shards of one model (the base or a checkpoint) under one key: ``folder/<key>/NNNNN.safetensors``,
    and ``key.json``, what the key hashes (to read why a rerun did not reuse a folder)."""

    def __init__(self, root: Path, key: dict, role: str):
        self.dir = Path(root) / f"{role}-{key_name(key)}"
        self.key = key

    def path(self, shard: int) -> Path:
        return self.dir / f"{shard:05d}.safetensors"

    def done(self, shard: int) -> bool:
        return self.path(shard).is_file()

    def save(self, shard: int, ids: list[int], components: torch.Tensor, names: list[str], weights: list[float],
             images: torch.Tensor, image_ids: list[int]) -> None:
        """Atomically (a reader sees the whole file or none): the raw reward components [len(ids), R] of images
        `ids` and the kept `images` [len(image_ids), 3, H, W]."""
        self.dir.mkdir(parents=True, exist_ok=True)
        key_file = self.dir / "key.json"
        if not key_file.is_file():
            tmp = key_file.with_name(f"key.json.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.key, indent=1, sort_keys=True, default=str))
            tmp.replace(key_file)
        tensors = {"ids": torch.tensor(ids, dtype=torch.long), "components": components.float().cpu().contiguous(),
                   "image_ids": torch.tensor(image_ids, dtype=torch.long),
                   "images": images.float().cpu().contiguous()}
        tmp = self.path(shard).with_name(f"{self.path(shard).name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata={"names": json.dumps(names), "weights": json.dumps(weights)})
        tmp.replace(self.path(shard))

    def load(self, n_shards: int) -> dict:
        """Every shard, joined in id order: {"ids", "components" [n, R], "names", "weights", "images" {id: [3,H,W]}}.

        Raises:
            ConfigError: a shard is missing (the results folder is not one that every process sees).
        """
        missing = [s for s in range(n_shards) if not self.done(s)]
        if missing:
            raise ConfigError(f"{self.dir}: shards {missing[:4]} missing after every process finished; the results "
                              f"folder must be shared by all processes (out=DIR on a shared filesystem)")
        ids, comps, images, names, weights = [], [], {}, [], []
        for s in range(n_shards):
            with safe_open(str(self.path(s)), framework="pt") as f:
                meta = f.metadata()
                names, weights = json.loads(meta["names"]), json.loads(meta["weights"])
                ids += f.get_tensor("ids").tolist()
                comps.append(f.get_tensor("components"))
                images.update(zip(f.get_tensor("image_ids").tolist(), f.get_tensor("images")))
        return {"ids": ids, "components": torch.cat(comps), "names": names, "weights": weights, "images": images}
