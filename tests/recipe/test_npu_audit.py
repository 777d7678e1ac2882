"""The NPU op audit command (python -m tools.npu_audit) on the tiny presets, FLUX.1, FLUX.2 and FLUX.3 (whose RoPE
diffusers builds in float32 on an NPU): one recipe step each, no finding. The audit
itself on small models: tests/unit/test_npu_audit.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.launch import launch_env

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "assets" / "tiny-flux" / "model_index.json"


@pytest.mark.slow
@pytest.mark.skipif(not TINY.exists(), reason="assets/tiny-flux not built")
@pytest.mark.parametrize("preset", ["tiny/grpo_lora", "tiny/grpo_full", "tiny_flux2/grpo_lora", "tiny_flux3/grpo_lora"])
def test_tiny_presets_are_clean(preset: str, tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "tools.npu_audit", f"recipes/configs/{preset}.yaml",
         f"output_dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache", "batch.prompts_per_step=2",
         "sampling.group_size=2", "batch.micro_batch_size=2", "sampling.num_steps=3"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env=launch_env(accelerator=None, unbuffered=False),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "no NPU-hostile ops found" in proc.stdout
