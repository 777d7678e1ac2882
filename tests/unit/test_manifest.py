"""output_dir/manifest.json (grpo/manifest.py) in-process: the fields of a segment, the checkpoints' and exports'
hashes equal sha256 of the files, a resume appends a segment and keeps what was recorded, pruned checkpoints stay
recorded as removed. A real 2-process run and its resume:
tests/recipe/test_manifest_runs.py."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from grpo import checkpoint as ckpt
from grpo import manifest as run_manifest
from grpo.manifest import MANIFEST, RunManifest, packages

CODE = {"commit": "0" * 40, "dirty": False}


@pytest.fixture(autouse=True)
def no_git(monkeypatch):
    """The commit comes from `git` (a process; this tier starts none): tests/recipe/test_manifest_runs.py checks it."""
    monkeypatch.setattr(run_manifest, "code_version", lambda: CODE)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checkpoint(out: Path, step: int) -> Path:
    """A checkpoint folder as the writer leaves it: its files, then meta.json with their sizes and hashes."""
    path = out / "checkpoints" / ckpt.checkpoint_name(step)
    path.mkdir(parents=True)
    (path / ckpt.rank_file(0)).write_bytes(bytes([step]) * 100)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"model" * step)
    files = {p.name: [p.stat().st_size, _sha(p)] for p in path.iterdir()}
    (path / ckpt.META).write_text(json.dumps({"format": ckpt.FORMAT, "step": step, "files": files}))
    return path


def test_segments_checkpoints_and_exports(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("seed: 42\n")
    first = RunManifest.begin(out, 0, 1, torch.device("cpu"), None, 0)
    data = json.loads((out / MANIFEST).read_text())
    [seg] = data["segments"]
    assert seg["config_sha256"] == _sha(out / "config.yaml") and seg["world_size"] == 1 and seg["first_step"] == 0
    assert seg["resumed_from"] is None and seg["finished"] is False and seg["start"] <= seg["end"]
    assert seg["hosts"] and sum(seg["devices"].values()) == 1 and seg["command"][0] and seg["code"] == CODE
    assert {"python", "torch", "deepspeed", "diffusers", "transformers", "peft"} <= set(seg["packages"])
    assert data["checkpoints"] == {} and data["exports"] == {}

    one, two = _checkpoint(out, 1), _checkpoint(out, 2)
    first.update()
    data = json.loads((out / MANIFEST).read_text())
    for path in (one, two):
        assert data["checkpoints"][path.name] == {"files": {p.name: _sha(p) for p in path.iterdir()}, "removed": False}

    # a resumed start: its own segment after the first; the first's checkpoints stay, the pruned one marked
    shutil.rmtree(one)
    (out / "config.yaml").write_text("seed: 42\nmax_steps: 3\n")
    resumed = RunManifest.begin(out, 0, 1, torch.device("cpu"), two, 2)
    lora = out / "final" / "lora" / "pytorch_lora_weights.safetensors"
    lora.parent.mkdir(parents=True)
    lora.write_bytes(b"weights")
    resumed.update(finished=True)
    data = json.loads((out / MANIFEST).read_text())
    assert [s["first_step"] for s in data["segments"]] == [0, 2]
    assert data["segments"][0] == seg | {"end": data["segments"][0]["end"]}  # the first segment kept as it was
    assert data["segments"][1]["resumed_from"] == str(two) and data["segments"][1]["finished"] is True
    assert data["segments"][1]["config_sha256"] == _sha(out / "config.yaml") != seg["config_sha256"]
    assert data["checkpoints"][one.name]["removed"] and not data["checkpoints"][two.name]["removed"]
    assert data["exports"] == {"final/lora/pytorch_lora_weights.safetensors": _sha(lora)}


def test_other_ranks_write_nothing(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 42\n")
    RunManifest.begin(tmp_path, 1, 1, torch.device("cpu"), None, 0).update(finished=True)
    assert not (tmp_path / MANIFEST).exists()


def test_packages_are_the_installed_versions():
    import deepspeed
    import diffusers

    found = packages()
    assert found["torch"] == torch.__version__
    assert found["deepspeed"] == deepspeed.__version__ and found["diffusers"] == diffusers.__version__
