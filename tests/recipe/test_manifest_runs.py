"""A real run's manifest.json (grpo/manifest.py): 2 processes, 2 steps with a checkpoint each and checkpoint.keep=1,
then checkpoint.resume=auto to a 3rd step: one segment per start, the hashes equal the files on disk (the
checkpoints, the pruned one recorded as removed, the final LoRA), the config hash the config.yaml each start wrote.
With -m slow (two launches, ~4 min on 2 shared cores); the default tier checks a fresh run's manifest in
tests/recipe/test_recipe_cli.py. Also the code's commit, as git reads it (null outside a git checkout)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from grpo import checkpoint as ckpt
from grpo.manifest import MANIFEST, code_version
from tests import ROOT
from tests.recipe.launch import run_recipe, tiny_run

CONFIG = "recipes/configs/tiny/grpo_lora.yaml"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_manifest_of_a_run_and_its_resume(tmp_path):
    out = tmp_path / "run"
    common = [*tiny_run(tmp_path), "checkpoint.every=1", "checkpoint.keep=1", "data.eval_prompts=null",
              "logging.sample_every=0", "logging.tensorboard=false", f"data.cache_dir={tmp_path / 'cache'}",
              f"output_dir={out}"]
    first = run_recipe(CONFIG, [*common, "max_steps=2"], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    config_first = _sha(out / "config.yaml")
    resumed = run_recipe(CONFIG, [*common, "max_steps=3", "checkpoint.resume=auto"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    data = json.loads((out / MANIFEST).read_text())
    one, two = data["segments"]
    assert [one["first_step"], two["first_step"]] == [0, 2] and one["finished"] and two["finished"]
    assert one["resumed_from"] is None and two["resumed_from"] == str(out / "checkpoints" / ckpt.checkpoint_name(2))
    assert one["config_sha256"] == config_first and two["config_sha256"] == _sha(out / "config.yaml")
    for seg in (one, two):
        assert seg["world_size"] == 2 and sum(seg["devices"].values()) == 2 and len(seg["hosts"]) == 1
        assert "--config" in seg["command"] and seg["start"] <= seg["end"]
    assert two["start"] >= one["end"]
    # every checkpoint written, hashed as on disk; keep=1 pruned the first two
    names = [ckpt.checkpoint_name(s) for s in (1, 2, 3)]
    assert sorted(data["checkpoints"]) == names
    assert [data["checkpoints"][n]["removed"] for n in names] == [True, True, False]
    last = out / "checkpoints" / names[-1]
    assert data["checkpoints"][names[-1]]["files"] == {p.name: _sha(p) for p in last.iterdir() if p.is_file()}
    lora = out / "final" / "lora" / "pytorch_lora_weights.safetensors"
    assert data["exports"] == {str(lora.relative_to(out)): _sha(lora)}


def test_code_version_is_this_checkout_or_null(tmp_path):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    here = code_version()
    if git("rev-parse", "--show-toplevel"):  # a checkout (CI, development); an installed copy has none
        assert here == {"commit": git("rev-parse", "HEAD"),
                        "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    assert code_version(tmp_path) is None  # not a git checkout
