"""Run control: how a recipe's run starts, stops and ends around its steps, apart from the algorithm.

    exit codes   :func:`main` builds, sets up and trains a recipe and maps how it ended to the process's exit code:
                 0 done (or stopped by SIGTERM/SIGINT or the collapse alarm after saving), 2 bad input (ConfigError:
                 one line, nothing written), 3 too many skipped updates in a row (health.TooManySkips: a checkpoint
                 was saved), 75 a dependency is down (grpo.errors.DependencyDown) or a peer was lost, 1 anything else
                 (an OutsideFailure such as a full disk: one line, the traceback in output_dir/logs/)
    stop signals SIGTERM/SIGINT set a flag (grpo.health.StopSignal); the ranks agree after a step, save and return
    evals        the held-out eval is due every logging.eval_every steps and after the last; one the run this one
                 resumes owed (it stopped before it) runs first; the collapse alarm with logging.collapse_alarm.stop
                 ends the run at its eval, checkpointed, exit 0 (grpo/best.py)
    checkpoints  every checkpoint.every steps, on a stop signal or the collapse alarm's stop, before exit 3, and when
                 a dependency is down (the state of the completed steps, so that checkpoint.resume=auto continues
                 exactly once it is back)

A recipe (recipes/flux_grpo.py, or a copy of it) makes a :class:`RunControl` once it is set up and calls it from its
training loop; its `main()` hands :func:`main` a function that builds the recipe.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grpo import health, rng
from grpo.distributed import leave
from grpo.errors import ConfigError, DependencyDown, OutsideFailure, outside_exit, peer_lost_exit, rank_exit

log = logging.getLogger(__name__)


class RunControl:
    """Around one recipe's steps: the stop signal, when evals and checkpoints are due, saving when a dependency is
    down, and the too-many-skips stop. Collective methods: call on every rank.

    Args:
        cfg: the run's RecipeConfig.
        device, rank, world: this process's device, rank and the world size.
        checkpoints: the run's grpo.checkpoint.Checkpointer.
        metrics: the run's grpo.metrics.MetricsLogger (which evals it holds; closed when the run stops).
        skips: the run's grpo.health.SkipCounter.
        save: collective, `save(steps_done)` writes the checkpoint of that many completed steps.
        evaluate: collective, `evaluate(step)` runs the held-out eval of `step` completed steps; it returns why the
            run stops there (the collapse alarm's line, with logging.collapse_alarm.stop), else None.
    """

    def __init__(self, cfg, device: torch.device, rank: int, world: int, checkpoints, metrics,
                 skips: health.SkipCounter, save: Callable[[int], None], evaluate: Callable[[int], Any]):
        self.cfg, self.device, self.rank, self.world = cfg, device, rank, world
        self.checkpoints, self.metrics, self.skips = checkpoints, metrics, skips
        self.save, self.evaluate = save, evaluate
        self.out = Path(cfg.output_dir)
        self.stop = health.StopSignal()
        self.halt: str | None = None  # why an eval stopped the run (the collapse alarm), once one did

    # ------------------------------------------------------------------------------------------- the loop
    def start(self, step: int) -> bool:
        """Collective, before the first step of this start (`step` completed): the held-out eval at step 0, or one
        the run this one resumes owed. True when that eval stops the run (checkpointed)."""
        if step == 0 or self.eval_owed(step):
            self.halt = self.evaluate(step)
        if self.halt is not None and not self.checkpoints.has(step):
            self.save(step)
        return self.halt is not None

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT ask the run to stop after the current step while the block runs."""
        self.stop.install()
        try:
            yield
        finally:
            self.stop.uninstall()

    def stopped_before(self, step: int) -> bool:
        """Collective, before step `step` (not the first of this start): True when a stop signal arrived during the
        last eval or save; the state of `step` completed steps is then checkpointed."""
        if not self.stop.agreed(self.device):
            return False
        if not self.checkpoints.due(step):
            self.save(step)
        return True

    def after_step(self, done: int, too_many_skips: bool) -> bool:
        """Collective: held-out eval and checkpoint when due; True when a stop signal arrived or the eval stops the
        run (the checkpoint is then written). Raises health.TooManySkips, after its checkpoint, when
        `too_many_skips`."""
        stopping = self.stop.agreed(self.device)  # collective: every rank stops after the same step
        if not stopping and self.eval_due(done):
            with self.saved_if_a_dependency_is_down(steps_done=done):
                self.halt = self.evaluate(done)
        stopping = stopping or (self.halt is not None and done < self.cfg.max_steps)  # at the last: it ends anyway
        if self.checkpoints.due(done) or stopping or too_many_skips:
            self.save(done)
        if too_many_skips:
            raise health.TooManySkips(
                f"faults.max_consecutive_skips: {self.skips.consecutive} steps in a row skipped their update "
                f"(non-finite reward, loss or gradient: see nonfinite/* in {self.out / 'metrics.jsonl'}); "
                "a checkpoint was saved; fix the cause, then rerun with checkpoint.resume=auto"
            )
        return stopping

    def stopped(self, done: int) -> None:
        """The run stops on a signal or at the collapse alarm after `done` steps (its checkpoint written)."""
        if self.rank == 0 and self.halt is not None:
            log.info("stopped after %d steps by the collapse alarm (logging.collapse_alarm.stop); to train on "
                     "anyway: checkpoint.resume=auto", done)
        elif self.rank == 0:
            log.info("stopped by signal after %d steps; resume with checkpoint.resume=auto", done)
        self.metrics.close()

    # ---------------------------------------------------------------------------------------------- evals
    def eval_due(self, done: int) -> bool:
        every = self.cfg.logging.eval_every
        return done == self.cfg.max_steps or bool(every and done % every == 0)

    def eval_owed(self, step: int) -> bool:
        """Collective: the eval of `step` is due but not in metrics.jsonl (rank 0's rows): the run this one resumes
        stopped before it, on a signal or on a dependency that failed it."""
        owed = [self.eval_due(step) and not self.metrics.has_eval(step)]
        if self.world > 1:
            dist.broadcast_object_list(owed, src=0)
        return owed[0]

    # ------------------------------------------------------------------------------------- dependencies
    @contextlib.contextmanager
    def saved_if_a_dependency_is_down(self, steps_done: int) -> Iterator[None]:
        """Around a part of the run a dependency can fail (a reward server: a step's scoring, the held-out eval's).
        Every rank raises its DependencyDown together (agreed_outside_failure); before the run ends with exit 75 the
        state of `steps_done` completed steps is checkpointed, unless it is already, so that checkpoint.resume=auto
        continues exactly once the dependency is back, however old the last periodic checkpoint. Inside a step that
        is the state at the step's start: the failure comes before the update, and the RNG is put back as it was."""
        start = rng.snapshot()
        try:
            yield
        except DependencyDown as down:
            if down.agreed and not self.checkpoints.has(steps_done):
                rng.set_rng_state(*start, rng.device_rng()[1])
                try:
                    self.save(steps_done)
                except OutsideFailure as e:  # the disk: the dependency's line stays the one to act on
                    log.warning("no checkpoint after %d steps: %s", steps_done, e)
                    down.agreed = e.agreed
            raise


def ending() -> None:
    """The run ends on every rank, each at its own pace: the first to exit makes torchrun stop the others with
    SIGTERM, which must not cut their report short (rank 0's line, the error file the launcher reads)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def main(build: Callable[[], Any]) -> int:
    """Builds (`build()`), sets up and trains a recipe; returns the process's exit code (the module doc's table).

    Every rank finds a bad setting or a skip streak alike; rank 0 alone prints the line, the others exit quietly
    with the same code, which the launchers pass on (tools/torchrun.py). The recipe provides setup(), train(), and
    cfg, out, rank and lock (grpo.lock's, or None) once built."""
    try:
        recipe = build()
        recipe.setup()
    except ConfigError as e:
        code = rank_exit(f"error: {e}", 2)
    except OutsideFailure as e:  # rank 0 alone: the disk under a universal conversion (grpo/checkpoint/)
        ending()
        return outside_exit(e, recipe.out, recipe.rank)  # its peers wait on the file system; torchrun stops them
    else:
        try:
            recipe.train()
            code = 0
        except health.TooManySkips as e:
            ending()
            code = rank_exit(f"error: {e}", health.EXIT_TOO_MANY_SKIPS)
        except OutsideFailure as e:  # a server, the disk: one line, its code, the traceback in output_dir/logs/
            ending()
            code = outside_exit(e, recipe.out, recipe.rank)
            if not e.agreed:  # met by this rank alone, e.g. the disk inside DeepSpeed's save
                return code
        except RuntimeError as e:  # a dead rank surfaces here (gloo: at once; NCCL/HCCL: after faults.comm_timeout_s)
            hint = health.comm_failure(e, recipe.cfg.faults.comm_timeout_s)
            if not hint:
                raise
            # the launcher names the lost rank in the run's one error line; this rank exits 75 without a traceback
            peer_lost_exit(e, hint, recipe.out, recipe.rank, recipe.lock.release if recipe.lock else lambda: None)
    leave()
    return code
