"""Every rollout strategy and AWM on the tiny FLUX.2 [klein] world (assets/tiny-flux2) under ZeRO-3: the tiny FLUX.1
strategy presets (MixGRPO's windows, Flow-GRPO-Fast's CPS with random windows, GRPO-Guard's RatioNorm, BranchGRPO's
trees, Flash-GRPO's step per group, OP-GRPO's replay, AWM) resolved on the tiny FLUX.2 model base
(recipes/configs/tiny_flux2/base.yaml in place of tiny/base.yaml: grpo.schema.read_preset's swap). For each: the
first-pass ratio is exactly 1 (grpo), 1 and 2 processes train the same, and a run resumed from step 1 ends where the
uninterrupted one does.

(grpo with DanceGRPO's SDE, the full fine-tune, DiffusionNFT and the exports: tests/recipe/test_flux2_runs.py.)
Three 2-step runs a strategy, about 90 s each on 2 cores: with -m slow (CI time).
"""

from __future__ import annotations

import pytest
import yaml

from grpo.schema import read_preset
from tests import ROOT, TINY_FLUX2
from tests.recipe.launch import SMALL, assert_resumed_step_exact, assert_two_steps_agree, run_recipe, train_rows

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (TINY_FLUX2 / "model_index.json").exists(), reason="tiny FLUX.2 not built")]
STRATEGIES = {
    "windows": ("tiny/mixgrpo_lora", []),
    "cps": ("tiny/flowgrpo_fast_lora", []),
    "guard": ("tiny/grpo_lora", ["sampling.sde=flow", "grpo.ratio_norm=true"]),
    "trees": ("tiny/branchgrpo_lora", []),
    "flash": ("tiny/flashgrpo_lora", []),  # one SDE step per group, rescaled
    "awm": ("tiny/awm_lora", ["awm.lag_rate=0.3"]),  # a lagging anchor that really lags, so its resume is tested
    # OP-GRPO's replay: blocks of 2 of the 8 images, so step 1 replays 2 of step 0's entries (and the resume from
    # step 1 restores a non-empty buffer)
    "replay": ("experimental/tiny_opgrpo_lora", ["batch.micro_batch_size=1", "batch.updates_per_step=4",
                                                 "grpo.replay.size=4", "grpo.replay.per_step=2",
                                                 "grpo.replay.truncate=2"]),
}


def _run(tmp, name: str, config: str, nproc: int, extra: list[str]) -> dict:
    out = tmp / name
    # Every transition trained (a window trains all its steps; the presets' own timestep_fraction is 1.0).
    small = [o for o in SMALL if not o.startswith("grpo.timestep_fraction=")]
    overrides = [*small, f"model.path={TINY_FLUX2}",
                 f"output_dir={out}", f"data.cache_dir={tmp / 'cache'}",
                 "data.eval_prompts=null", "logging.sample_every=0", "logging.tensorboard=false", "max_steps=2",
                 "checkpoint.every=1", "checkpoint.keep=2", "optim.lr=1e-2", *extra]
    proc = run_recipe(config, overrides, nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"dir": out, "rows": [r for r in train_rows(out) if "loss" in r]}


@pytest.fixture(scope="module", params=list(STRATEGIES))
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    preset, extra = STRATEGIES[request.param]
    # The FLUX.1 strategy preset on the tiny FLUX.2 model base, resolved into one file the recipe reads
    config = tmp / "preset.yaml"
    configs = ROOT / "recipes/configs"
    config.write_text(yaml.safe_dump(read_preset(configs / f"{preset}.yaml",
                                                 swap={configs / "tiny/base.yaml": configs / "tiny_flux2/base.yaml"})))
    config = str(config)
    two = _run(tmp, "two", config, 2, extra)
    return {
        "strategy": request.param,
        "two": two,
        "one": _run(tmp, "one", config, 1, extra),
        "resumed": _run(tmp, "resumed", config, 2,
                        [*extra, f"checkpoint.resume={two['dir']}/checkpoints/step_00000001"]),
    }


def test_the_first_pass_ratio_is_exactly_one(runs):
    if runs["strategy"] == "awm":
        pytest.skip("AWM has no likelihood ratio")
    assert [r["ratio_max_dev"] for r in runs["two"]["rows"]] == [0.0, 0.0]
    if runs["strategy"] == "replay":  # step 1 replayed step 0's entries, its own first pass exactly on-policy too
        assert [(r["replay/blocks"], r.get("replay/ratio_max_dev")) for r in runs["two"]["rows"]] == [(0, None),
                                                                                                      (1, 0.0)]
        assert runs["resumed"]["rows"][0]["replay/blocks"] == 1.0


def test_one_and_two_processes_train_the_same(runs):
    assert_two_steps_agree(runs["one"], runs["two"])


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(runs):
    assert_resumed_step_exact(runs["two"], runs["resumed"])
