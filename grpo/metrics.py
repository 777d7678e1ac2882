"""Rank-0 metric logging (metrics.jsonl + TensorBoard) and image grids."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


class MetricsLogger:
    """Appends one JSON object per step to metrics.jsonl and mirrors scalars to TensorBoard; no-op off rank 0."""

    def __init__(self, output_dir: str | Path, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writer = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the fact visible as "nan"/"inf"
    return v


def save_grid(images: torch.Tensor, path: str | Path, nrow: int) -> None:
    """Images [B, 3, H, W] in [0, 1] -> one PNG grid."""
    from torchvision.utils import save_image

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_image(images.float().cpu(), str(path), nrow=nrow, padding=2)
