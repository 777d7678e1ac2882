"""Profiling chosen GRPO steps: torch.profiler on CPU and CUDA, torch_npu.profiler on Ascend NPU.

Switched on by the config (``profile.steps: [2, 3]``); the recipe calls :meth:`StepProfiler.start` at the top of a step
and :meth:`StepProfiler.stop` at its end, and nothing happens for the other steps or ranks. Traces go to
``output_dir/<profile.dir>/``:

* CPU / CUDA: ``step00002_rank0.pt.trace.json`` (Chrome trace: chrome://tracing, https://ui.perfetto.dev or
  TensorBoard's profiler plugin) and ``step00002_rank0.txt`` (the ops that took the most time).
* NPU: ``step00002/`` holding torch_npu's raw ``*_ascend_pt`` folder (Level1: CPU and NPU activities, AI Core
  metrics off). It is not parsed during the run: torch_npu's trace handler parses synchronously on the profiling rank
  by default (``analyse_flag=True``), which on a FLUX.1-dev step takes minutes while the other ranks wait in an HCCL
  collective and can outlast its timeout. Parse it afterwards, on any machine with torch_npu (no NPU needed)::

      python -c "from torch_npu.profiler.profiler import analyse; analyse(profiler_path='OUTPUT_DIR/profile/step00002')"

  which writes each ``*_ascend_pt/ASCEND_PROFILER_OUTPUT/`` (``trace_view.json``, ``kernel_details.csv``,
  ``op_statistic.csv``); open those, or the ``*_ascend_pt`` folder itself, with MindStudio Insight.

Profiling costs time, so profile a few steps after the first (warm-up) one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


class PhaseClock:
    """Wall time of the named parts of a step; `outer(name)`, when given, is entered around each part as well (the
    tools' recording windows)."""

    def __init__(self, outer: Callable[[str], contextlib.AbstractContextManager] | None = None):
        self.outer = outer
        self.seconds: dict[str, float] = {}
        self._first: float | None = None
        self._last = 0.0

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self._first = start if self._first is None else self._first
        with self.outer(name) if self.outer is not None else contextlib.nullcontext():
            yield
        self._last = time.perf_counter()
        self.seconds[name] = self._last - start

    @property
    def total(self) -> float:
        """From the start of the first part to the end of the last."""
        return self._last - self._first


class StepProfiler:
    """Wraps the chosen steps of one rank in the device's profiler.

    Args:
        steps: GRPO step indices to profile; empty = never.
        output_dir: The run's output directory.
        subdir: Folder under ``output_dir`` for the traces.
        rank: This process's global rank.
        device: This rank's device; its type picks the profiler (``npu``: torch_npu.profiler).
        ranks: Ranks that profile; None = every rank.
        record_shapes: Record op input shapes.
        profile_memory: Record allocations.
        with_stack: Record Python call stacks (large traces).
    """

    def __init__(self, steps: list[int], output_dir: str | Path, subdir: str = "profile", rank: int = 0,
                 device: torch.device | None = None, ranks: list[int] | None = None, record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False):
        self.steps = set(steps) if ranks is None or rank in ranks else set()
        self.dir = Path(output_dir) / subdir
        self.rank = rank
        self.device = device if device is not None else torch.device("cpu")
        self.options = {"record_shapes": record_shapes, "profile_memory": profile_memory, "with_stack": with_stack}
        self._prof: Any = None
        self._step: int | None = None

    @classmethod
    def from_config(cls, cfg: Any, output_dir: str | Path, rank: int, device: torch.device) -> StepProfiler:
        """From the recipe config's ``profile`` section (grpo.settings.ProfileConfig)."""
        p = cfg.profile
        return cls(list(p.steps), output_dir, p.dir, rank, device, p.ranks, p.record_shapes, p.profile_memory,
                   p.with_stack)

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, step: int) -> None:
        """Starts profiling when ``step`` is one of the chosen steps (ends a profile left open first)."""
        self.stop()
        if step not in self.steps:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._step = step
        self._prof = self._npu_profiler(step) if self.device.type == "npu" else self._torch_profiler()
        self._prof.start()

    def stop(self) -> Path | None:
        """Ends the open profile, if any, and writes its trace.

        Returns:
            The trace file (CPU/CUDA) or folder (NPU), or None when nothing was being profiled.
        """
        if self._prof is None:
            return None
        prof, step, self._prof = self._prof, self._step, None
        prof.stop()  # torch_npu: runs on_trace_ready, which writes the raw trace (parsed offline, see above)
        name = f"step{step:05d}_rank{self.rank}"
        if self.device.type == "npu":
            path = self.dir / f"step{step:05d}"
        else:
            path = self.dir / f"{name}.pt.trace.json"
            prof.export_chrome_trace(str(path))
            sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            (self.dir / f"{name}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
        logger.info("profile of step %d (rank %d) written to %s", step, self.rank, path)
        return path

    def _torch_profiler(self) -> Any:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(activities=activities, **self.options)

    def _npu_profiler(self, step: int) -> Any:
        import torch_npu  # only reached on an NPU rank, where grpo.device has imported it already

        npu_prof = torch_npu.profiler
        experimental: dict[str, Any] = {"profiler_level": npu_prof.ProfilerLevel.Level1,
                                        "aic_metrics": npu_prof.AiCMetrics.AiCoreNone}
        if hasattr(npu_prof, "ExportType"):  # torch_npu >= 2.1.0.post: text (csv/json) rather than a database
            experimental["export_type"] = npu_prof.ExportType.Text
        return npu_prof.profile(
            activities=[npu_prof.ProfilerActivity.CPU, npu_prof.ProfilerActivity.NPU],
            # analyse_flag=False: write the raw data only; parsing here would hold this rank for minutes while the
            # others wait in HCCL (module docstring: the offline command).
            on_trace_ready=npu_prof.tensorboard_trace_handler(str(self.dir / f"step{step:05d}"),
                                                              worker_name=f"rank{self.rank}", analyse_flag=False),
            experimental_config=npu_prof._ExperimentalConfig(**experimental),
            **self.options,
        )
