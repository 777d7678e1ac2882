"""The recipe trains from prompt datasets with per-sample metadata: the tiny preset for one step on 2 processes from
assets/prompts/tiny_{train,heldout}.jsonl with the tiny_world_meta reward only (it scores from each sample's metadata,
so the metadata reached the rewards by global index, in training and in the held-out eval), then one step on 1
process from the same rows as a .parquet file and as a datasets save_to_disk folder."""

from __future__ import annotations

import json
import math

import pytest

from tests import ROOT
from tests.recipe.launch import SMALL, run_recipe, train_rows

LORA = "recipes/configs/tiny/grpo_lora.yaml"
PROMPTS = ROOT / "assets" / "prompts"


def _one_step(tmp, name: str, nproc: int, train: str, eval_prompts: str | None) -> dict:
    out = tmp / name
    overrides = [*SMALL, "max_steps=1", f"output_dir={out}", f"data.cache_dir={tmp / 'cache'}",
                 f"data.train_prompts={train}", f"data.eval_prompts={eval_prompts or 'null'}",
                 "rewards={tiny_world_meta: 1.0}", "logging.eval_seeds=1", "logging.sample_every=0",
                 "logging.tensorboard=false", "checkpoint.every=0"]
    proc = run_recipe(LORA, overrides, nproc, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"dir": out, "train": [r for r in train_rows(out) if "loss" in r], "rows": rows}


def _trained(run: dict) -> None:
    [row] = run["train"]
    assert math.isfinite(row["reward_mean"]) and 0 < row["reward_mean"] <= 1
    assert row["reward/tiny_world_meta_mean"] == row["reward_mean"]  # the only reward, weight 1
    assert math.isfinite(row["loss"]) and row["grad_norm"] > 0 and row["skipped_updates"] == 0
    assert (run["dir"] / "final" / "lora").is_dir()


def test_a_jsonl_dataset_with_a_metadata_reward_trains_on_two_processes(tmp_path):
    run = _one_step(tmp_path, "jsonl", 2, str(PROMPTS / "tiny_train.jsonl"), str(PROMPTS / "tiny_heldout.jsonl"))
    _trained(run)
    evals = [r["eval/reward_mean"] for r in run["rows"] if "eval/reward_mean" in r]
    assert len(evals) == 2 and all(math.isfinite(e) and 0 < e <= 1 for e in evals)  # before step 0 and after it


@pytest.mark.slow
def test_parquet_and_a_datasets_folder_train_on_one_process(tmp_path):
    import datasets

    rows = [json.loads(line) for line in (PROMPTS / "tiny_train.jsonl").read_text().splitlines()]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "tiny_train.parquet"))
    table.save_to_disk(str(tmp_path / "tiny_train_folder"))
    runs = [_one_step(tmp_path, f"run_{name}", 1, str(tmp_path / name), None)
            for name in ("tiny_train.parquet", "tiny_train_folder")]
    for run in runs:
        _trained(run)
    # the same rows in the same order: the same step, bit for bit
    assert runs[0]["train"][0]["reward_mean"] == runs[1]["train"][0]["reward_mean"]
    assert runs[0]["train"][0]["grad_norm"] == runs[1]["train"][0]["grad_norm"]
