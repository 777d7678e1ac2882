"""Rank-0 metric logging (metrics.jsonl, TensorBoard, optional wandb), the reward curve, image grids, progress bars.

Rows of metrics.jsonl: one per training step (`step` = the step index) and one per held-out eval (`step` = the
number of completed steps; only `eval/...` keys). On resume from a checkpoint after k completed steps, training rows
with step >= k and eval rows with step > k are dropped (they belong to the lost part of the run) and TensorBoard
purges the same range, so a resumed run's logs read as if it had never stopped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch

from grpo.errors import ConfigError

CURVE = "reward_curve.png"


def _is_eval_row(row: dict) -> bool:
    return all(k == "step" or k.startswith("eval/") for k in row)


def _kept(row: dict, resume_step: int) -> bool:
    return row["step"] <= resume_step if _is_eval_row(row) else row["step"] < resume_step


def _read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows. A last line cut short (a rank 0 killed while appending it) is dropped: its step is
    after the checkpoint being resumed, so it is logged again. A bad line before the last is not a torn write and
    still fails."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
    return rows


def check_wandb(enabled: bool) -> None:
    """Fail at start-up (ConfigError) when wandb logging is asked for but wandb is not installed."""
    if enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb: true but wandb is not installed; `pip install wandb`, or set it to false")


class MetricsLogger:
    """Appends one JSON object per step to metrics.jsonl, mirrors scalars to TensorBoard (and wandb), and redraws
    output_dir/reward_curve.png at the eval and sample cadence and on close (not every step: a draw costs more than
    a tiny step); no-op off rank 0.

    Args:
        output_dir: the run folder.
        enabled: True on rank 0.
        tensorboard: also write TensorBoard events under output_dir/tensorboard.
        resume_step: completed steps of the checkpoint the run resumes from (None: a fresh run).
        wandb: also log to Weights & Biases (project from WANDB_PROJECT, run name = output_dir's name).
        config: the resolved config, recorded by wandb.
        curve_every: the curve is redrawn after every eval row, on close, and after training step s when
            s % curve_every == 0; None = the config's logging.sample_every (the sample grids' cadence; 1 without a
            config), 0 = at evals and on close only.
    """

    def __init__(self, output_dir: str | Path, enabled: bool, tensorboard: bool = True, resume_step: int | None = None,
                 wandb: bool = False, config: dict | None = None, curve_every: int | None = None):
        self.enabled = enabled
        if curve_every is None:
            curve_every = int(((config or {}).get("logging") or {}).get("sample_every", 1) or 0)
        self.curve_every = curve_every
        self._curve_stale = False  # rows logged since the last draw
        self.out = Path(output_dir)
        self.path = self.out / "metrics.jsonl"
        self.writer = None
        self.wandb = None
        self.rows: list[dict] = []
        if not enabled:
            return
        if self.path.exists():
            rows = _read_rows(self.path)
            self.rows = [r for r in rows if resume_step is not None and _kept(r, resume_step)]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            tmp.replace(self.path)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out / "tensorboard"), purge_step=resume_step or 0)
            for row in self.rows:  # purge_step also dropped the eval at the resume step itself
                if _is_eval_row(row) and row["step"] == resume_step:
                    self._tensorboard(row)
        if wandb:
            import wandb as wb

            # One wandb run per output_dir, so a resumed run continues the same curves.
            run_id = "grpo-" + hashlib.sha256(str(self.out.resolve()).encode()).hexdigest()[:16]
            self.wandb = wb.init(name=self.out.name, dir=str(self.out), config=config, resume="allow", id=run_id)

    def has_eval(self, step: int) -> bool:
        """An eval row of `step` was logged (by this run or the run it resumes)."""
        return any(_is_eval_row(r) and r["step"] == step for r in self.rows)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self._tensorboard(row)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        self._curve_stale = True
        if _is_eval_row(row) or (self.curve_every and step % self.curve_every == 0):
            self.draw_curve()

    def draw_curve(self) -> None:
        """Redraw output_dir/reward_curve.png from every row so far (rank 0)."""
        if self.enabled:
            plot_reward_curve(self.rows, self.out / CURVE)
            self._curve_stale = False

    def _tensorboard(self, row: dict) -> None:
        if self.writer is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, row["step"])
            self.writer.flush()

    def close(self) -> None:
        """The last draw of the curve (when rows came since the one before), then closes TensorBoard and wandb."""
        if self._curve_stale:
            self.draw_curve()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def plot_reward_curve(rows: list[dict], path: str | Path) -> None:
    """Training reward (mean ± std band) per step and held-out eval reward, as one PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def finite(v) -> bool:
        return isinstance(v, (int, float)) and math.isfinite(v)

    train = [r for r in rows if finite(r.get("reward_mean"))]
    evals = [r for r in rows if finite(r.get("eval/reward_mean"))]
    if not train and not evals:
        return
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    if train:
        x = [r["step"] for r in train]
        y = [r["reward_mean"] for r in train]
        ax.plot(x, y, label="train reward (rollouts)", color="tab:blue")
        sd = [r.get("reward_std") if finite(r.get("reward_std")) else 0.0 for r in train]
        ax.fill_between(x, [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)], color="tab:blue",
                        alpha=0.15, linewidth=0)
    if evals:
        # An eval row's step counts completed steps: it scores the weights after step index step - 1.
        ax.plot([r["step"] - 0.5 for r in evals], [r["eval/reward_mean"] for r in evals], "o-", color="tab:orange",
                label="held-out reward (eta = 0)")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def progress(items: Iterable, desc: str, enabled: bool, total: int | None = None):
    """A tqdm bar over `items` on rank 0 (`enabled`), the plain iterable elsewhere."""
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, total=total, leave=False, dynamic_ncols=True)


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
