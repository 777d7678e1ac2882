"""The benchmarks run (in their tiny --smoke mode) and end with their `name: value` headline.

The numbers of a smoke run mean nothing; benchmarks/RESULTS.md holds the real runs. The zero3_memory smoke run also
checks the planner's model states against the measured ones.
"""

import json
import math
import re
import subprocess
import sys

import pytest

from tests import ROOT
from tools.launch import launch_env


def run(script: str, *args: str, timeout: int = 900) -> list[str]:
    env = launch_env(unbuffered=False)  # the CPU accelerator, one thread per process
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()


def headline(lines: list[str], name: str) -> float:
    m = re.fullmatch(rf"{name}: ([0-9.eE+-]+)", lines[-1])
    assert m, lines[-1]
    value = float(m.group(1))
    assert math.isfinite(value) and value > 0
    return value


def test_rollout_smoke():
    lines = run("rollout.py", "--smoke", "--skip-zero3")
    headline(lines, "rollout_vs_diffusers")
    assert any("ours (latents only)" in line for line in lines)


@pytest.mark.slow  # CI time: the benchmark's engines are build_policy's, which every recipe test builds
def test_step_efficiency_smoke():
    lines = run("step_efficiency.py", "--smoke")
    e = headline(lines, "step_efficiency")
    assert e < 2.0  # an efficiency above the machine's matmul rate would mean miscounted FLOPs or time
    assert any("DeepSpeed ZeRO-3 overhead" in line for line in lines)
    phases = [line for line in lines if "by phase" in line]
    assert len(phases) == 2 and "zero3 blocks" in phases[1], phases  # module-by-module and whole-block fetch
    assert all(f"{phase} " in phases[0] for phase in ("rollout", "forward", "backward", "optimizer step")), phases


@pytest.mark.slow
def test_gpu_flux12b_smoke_on_the_cpu():
    """The GPU script's path (LoRA, bf16 ZeRO-3 engine, checkpointing, gathered rollout) on the tiny config."""
    headline(run("gpu_flux12b.py", "--smoke"), "gpu_flux12b_s_per_image")


@pytest.mark.slow
def test_rollout_smoke_with_zero3_gather_vs_layerwise():
    lines = run("rollout.py", "--smoke")
    assert any("gather_for_rollout speed-up" in line for line in lines)
    headline(lines, "rollout_vs_diffusers")


@pytest.mark.slow
def test_zero3_memory_smoke_and_planner_accuracy():
    lines = run("zero3_memory.py", "--smoke", timeout=1800)
    ratio = headline(lines, "zero3_state_ratio")
    assert 0.45 < ratio <= 0.55  # halved by the second process, up to padding
    # Activations of the tiny model are a few MiB, within page-level noise: test_plan.py checks them at size.
    line = next(x for x in lines if x.startswith("planner vs measured model states"))
    assert float(line.rsplit(" ", 1)[1].rstrip("%")) <= 15.0, line
    assert any(line.strip().startswith("zero3") and "model copies" in line for line in lines)


@pytest.mark.slow  # ~160 s (two training seeds); its arithmetic is tests/unit/test_time_to_reward.py's (CI time)
def test_time_to_reward_smoke(tmp_path):
    """Two strategies on a 2-step budget, two training seeds: the cost model agrees with what the runs log, the tables
    per seed and over the seeds are printed, and --report-only rebuilds them from the saved runs."""
    lines = run("time_to_reward.py", "--smoke", "--out", str(tmp_path), timeout=1800)  # four runs: room on a busy host
    # the smoke's 2-step baseline may gain nothing on a seed: then that seed has no reading
    best = r"mixgrpo_flash, mean of [12] seeds?; worst seed 4[23]: [0-9.]+|no strategy has a reading"
    assert re.fullmatch(rf"time_to_reward_speedup: [0-9.]+ \(({best})\)", lines[-1]), lines[-1]
    assert any(line.strip().startswith("mixgrpo_flash:") and "fwd/image" in line for line in lines)
    over = lines[lines.index(next(x for x in lines if x.startswith("over training seeds 42 43:"))) + 1:-2]
    assert [x.split()[0] for x in over] == ["dancegrpo"] * 2 + ["mixgrpo_flash"] * 3, over
    assert (tmp_path / "time_to_reward.png").is_file()
    assert json.loads((tmp_path / "seeds.json").read_text())["seeds"] == [42, 43]
    assert run("time_to_reward.py", "--smoke", "--out", str(tmp_path), "--report-only") == lines
