"""Model FLOPs utilisation per phase of a step: how close a run comes to its device (issue 56 item 4).

    perf/tflops/rollout, perf/tflops/update   model TFLOP/s achieved per device in the phase
    perf/mfu/rollout, perf/mfu/update         the same over the device's peak (only where the peak is known)

Model FLOPs of a phase = FLOPs of one transformer forward of one image at the run's shapes x the phase's
forward-equivalents per image (grpo/rollout_plan.py: RolloutPlan.phase_forwards, with true CFG's two calls per guided
velocity, the reference's and the lagging policy's no-grad forwards, the extra update blocks) x the step's images.
The forward is counted once at start-up by torch's own counter (torch.utils.flop_counter.FlopCounterMode: the
matmuls and attention the transformer dispatches) on a copy built from its config.json on the meta device: no
weights, no memory (under a second for the tiny worlds, about 8 s of dispatch for FLUX.1-dev on a 2-core CPU); it
works for every family in grpo/models/ (FLUX.1, Kontext, FLUX.2, FLUX.3;
tests/unit/test_perf.py checks it against a closed form on the tiny FLUX.1). Conventions, as PaLM's MFU (Chowdhery et
al. 2022, appendix B) and verl's:
  - a backward counts two forwards (RolloutPlan: a trained point is 3); LoRA's frozen weights get no weight gradient,
    so a LoRA run does about a third less than that in its backward: its update MFU is on the full model's scale
    (comparable between LoRA and full runs), not its hardware work. The adapters' own matmuls are not counted (a few
    per cent of the adapted layers' at rank 64).
  - gradient checkpointing's recomputed forward is hardware work, not model FLOPs: not counted, so turning it on
    lowers the MFU by what it costs.
  - the phases' wall time is the recipe's clock: the rollout includes the candidates' preview and the VAE decode, the
    update the fixed targets' forwards and the optimizer step, so the MFU is of the whole phase.
MFU = achieved FLOP/s of all ranks / world size / the device's peak, as verl-omni's perf/mfu/actor
(verl-project/verl-omni@a1139baf, verl_omni/workers/engine_workers.py: estimated_flops / promised_flops /
mfu_divisor, the data-parallel world size).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from grpo.models.base import ModelFamily

log = logging.getLogger(__name__)

# Dense (no 2:4 sparsity) bf16/fp16 tensor peak per device in TFLOP/s, matched as a case-insensitive substring of the
# device name the run records (grpo.manifest.device_name: torch's get_device_name), the first match winning (the
# specific names first). Vendor datasheets give the sparse figure with "1/2 lower without sparsity".
PEAK_TFLOPS: tuple[tuple[str, float, str], ...] = (
    # NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 (SXM), 1,513 (PCIe), 1,671 (NVL) TFLOPS with sparsity;
    # dense SXM 989.4 from the Hopper whitepaper's table (1,978.9 / 2).
    ("H100 PCIe", 756.5, "NVIDIA H100 datasheet: 1,513 TFLOPS bf16 with sparsity, PCIe"),
    ("H100 NVL", 835.5, "NVIDIA H100 datasheet: 1,671 TFLOPS bf16 with sparsity, NVL"),
    ("H100", 989.4, "NVIDIA H100 datasheet / Hopper whitepaper: 1,978.9 TFLOPS bf16 with sparsity, SXM"),
    # NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 (SXM) and 1,671 (NVL) TFLOPS with sparsity.
    ("H200 NVL", 835.5, "NVIDIA H200 datasheet: 1,671 TFLOPS bf16 with sparsity, NVL"),
    ("H200", 989.4, "NVIDIA H200 datasheet: 1,979 TFLOPS bf16 with sparsity, SXM"),
    # NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 312 TFLOPS dense, every form.
    ("A100", 312.0, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense"),
    # NVIDIA publishes no datasheet for the H20 (a China-only part); 148 TFLOPS bf16 dense is the figure its OEM
    # sheets and verl's table (verl/utils/flops_counter.py) use.
    ("H20", 148.0, "OEM sheets and verl's table: 148 TFLOPS bf16 dense (no public NVIDIA datasheet)"),
    # Huawei publishes no per-variant TFLOP/s; CANN's platform config of the part (Ascend910B2C.ini: ai_core_cnt=24,
    # cube_freq=1800 MHz, a 16x16x16 cube) gives 24 x 1.8e9 x 16^3 x 2 = 353.9 TFLOP/s fp16/bf16, verl's "910B" 354.
    # The other 910B variants (B1, B2, B3, B4) have their own core counts and clocks, whose platform configs were not
    # at hand: not listed, rather than guessed (set perf.peak_tflops; verl's table gives every 910B 354).
    ("Ascend910B2C", 353.9, "CANN platform config Ascend910B2C.ini: 24 cube cores x 1.8 GHz x 16^3 x 2"),
)


def peak_tflops(device_name: str, override: float | None = None) -> tuple[float | None, str]:
    """The device's peak dense TFLOP/s and where it comes from; (None, why) when unknown (a CPU, a device not in
    :data:`PEAK_TFLOPS`): MFU is then not logged. `override`: perf.peak_tflops, which wins."""
    if override is not None:
        return override, "perf.peak_tflops"
    for key, tflops, source in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops, source
    return None, (f"no peak known for {device_name!r} (a CPU's, or a device not in grpo/perf.py's table); set "
                  "perf.peak_tflops to the device's dense TFLOP/s in the trained precision to log perf/mfu/*")


def forward_flops(family: ModelFamily, transformer: str | Path | torch.nn.Module, image_tokens: int,
                  text_tokens: int) -> int:
    """Model FLOPs of one transformer forward of one image: `image_tokens` noisy (+ reference) tokens and
    `text_tokens` prompt tokens, counted by FlopCounterMode on the meta-device transformer (the count is linear in
    the batch, so one image is the unit). `transformer`: a model folder (its transformer/config.json), or a
    transformer already built on the meta device (tools.plan's, from a config alone)."""
    model = transformer if isinstance(transformer, torch.nn.Module) else family.meta_transformer(str(transformer))
    dtype = next(model.parameters()).dtype
    inputs = family.example_inputs(dict(model.config), 1, image_tokens, text_tokens, dtype)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    return counter.get_total_flops()


@dataclass(frozen=True)
class Throughput:
    """What turns a step's phase times into perf/* metrics.

    Attributes:
        forward_flops: one transformer forward of one image (:func:`forward_flops`).
        peak_tflops: the device's peak (:func:`peak_tflops`), or None: no MFU.
        world_size: processes, one device each.
    """

    forward_flops: int
    peak_tflops: float | None
    world_size: int

    def metrics(self, forwards: dict[str, float], images: int, seconds: dict[str, float]) -> dict[str, float]:
        """perf/tflops/<phase> (and perf/mfu/<phase>) from the phases' forward-equivalents per image
        (RolloutPlan.phase_forwards), the step's images over all ranks and each phase's wall seconds."""
        out = {}
        for phase, per_image in forwards.items():
            tflops = per_image * self.forward_flops * images / seconds[phase] / self.world_size / 1e12
            out[f"perf/tflops/{phase}"] = tflops
            if self.peak_tflops is not None:
                out[f"perf/mfu/{phase}"] = tflops / self.peak_tflops
        return out

    def describe(self, source: str) -> str:
        """The start-up line: the forward's FLOPs and the peak, or why MFU is not logged."""
        head = f"model FLOPs: {self.forward_flops / 1e12:.4g} TFLOP per transformer forward and image"
        if self.peak_tflops is None:
            return f"{head}; perf/tflops/* logged, perf/mfu/* not: {source}"
        return f"{head}; device peak {self.peak_tflops:g} TFLOP/s ({source}): perf/mfu/* logged"
