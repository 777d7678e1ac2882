"""Run health: the per-step health line, skipped-update accounting, graceful stop on SIGTERM/SIGINT.

Non-finite values. A non-finite reward poisons every advantage of its step, so the recipe skips that step's update.
A non-finite loss or gradient is caught by DeepSpeed itself: ZeRO-3 computes the global gradient norm (all-reduced,
so every rank sees the same value) before each optimizer step and, when it is not finite, zeroes the gradients and
skips the step without advancing the LR scheduler (``engine.skipped_steps`` counts them; deepspeed>=0.19 does this
for fp32 and bf16 too, not only for fp16 loss scaling). The recipe counts non-finite losses on every rank, turns each
one into a non-finite gradient (a NaN that entered the loss as a constant would leave the gradient finite and the
step would be applied on the other ranks' data), all-reduces the count, and checks that DeepSpeed did skip. After
`faults.max_consecutive_skips` skipped steps in a row the run saves a checkpoint and stops with :class:`TooManySkips`
(exit code 3): something upstream is broken.

Preemption. SIGTERM or SIGINT only sets a flag; at the end of the step the ranks agree (all-reduce) to stop, save a
checkpoint and exit 0, and ``checkpoint.resume=auto`` continues the run exactly. launch/run.sh and launch/multinode.sh
--torchrun pass the signal on to the workers (tools/torchrun.py); under a plain torchrun send it to the worker
processes: torchrun itself reacts to SIGTERM by terminating its workers after a 30 s grace period.

Held-out collapse. The recipe keeps the best held-out eval (grpo/best.py) and logs :func:`collapse_line` at an eval
that falls below it by more than ``logging.collapse_alarm.sigmas`` paired standard errors; with ``stop: true`` the run
saves a checkpoint and ends there, exit 0 (grpo/run_control.py).

The fault tests inject NaN rewards and losses from their side (tests/recipe/faulty_recipe.py: the recipe, with its
rewards or losses poisoned where a real fault would enter).
"""

from __future__ import annotations

import logging
import math
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from grpo.errors import COLLECTIVE_FAILED

log = logging.getLogger(__name__)

EXIT_TOO_MANY_SKIPS = 3


class TooManySkips(RuntimeError):
    """Raised after `faults.max_consecutive_skips` skipped updates in a row (a checkpoint has been saved)."""


@dataclass
class SkipCounter:
    """Counts GRPO steps whose update was (at least partly) skipped; tells when too many came in a row."""

    limit: int
    consecutive: int = 0
    total: int = 0

    def record(self, skipped: bool) -> bool:
        """Record one step; True when `limit` skipped steps in a row have been reached."""
        self.consecutive = self.consecutive + 1 if skipped else 0
        self.total += int(skipped)
        return self.consecutive >= self.limit


@dataclass
class StopSignal:
    """Turns SIGTERM/SIGINT into a request to stop after the current step (a second SIGINT interrupts at once)."""

    received: int | None = None
    _previous: dict = field(default_factory=dict)

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        log.warning("received %s: finishing the current step, then saving and stopping",
                    signal.Signals(signum).name)

    def agreed(self, device: torch.device) -> bool:
        """Collective: True on every rank when any rank received a stop signal."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


_COMM_FAILURES = ("Timed out", "timed out", "Connection closed", "Connection reset", "Broken pipe", "NCCL", "HCCL")


def comm_failure(err: BaseException, timeout_s: float) -> str | None:
    """A one-line diagnosis when `err` looks like a collective that failed because a rank died or hung."""
    text = str(err)
    if isinstance(err, RuntimeError) and any(k in text for k in _COMM_FAILURES):
        first = " ".join(text.split())[:160]
        return (f"{COLLECTIVE_FAILED} ({first}): another rank died or stopped responding (faults.comm_timeout_s="
                f"{timeout_s:g}); rerun with checkpoint.resume=auto, which continues from the last complete "
                "checkpoint")
    return None


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and (not math.isfinite(v) or v == 0 or 1e-3 <= abs(v) < 1e4):
        return f"{v:.4g}"
    return f"{v:.2e}" if isinstance(v, float) else str(v)


# ratio_max_dev above this fraction of clip_range means the first pass does not reproduce the rollout: the "ratio = 1"
# promise is off, and with a small clip_range (1e-4) about half of the samples would be clipped.
RATIO_DEV_WARN_FRACTION = 0.1


def _worst_timestep(stats: dict[str, float]) -> str:
    """" at transition j (mean |ratio - 1| m there)" for the transition with the largest ratio_dev/tJJ_max."""
    worst = max(((v, k) for k, v in stats.items() if k.startswith("ratio_dev/") and k.endswith("_max")), default=None)
    if worst is None:
        return ""
    j = worst[1][len("ratio_dev/t"):-len("_max")]
    return f" at transition {int(j)} (mean {_fmt(stats.get(f'ratio_dev/t{j}_mean'))} there)"


def health_line(step: int, stats: dict[str, float], clip_range: float | None = None) -> str:
    """One line per step with what tells a healthy GRPO run from a sick one; with ``clip_range`` it ends with a
    warning when ``ratio_max_dev`` exceeds :data:`RATIO_DEV_WARN_FRACTION` of it (non-deterministic kernels)."""
    nonfinite_reward = sum(v for k, v in stats.items() if k.startswith("nonfinite/") and k not in
                           ("nonfinite/loss", "nonfinite/grad"))
    parts = [
        f"step {step}",
        f"reward {_fmt(stats.get('reward_mean'))}",
        f"loss {_fmt(stats.get('loss'))}",
        f"ratio_max_dev {_fmt(stats.get('ratio_max_dev'))}",
        f"clip_frac {_fmt(stats.get('clip_frac'))}",
        f"grad_norm {_fmt(stats.get('grad_norm'))}",
        f"kl {_fmt(stats.get('kl'))}",
        f"nonfinite reward/loss/grad {int(nonfinite_reward)}/{int(stats.get('nonfinite/loss', 0))}/"
        f"{int(stats.get('nonfinite/grad', 0))}",
        f"skipped {int(stats.get('skipped_updates', 0))}",
        f"{_fmt(stats.get('step_time_s'))}s",
    ]
    dev = stats.get("ratio_max_dev")
    if clip_range is not None and dev is not None and dev > RATIO_DEV_WARN_FRACTION * clip_range:
        parts.append(f"WARNING ratio_max_dev {_fmt(dev)}{_worst_timestep(stats)} exceeds "
                     f"{RATIO_DEV_WARN_FRACTION:.0%} of clip_range {_fmt(clip_range)}: the first pass does not "
                     "reproduce the rollout (model.deterministic)")
    return " | ".join(parts)


def collapse_line(step: int, mean: float, best_step: int, best_mean: float, drop_sigmas: float, sigmas: float,
                  stop: bool) -> str:
    """The collapse alarm's health line (grpo/best.py): the eval of `step` is `drop_sigmas` paired standard errors
    below the best eval (of `best_step`), more than `sigmas` (logging.collapse_alarm)."""
    then = ("stopping here: a checkpoint is saved, best/ holds the best eval's weights (logging.collapse_alarm.stop)"
            if stop else "best/ holds the best eval's weights; logging.collapse_alarm.stop=true ends a run here")
    return (f"WARNING held-out collapse: the eval at step {step} ({_fmt(mean)}) is {_fmt(drop_sigmas)} paired "
            f"standard errors below the best, the eval at step {best_step} ({_fmt(best_mean)}), more than "
            f"logging.collapse_alarm.sigmas {_fmt(float(sigmas))}; {then}")
