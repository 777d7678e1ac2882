"""tools.eval writes beside the run it evaluated (RUN/eval/<checkpoint>), whatever the preset's output_dir, so
evaluating another run of the same preset never writes over this one's scores (issue 56). The whole eval of a
checkpoint, and the CLI writing there: tests/recipe/test_export_eval.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from grpo.config import load_config
from tests import ROOT
from tools.eval import results_dir

PRESET = ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml"


def test_results_go_beside_the_evaluated_run(tmp_path):
    cfg = dataclasses.replace(load_config(PRESET, []), output_dir=str(tmp_path / "preset_dir"))
    for run in ("a", "b"):
        checkpoint = tmp_path / run / "checkpoints" / "step_00000002"
        assert results_dir(cfg, checkpoint) == tmp_path / run / "eval" / "step_00000002"
    loose = tmp_path / "copied" / "step_00000002"  # a checkpoint folder outside a run's checkpoints/
    assert results_dir(cfg, loose) == tmp_path / "copied" / "eval" / "step_00000002"
    assert results_dir(cfg, None) == Path(cfg.output_dir) / "eval" / "base"
