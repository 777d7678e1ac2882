"""tools/device_check.py, the one-command check of a GPU or NPU machine: each part's verdict on its log and result files
and the refusal without an accelerator. The time limit that kills a part's whole process group and (slow) the whole
command on the CPU are in tests/recipe/test_device_check.py."""

from __future__ import annotations

import json

from tests import ROOT
from tools import device_check as dc


def test_pytest_verdict_reads_the_summary_line():
    assert dc.pytest_verdict("...\n===== 2 passed, 4 deselected in 31.20s =====\n", ROOT) == (
        True, "2 passed, 4 deselected in 31.20s")
    assert not dc.pytest_verdict("===== 1 failed, 1 passed in 3.00s =====", ROOT)[0]
    assert not dc.pytest_verdict("ImportError while loading conftest", ROOT)[0]


def test_ratio_verdict_needs_every_step_within_the_limit(tmp_path):
    run = tmp_path / "ratio_run"
    run.mkdir()
    rows = [{"step": 0, "ratio_max_dev": 0.0}, {"step": 1, "ratio_max_dev": 3e-7}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert dc.ratio_verdict("", tmp_path) == (True, "ratio_max_dev max 3e-07 over 2 steps (limit 1e-05)")
    rows[1]["ratio_max_dev"] = 2e-5
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not dc.ratio_verdict("", tmp_path)[0]
    (run / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")  # a run that stopped after one step
    assert not dc.ratio_verdict("", tmp_path)[0]


def test_align_and_bench_verdicts(tmp_path):
    report = {"a": {"device": "cuda:0"}, "b": {"device": "cpu"}, "reward_mean": {"rel": 2e-6},
              "images": {"psnr_db": 61.0}, "blocks": {"time_text_embed": {"0": {"rel": 0.5}},
                                                      "transformer_blocks.0": {"0": {"rel": 4e-5}, "2": {"rel": 9e-5}}}}
    (tmp_path / "align.json").write_text(json.dumps(report))
    ok, detail = dc.align_verdict("", tmp_path)
    assert ok and "worst block rel 9e-05" in detail  # the embedder's 0.5 is not a block
    report["blocks"]["single_transformer_blocks.1"] = {"0": {"rel": 2e-3}}
    (tmp_path / "align.json").write_text(json.dumps(report))
    assert not dc.align_verdict("", tmp_path)[0]
    log = "  matmul rate 700.0 TFLOP/s; model FLOPs 9.1 T, executed 12.0 T; MFU 0.412, HFU 0.540\n" \
          "gpu_flux12b_s_per_image: 1.234\n"
    assert dc.bench_verdict(log, tmp_path) == (True, "1.234 s/image, MFU 0.412")
    assert not dc.bench_verdict("Traceback ...", tmp_path)[0]


def test_no_accelerator_is_refused_without_cpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(dc, "detect", lambda cpu: "cpu")
    assert dc.main(["--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: deepspeed.accelerator found no GPU or NPU")
    assert not (tmp_path / "out").exists()
