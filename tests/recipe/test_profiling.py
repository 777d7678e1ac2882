"""grpo.profiling: the chosen steps (and only those) are traced, with torch.profiler here and torch_npu's on NPU."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from grpo.checks import validate
from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.profiling import StepProfiler
from tests import ROOT, TINY
from tests.recipe.launch import run_recipe


def _work() -> None:
    a = torch.randn(32, 32)
    (a @ a).sum()


def test_cpu_trace_of_the_chosen_steps_only(tmp_path: Path):
    prof = StepProfiler([1, 3], tmp_path, "profile", rank=0, device=torch.device("cpu"))
    written = {}
    for step in range(3):
        prof.start(step)
        _work()
        written[step] = prof.stop()
    assert written[0] is None and written[2] is None and prof.stop() is None
    trace = tmp_path / "profile" / "step00001_rank0.pt.trace.json"
    assert written[1] == trace
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [trace.name, "step00001_rank0.txt"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert "aten::mm" in (tmp_path / "profile" / "step00001_rank0.txt").read_text()


def test_a_profile_left_open_is_closed_by_the_next_start(tmp_path: Path):
    prof = StepProfiler([0, 1], tmp_path, rank=0)
    prof.start(0)
    _work()
    prof.start(1)  # e.g. a `continue` skipped stop()
    assert (tmp_path / "profile" / "step00000_rank0.pt.trace.json").is_file() and prof.active
    prof.stop()
    assert (tmp_path / "profile" / "step00001_rank0.pt.trace.json").is_file() and not prof.active


def test_ranks_selection(tmp_path: Path):
    for rank, ranks, expected in ((1, [0], False), (1, None, True), (2, [0, 2], True)):
        prof = StepProfiler([0], tmp_path / f"r{rank}_{ranks}", rank=rank, ranks=ranks)
        prof.start(0)
        assert prof.active is expected
        prof.stop()


class _FakeNpuProfiler:
    """The slice of torch_npu.profiler that grpo.profiling uses; records how it was driven."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.ProfilerActivity = types.SimpleNamespace(CPU="CPU", NPU="NPU")
        self.ProfilerLevel = types.SimpleNamespace(Level1="Level1")
        self.AiCMetrics = types.SimpleNamespace(AiCoreNone="AiCoreNone")
        self.ExportType = types.SimpleNamespace(Text="Text")

    def _ExperimentalConfig(self, **kwargs):  # noqa: N802 -- torch_npu's name
        return ("experimental", kwargs)

    def tensorboard_trace_handler(self, dir_name=None, worker_name=None, analyse_flag=True, async_mode=False):
        return ("handler", dir_name, worker_name, analyse_flag, async_mode)

    def profile(self, **kwargs):
        calls = self.calls

        class Prof:
            def start(self):
                calls.append(("start", kwargs))

            def stop(self):
                calls.append(("stop",))
                Path(kwargs["on_trace_ready"][1]).mkdir(parents=True)  # what the real handler does

        return Prof()


def test_npu_ranks_use_torch_npu_profiler(tmp_path: Path, monkeypatch):
    fake = _FakeNpuProfiler()
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(profiler=fake))
    npu = types.SimpleNamespace(type="npu", index=0)  # torch.device("npu") needs torch_npu's registration
    prof = StepProfiler([2], tmp_path, "prof", rank=3, device=npu, ranks=None, record_shapes=True)
    prof.start(2)
    assert prof.stop() == tmp_path / "prof" / "step00002"
    (start, kwargs), (stop,) = fake.calls
    assert start == "start" and stop == "stop"
    assert kwargs["activities"] == ["CPU", "NPU"] and kwargs["record_shapes"] is True
    # raw data only: no synchronous parsing on this rank while the others wait in HCCL (analysed offline)
    assert kwargs["on_trace_ready"] == ("handler", str(tmp_path / "prof" / "step00002"), "rank3", False, False)
    assert kwargs["experimental_config"] == (
        "experimental", {"profiler_level": "Level1", "aic_metrics": "AiCoreNone", "export_type": "Text"})
    assert not list((tmp_path / "prof").glob("*.json"))  # no torch.profiler export on NPU


def test_config_switch():
    preset = ROOT / "recipes/configs/tiny/grpo_lora.yaml"
    cfg = load_config(preset, ["max_steps=4", "profile.steps=[2, 3]", "profile.ranks=null"])
    validate(cfg)
    assert cfg.profile.steps == [2, 3] and cfg.profile.ranks is None and cfg.profile.dir == "profile"
    assert load_config(preset).profile.steps == []  # off by default
    with pytest.raises(ConfigError, match=r"profile.steps: 4 is not a step of this run \(0..3\)"):
        validate(load_config(preset, ["max_steps=4", "profile.steps=[4]"]))


@pytest.mark.slow
@pytest.mark.skipif(not (TINY / "model_index.json").exists(), reason="assets/tiny-flux not built")
def test_recipe_writes_a_trace_of_the_chosen_step(tmp_path: Path):
    out = tmp_path / "run"
    proc = run_recipe(str(ROOT / "recipes/configs/tiny/grpo_lora.yaml"), [
        f"model.path={TINY}", f"output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "max_steps=1",
        "profile.steps=[0]", "batch.prompts_per_step=2", "sampling.group_size=2", "batch.micro_batch_size=2",
        "sampling.num_steps=3", "data.eval_prompts=null", "logging.tensorboard=false", "logging.sample_every=0"],
        nproc=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = sorted(p.name for p in (out / "profile").iterdir())
    assert files == ["step00000_rank0.pt.trace.json", "step00000_rank0.txt"]
    names = {e.get("name") for e in json.loads((out / "profile" / files[0]).read_text())["traceEvents"]}
    assert "aten::addmm" in names or "aten::mm" in names  # the step's transformer ran inside the trace
