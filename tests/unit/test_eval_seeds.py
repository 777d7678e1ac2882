"""Held-out eval with several images per prompt (logging.eval_seeds): image j shows prompt j % n from eval noise j,
so the first n images are those of a one-seed eval, and per-prompt scores average the seeds."""

from __future__ import annotations

import os

import pytest
import torch

from grpo.config import load_config
from grpo.errors import ConfigError
from tests import ROOT, TINY
from tools.eval import evaluate_checkpoint

PROMPTS = ["a red circle on a cyan background", "a blue square on a yellow background", "a green triangle on a "
           "magenta background"]


def _eval(tmp_path, seeds: int) -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    (tmp_path / "heldout.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", [
        f"model.path={TINY}", f"data.eval_prompts={tmp_path / 'heldout.txt'}", f"data.cache_dir={tmp_path / 'cache'}",
        f"output_dir={tmp_path / 'run'}", "sampling.num_steps=3", f"logging.eval_seeds={seeds}"])
    return evaluate_checkpoint(cfg, None, out_dir=tmp_path / f"eval{seeds}")


def test_eval_seeds_extend_the_one_seed_eval(tmp_path):
    one, three = _eval(tmp_path, 1), _eval(tmp_path, 3)
    n = len(PROMPTS)
    assert one["images"]["base"].shape[0] == n and three["images"]["base"].shape[0] == 3 * n
    # equal up to the rounding of another micro-batch shape (9 images vs 3)
    torch.testing.assert_close(three["images"]["base"][:n], one["images"]["base"], atol=1e-5, rtol=0)
    assert (three["images"]["base"][n:2 * n] - one["images"]["base"]).abs().max() > 1e-2  # other noise
    scores = torch.tensor(three["base"]["components"]["tiny_world"]).view(3, n)
    torch.testing.assert_close(torch.tensor(three["base"]["per_prompt"]), scores.mean(0))
    assert three["base"]["reward_mean"] == pytest.approx(scores.mean().item(), abs=1e-6)
    # one reward of weight 1: the per-image total tools.compare pairs is that reward's score
    torch.testing.assert_close(torch.tensor(three["base"]["per_image"]), scores.flatten())


def test_eval_seeds_must_be_positive():
    with pytest.raises(ConfigError, match="logging.eval_seeds"):
        from grpo.checks import validate

        validate(load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", ["logging.eval_seeds=0"]))
