"""The README's path: launch/run.sh on 2 CPU processes, what a run writes, and that the exports load in diffusers."""

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from grpo.models import family_of
from grpo.perf import forward_flops
from tests import ROOT, TINY
from tests.recipe.launch import run_script
from tools.launch import free_port

FAST = ["batch.prompts_per_step=2", "sampling.group_size=4", "batch.micro_batch_size=4", "sampling.num_steps=4",
        "max_steps=2", "logging.sample_every=1", f"model.path={TINY}"]
FIELDS = {"step", "reward_mean", "reward_std", "loss", "kl", "ratio_mean", "ratio_max_dev", "clip_frac", "grad_norm",
          "lr", "step_time_s", "samples_per_s", "time/rollout_images_per_s", "time/update_images_per_s",
          "perf/tflops/rollout", "perf/tflops/update", "perf/mfu/rollout", "perf/mfu/update"}
PEAK = 0.5  # perf.peak_tflops: a CPU has no peak in grpo/perf.py's table, so MFU is logged only with the override


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def launch(config: str, out, *extra: str) -> subprocess.CompletedProcess:
    args = [str(ROOT / config), *FAST, f"output_dir={out}", f"data.cache_dir={out.parent / 'cache'}", *extra]
    return run_script("run.sh", args, extra_env={"MASTER_PORT": str(free_port()), "NPROC": "2"})


# The LoRA case with -m slow (CI time): launch/run.sh, the logs and the fields are the same as the full fine-tune's,
# and a LoRA export loading into FluxPipeline is tests/recipe/test_matching_runs.py's.
@pytest.mark.parametrize("kind", [pytest.param("lora", marks=pytest.mark.slow), "full"])
def test_run_sh_trains_logs_and_exports(tmp_path, kind):
    out = tmp_path / "run"
    proc = launch(f"recipes/configs/tiny/grpo_{kind}.yaml", out, f"perf.peak_tflops={PEAK}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [0, 1]
    # one forward's model FLOPs at the run's shapes (64 px: the tiny VAE's latent grid; 32 prompt tokens)
    vae = json.loads((TINY / "vae" / "config.json").read_text())
    side = 64 // 2 ** (len(vae["block_out_channels"]) - 1) // 2
    forward = forward_flops(family_of(TINY), TINY, side * side, 32)
    for r in train:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["ratio_max_dev"] <= 1e-5
        # perf/*: the phases' model FLOPs over their times, per device (2), add up to the plan's forwards per image
        done = sum(r[f"perf/tflops/{p}"] * r[f"time/{p}_s"] for p in ("rollout", "update")) * 2 * 1e12 / 8
        assert done == pytest.approx(r["forwards_per_image"] * forward, rel=1e-9)
        assert all(r[f"perf/mfu/{p}"] == pytest.approx(r[f"perf/tflops/{p}"] / PEAK) for p in ("rollout", "update"))
    assert any("eval/reward_mean" in r for r in rows)
    assert (out / "config.yaml").is_file() and (out / "samples" / "step_00000.png").is_file()
    assert list((out / "tensorboard").iterdir())
    # the evidence of the run (grpo/manifest.py; a resume's segment: tests/recipe/test_manifest_runs.py)
    manifest = json.loads((out / "manifest.json").read_text())
    [segment] = manifest["segments"]
    assert segment["finished"] and segment["world_size"] == 2 and segment["config_sha256"] == _sha(out / "config.yaml")
    exports = [p for top in ("final", "best") for p in sorted((out / top).rglob("*")) if p.is_file()]
    assert (out / "best" / "best.json").is_file()  # the held-out evals kept their best (grpo/best.py)
    assert exports and manifest["exports"] == {str(p.relative_to(out)): _sha(p) for p in exports}

    pipe = FluxPipeline.from_pretrained(str(TINY), dtype=torch.float32)
    if kind == "lora":
        pipe.load_lora_weights(str(out / "final" / "lora"))
        assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    else:
        trained = FluxTransformer2DModel.from_pretrained(str(out / "final" / "transformer"))
        base = pipe.transformer.state_dict()
        changed = [k for k, v in trained.state_dict().items() if not torch.equal(v, base[k])]
        assert changed  # the export holds the updated full weights, with full shapes
        assert all(trained.state_dict()[k].shape == base[k].shape for k in base)


def test_bad_setting_exits_2_before_any_work(tmp_path):
    out = tmp_path / "run"
    proc = launch("recipes/configs/tiny/grpo_lora.yaml", out, "sampling.group_size=1")
    assert proc.returncode == 2  # the launcher's own check: torchrun would report the rank's 2 as 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: sampling.group_size")
    assert not out.exists()
