"""`flux-grpo report RUN` (tools/report.py): the page of a run folder, its numbers those of the run's files (the
held-out gain as tools.compare pairs it, throughput means after the first step, the manifest's hashes as sha256sum
lines), and one-line errors for what is not a run folder."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from grpo import manifest as run_manifest
from grpo.manifest import RunManifest
from tools.compare import paired
from tools.report import main, report


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setattr(run_manifest, "code_version", lambda: None)  # git is a process: not in this tier
    out = tmp_path / "my_run"
    out.mkdir()
    (out / "config.yaml").write_text("seed: 42\n")
    rows = [{"step": 0, "eval/reward_mean": 0.5}]
    for step, (rollout, update) in enumerate([(9.0, 9.0), (2.0, 4.0), (4.0, 2.0)]):
        rows.append({"step": step, "reward_mean": 0.5 + 0.1 * step, "time/rollout_s": rollout,
                     "time/update_s": update, "time/rollout_images_per_s": 8 / rollout,
                     "time/update_images_per_s": 8 / update, "step_time_s": rollout + update,
                     "samples_per_s": 8 / (rollout + update), "perf/tflops/rollout": 2.0 * step,
                     "perf/mfu/rollout": 0.1 * step, "perf/tflops/update": 1.0 * step, "perf/mfu/update": 0.05 * step})
    rows.append({"step": 3, "eval/reward_mean": 0.75})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lora = out / "final" / "lora" / "pytorch_lora_weights.safetensors"
    lora.parent.mkdir(parents=True)
    lora.write_bytes(b"adapter")
    RunManifest.begin(out, 0, 1, torch.device("cpu"), None, 0).update(finished=True)
    scores = out / "eval" / "step_00000003" / "scores.json"
    scores.parent.mkdir(parents=True)
    base, ckpt = [0.1, 0.2, 0.3, 0.4], [0.2, 0.2, 0.5, 0.6]
    scores.write_text(json.dumps({"base": {"reward_mean": 0.25, "per_image": base},
                                  "checkpoint": {"step": 3, "weights": "ema", "reward_mean": 0.375,
                                                 "per_image": ckpt}}))
    return out, paired(base, ckpt)


def test_the_page_holds_the_runs_numbers(run):
    out, gain = run
    page = report(out)
    assert page.startswith("# Run `my_run`")
    assert "| 3 | 0.7500 |" in page  # the held-out eval after step 3
    assert f"{gain['mean']:+.4f} ± {gain['se']:.4f}" in page and "| 3 (ema) | 0.3750 |" in page
    # (2 + 4) / 2 s and (4 + 2) / 2 images/s, model TFLOP/s (2 + 4) / 2 and MFU (10% + 20%) / 2: step 0 left out
    assert "| rollout | 3.000 | 3.00 | 3.000 | 15.0% |" in page
    assert "| update | 3.000 | 3.00 | 1.500 | 7.5% |" in page
    assert "MFU is over the device's peak." in page
    lora = out / "final" / "lora" / "pytorch_lora_weights.safetensors"
    assert f"{hashlib.sha256(lora.read_bytes()).hexdigest()}  final/lora/pytorch_lora_weights.safetensors" in page
    assert "| yes | 0 | 1 |" in page and "not a git checkout" in page  # the one start: finished, from 0, world 1


def test_main_writes_beside_the_run_and_refuses_a_non_run(run, tmp_path, capsys):
    out, _ = run
    assert main([str(out)]) == 0
    assert (out / "report.md").read_text() == report(out)
    assert main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no metrics.jsonl" in err and err.count("\n") == 1


def test_without_a_known_peak_the_page_says_why_mfu_is_missing(run):
    out, _ = run
    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/mfu/")}
            for line in (out / "metrics.jsonl").read_text().splitlines()]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = report(out)
    assert "| rollout | 3.000 | 3.00 | 3.000 | – |" in page and "set perf.peak_tflops" in page
