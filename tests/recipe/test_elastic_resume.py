"""Resume on another number of processes: a checkpoint written by 2 processes continued on 1, and one written by 1
continued on 2, each against the same uninterrupted 2-process run (grpo LoRA with EMA, grpo full fine-tune, nft LoRA
with its lagging policy, awm LoRA with its EMA anchor, and awm LoRA with true CFG on the tiny FLUX.2).

    A   2 processes, steps 0..2, a checkpoint after every step
    B   1 process, resumed from A's step-1 checkpoint (2 -> 1), to step 2
    C   1 process, step 0 only; then 2 processes, checkpoint.resume=auto (1 -> 2), to step 2

B and C log A's steps 1 and 2 to the 1-vs-N tolerance (metrics 1e-5 relative; a grpo loss at ratio 1 is a rounding-level
number, so it gets an absolute floor) and end with A's weights, EMA, lagging policy and final export to 1e-3
relative per tensor. The source checkpoint is left as it was.
Those runs are in the slow tier; the default tier has the refusal of a world size the batch does not split over.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from grpo import checkpoint as ckpt
from grpo.config import load_config, to_dict
from tests import ROOT, TINY, TINY_FLUX2, snapshot
from tests.recipe.launch import one_error_line, run_recipe, run_script, tiny_run, train_rows, trained_weights

STEPS = 3
METRICS = ("reward_mean", "reward_std", "reward_std_in_group_mean", "zero_std_frac", "grad_norm")
CASES = {
    "grpo_lora": ("recipes/configs/tiny/grpo_lora.yaml", ["ema.decay=0.9"]),
    "grpo_full": ("recipes/configs/tiny/grpo_full.yaml", []),
    # a lagging policy well apart from the weights (the preset's 0.001 k decay keeps it within 0.1% of them)
    "nft_lora": ("recipes/configs/tiny/nft_lora.yaml", ["nft.lag_rate=0.25"]),
    # awm's lagging policy is its EMA anchor; the same decay for the same reason
    "awm_lora": ("recipes/configs/tiny/awm_lora.yaml", ["awm.lag_rate=0.25"]),
    # true CFG on the non-distilled tiny FLUX.2, AWM training the guided velocity: the negative prompt's cache and
    # both branches' calls on every rank, whatever their number
    "awm_cfg_flux2": ("recipes/configs/tiny_flux2/awm_lora.yaml",
                      [f"model.path={TINY_FLUX2}", "awm.lag_rate=0.25", "ema.decay=0.9",
                       "sampling.true_cfg.scale=4.0", "sampling.true_cfg.train=guided"]),
}
LAGGING = ("nft", "awm")  # the objectives with a lagging policy


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_a_world_size_the_checkpoints_batch_does_not_split_over_exits_2_before_any_rank(tmp_path):
    """NPROC=3 resuming a 2-process checkpoint of 8 images per step: launch/run.sh's start-up checks refuse it with
    the checkpoint's line (the batch is fixed by it: the fix is the process count), before torchrun, and output_dir
    keeps every mtime."""
    out = tmp_path / "run"
    args = [f"output_dir={out}", f"model.path={TINY}", f"data.cache_dir={tmp_path / 'cache'}",
            "batch.prompts_per_step=2", "sampling.group_size=4", "batch.micro_batch_size=1"]
    config = str(ROOT / CASES["grpo_lora"][0])
    path = out / "checkpoints" / ckpt.checkpoint_name(3)
    path.mkdir(parents=True)
    (path / ckpt.META).write_text(json.dumps({"format": ckpt.FORMAT, "step": 3, "world_size": 2, "lora": True,
                                              "ema": False, "files": {},
                                              "config": to_dict(load_config(config, args))}))
    before = snapshot(out)
    proc = run_script("run.sh", [config, *args, "checkpoint.resume=auto"], extra_env={"NPROC": "3"}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = one_error_line(proc.stderr)
    assert line.startswith(f"error: checkpoint.resume: {path} was written by 2 processes"), line
    assert line.endswith("relaunch on 1, 2, 4 or 8 processes"), line
    assert "[launch]" not in proc.stderr  # no rank was started
    assert snapshot(out) == before


@pytest.fixture(scope="module", params=list(CASES))
def runs(request, tmp_path_factory):
    config, extra = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    common = [*tiny_run(tmp), "checkpoint.every=1", f"checkpoint.keep={STEPS}", "data.eval_prompts=null",
              "logging.sample_every=0", "logging.tensorboard=false", f"data.cache_dir={tmp / 'cache'}", *extra]
    a, b, c = tmp / "A", tmp / "B", tmp / "C"
    procs = {"A": run_recipe(config, [*common, f"max_steps={STEPS}", f"output_dir={a}"], nproc=2)}
    assert procs["A"].returncode == 0, procs["A"].stderr[-3000:]
    source = a / "checkpoints" / ckpt.checkpoint_name(1)
    before = _files(source)
    procs["B"] = run_recipe(config, [*common, f"max_steps={STEPS}", f"output_dir={b}",
                                     f"checkpoint.resume={source}"], nproc=1)
    procs["C1"] = run_recipe(config, [*common, "max_steps=1", f"output_dir={c}"], nproc=1)
    procs["C2"] = run_recipe(config, [*common, f"max_steps={STEPS}", f"output_dir={c}", "checkpoint.resume=auto"],
                             nproc=2)
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return {"case": request.param, "A": a, "B": b, "C": c, "procs": procs, "source": source, "before": before,
            "ema": any(e.startswith("ema.decay=") for e in extra)}


def _lagging(path: Path) -> dict[str, torch.Tensor]:
    """The lagging policy's full tensors from every rank's shard (ZeRO-3's padded flat layout, rank order)."""
    meta = ckpt.read_meta(path)
    files = [safe_open(str(path / ckpt.rank_file(r)), framework="pt") for r in range(meta["world_size"])]
    shapes = json.loads(files[0].metadata()["lag_shapes"])
    return {n: torch.cat([f.get_tensor("lag/" + n) for f in files])[:numel].reshape(shape)
            for n, (shape, numel) in shapes.items()}


def _max_rel(ours: dict, theirs: dict) -> float:
    assert set(ours) == set(theirs)
    return max(((ours[k].float() - theirs[k].float()).norm() / theirs[k].float().norm().clamp_min(1e-12)).item()
               for k in theirs)


def _assert_continues(runs, resumed: str) -> None:
    ref = {r["step"]: r for r in train_rows(runs["A"])}
    rows = [r for r in train_rows(runs[resumed]) if r["step"] >= 1]
    assert [r["step"] for r in rows] == list(range(1, STEPS))
    worst = {}
    for r in rows:
        for key in METRICS:
            assert r[key] == pytest.approx(ref[r["step"]][key], rel=1e-5, abs=1e-12), (r["step"], key)
            worst[key] = max(worst.get(key, 0.0), abs(r[key] - ref[r["step"]][key]) / max(abs(ref[r["step"]][key]),
                                                                                            1e-12))
        # grpo at ratio 1: minus the mean of zero-mean advantages, a rounding-level number (see
        # tests/recipe/launch.py assert_two_steps_agree); nft's loss is a real number
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-5, abs=1e-5), (r["step"], "loss")
    last = ckpt.checkpoint_name(STEPS)
    mine, theirs = runs[resumed] / "checkpoints" / last, runs["A"] / "checkpoints" / last
    weights = {"model": _max_rel(trained_weights(mine, "model"), trained_weights(theirs, "model"))}
    if runs["ema"]:
        weights["ema"] = _max_rel(trained_weights(mine, "ema"), trained_weights(theirs, "ema"))
    if runs["case"].startswith(LAGGING):
        weights["lagging"] = _max_rel(_lagging(mine), _lagging(theirs))
    # the export at the end (final/lora or final/transformer), gathered from the resharded engine
    for f in sorted((runs["A"] / "final").rglob("*.safetensors")):
        rel = f.relative_to(runs["A"])
        weights[str(rel.parent)] = _max_rel(load_file(str(runs[resumed] / rel)), load_file(str(f)))
    assert len(weights) > 1 + runs["ema"] + runs["case"].startswith(LAGGING)  # the export was compared
    print(f"\n{runs['case']} {resumed}: max relative differences: metrics {worst}, tensors {weights}")
    assert all(v <= 1e-3 for v in weights.values()), weights


@pytest.mark.slow
def test_two_process_checkpoint_continues_on_one(runs):
    assert "resharded" in runs["procs"]["B"].stderr and "from 2 to 1 processes" in runs["procs"]["B"].stderr
    _assert_continues(runs, "B")


@pytest.mark.slow
def test_one_process_checkpoint_continues_on_two(runs):
    assert "from 1 to 2 processes" in runs["procs"]["C2"].stderr
    _assert_continues(runs, "C")


@pytest.mark.slow
def test_the_source_checkpoint_is_untouched_and_its_conversion_gone(runs):
    """The conversion went into the resuming run's checkpoints/.universal-<name>/, never into the source folder,
    and was deleted by the resumed run's first complete save."""
    assert _files(runs["source"]) == runs["before"]
    for run in ("B", "C"):
        assert not [p.name for p in (runs[run] / "checkpoints").iterdir() if p.name.startswith((".universal",
                                                                                                 ".tmp"))]
