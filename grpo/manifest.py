"""The evidence of a run: ``output_dir/manifest.json``, what ran, where, with which code, and what it wrote.

One JSON object, rewritten whole (temp file, fsync, rename: a kill -9 leaves the last complete one) by rank 0::

    format       1
    segments     one per start of the run (a fresh start, then one per resume), in order, each:
                 command (this process's argv, with the interpreter), start and end (UTC, ISO 8601; end is the time of
                 the segment's last write: its last checkpoint, or the final export; finished: true once the run
                 completed max_steps), config_sha256 (of the config.yaml this start wrote), code (the git commit of
                 the checkout the code was imported from and whether its tracked files differ from it; null when it
                 is not a git checkout, e.g. an installed package), packages (python, torch, torch_npu when present,
                 deepspeed, diffusers, transformers, peft, open_clip), world_size, hosts, devices ({name: processes}),
                 first_step (completed steps it started from) and resumed_from (the checkpoint, or null)
    checkpoints  {name: {"files": {file: sha256}, "removed": bool}} of every checkpoint the run wrote (from its
                 meta.json, which the checkpoint writer already hashed, plus meta.json's own); removed: pruned by
                 checkpoint.keep or gone since
    exports      {path under output_dir: sha256} of every file under final/ and best/

A resumed run appends its segment to the manifest it finds and keeps the checkpoints and exports recorded before.
"""

from __future__ import annotations

import datetime
import json
import logging
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.checkpoint.damage import _sha256
from grpo.checkpoint.files import META, list_checkpoints, read_meta, write_json_atomic

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1
EXPORTS = ("final", "best")
# distribution names besides torch; torch_npu only when installed
PACKAGES = ("torch_npu", "deepspeed", "diffusers", "transformers", "peft", "open_clip_torch")
_CODE = Path(__file__).resolve().parents[1]  # the folder holding grpo/, recipes/, tools/


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def packages() -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch.__version__}  # with its build, e.g. +cu130
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def code_version(root: Path = _CODE) -> dict | None:
    """{"commit", "dirty"} of the git checkout at `root` (dirty: a tracked file differs from the commit; untracked
    files, e.g. run folders, do not count); None when `root` is not the top of a git checkout or git is missing."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None  # e.g. an installed copy inside some other repository
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: torch.device) -> str:
    """The accelerator's model name (e.g. "NVIDIA H100 80GB HBM3", "Ascend910B3"), or the CPU's."""
    if device.type != "cpu":
        return getattr(torch, device.type).get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


class RunManifest:
    """output_dir/manifest.json of one run; rank 0 writes, the other ranks' instances do nothing after
    :meth:`begin`.

    Args:
        out: the run folder.
        enabled: True on rank 0.
    """

    def __init__(self, out: Path, enabled: bool):
        self.out, self.enabled = Path(out), enabled
        self.path = self.out / MANIFEST
        self.data: dict = {}

    @classmethod
    def begin(cls, out: Path, rank: int, world: int, device: torch.device, resumed_from: Path | None,
              first_step: int) -> RunManifest:
        """Collective (the hosts and devices of every rank): appends this start's segment and writes the manifest.
        Call once config.yaml is written."""
        where = (socket.gethostname(), device_name(device))
        every = [where] * world
        if world > 1:
            dist.all_gather_object(every, where)
        manifest = cls(out, rank == 0)
        if not manifest.enabled:
            return manifest
        manifest.data = manifest._read()
        devices: dict[str, int] = {}
        for _, name in every:
            devices[name] = devices.get(name, 0) + 1
        manifest.data["segments"].append({
            "command": [sys.executable, *sys.argv], "start": _now(), "end": None, "finished": False,
            "config_sha256": _sha256(out / "config.yaml"), "code": code_version(), "packages": packages(),
            "world_size": world, "hosts": sorted({h for h, _ in every}), "devices": devices,
            "first_step": first_step, "resumed_from": str(resumed_from) if resumed_from is not None else None,
        })
        manifest.update()
        return manifest

    def _read(self) -> dict:
        """The manifest of the run this start resumes, or a new one (a fresh run, or a run from before manifests)."""
        fresh = {"format": FORMAT, "segments": [], "checkpoints": {}, "exports": {}}
        if not self.path.exists():
            return fresh
        try:
            data = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:  # written atomically: not a torn write
            log.warning("%s unreadable (%s): starting a new one", self.path, type(e).__name__)
            return fresh
        return data if data.get("format") == FORMAT else fresh

    def update(self, finished: bool = False) -> None:
        """Record the checkpoints and exports now on disk (after a checkpoint, after the final export) and the
        segment's end; `finished`: the run completed."""
        if not self.enabled:
            return
        recorded = self.data["checkpoints"]
        present = set()
        for path in list_checkpoints(self.out / "checkpoints"):
            try:
                files = {name: entry[1] for name, entry in read_meta(path)["files"].items()}
            except ValueError:  # incomplete or damaged: not the run's checkpoint (resume sets such aside)
                continue
            files[META] = _sha256(path / META)
            recorded[path.name] = {"files": files, "removed": False}
            present.add(path.name)
        for name in recorded.keys() - present:
            recorded[name]["removed"] = True
        exports = {str(p.relative_to(self.out)): p for top in EXPORTS for p in sorted((self.out / top).rglob("*"))
                   if p.is_file()}
        self.data["exports"].update({name: _sha256(p) for name, p in exports.items()})
        segment = self.data["segments"][-1]
        segment["end"], segment["finished"] = _now(), finished
        write_json_atomic(self.path, self.data)
