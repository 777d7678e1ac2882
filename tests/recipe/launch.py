"""The launch helper of the recipe tier: run the recipe (or a driver) under torchrun, to the end or in the background,
read its metrics rows and trained weights, signal its workers, kill what is left.

    proc = run_recipe(config, overrides, nproc=2)                   # to the end: a CompletedProcess
    run = Run.start(torchrun(config, overrides), tmp / "a.log")    # in the background: wait, signal, kill_all
    rows = train_rows(output_dir); weights = trained_weights(checkpoint, "model")

torchrun starts its workers in their own sessions, so killing torchrun's process group does not reach them; these
helpers find the workers through psutil and signal them explicitly. Command lines and the environment come from
tools.launch.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests import ROOT, TINY
from tools.launch import launch_env, torchrun_cmd

# Minimal tiny-run settings shared by the checkpoint/fault/export tests (8 images per step on 2 processes, one
# micro-batch per rank, one trained transition per trajectory: the fault tests count non-finite losses per backward).
SMALL = [
    "batch.prompts_per_step=2", "sampling.group_size=4", "batch.micro_batch_size=4", "sampling.num_steps=4",
    "grpo.timestep_fraction=0.5",
    "sampling.shift=dynamic", "deepspeed.config=ds_configs/zero3_fp32.json", "logging.progress=false",
]


def tiny_run(tmp: Path) -> list[str]:
    """SMALL settings on a private copy of the tiny model: a rebuild of assets/tiny-flux while a chain of runs is in
    flight (the model is rebuilt by its own tooling) must not change the base weights under a resumed run."""
    model = tmp / "tiny-flux"
    if not model.exists():
        shutil.copytree(TINY, model)
    return [f"model.path={model}", *SMALL]


def torchrun(config: str, overrides: list[str], *, nproc: int = 2, nnodes: int = 1, node_rank: int = 0,
             port: int | None = None, script: list[str] | None = None) -> list[str]:
    """The torchrun command line of the recipe (or of `script`, e.g. a driver) on CONFIG with `overrides`."""
    return torchrun_cmd(nproc, [*(script or [str(ROOT / "recipes" / "flux_grpo.py")]), "--config", str(ROOT / config),
                                *for_objective(config, overrides)], nnodes=nnodes, node_rank=node_rank, port=port)


def for_objective(config: str, overrides: list[str]) -> list[str]:
    """`overrides` without those of another objective's section: SMALL sets grpo.timestep_fraction, which an nft or
    awm preset has no section for (the recipe would refuse it)."""
    from grpo.objectives import OBJECTIVES
    from grpo.schema import read_preset

    algorithm = read_preset(ROOT / config).get("algorithm")
    others = {name for name in OBJECTIVES if name != algorithm}
    return [o for o in overrides if o.split(".", 1)[0] not in others]


def run_recipe(config: str, overrides: list[str], nproc: int, timeout: int = 600, extra_env: dict | None = None,
               script: list[str] | None = None) -> subprocess.CompletedProcess:
    """Runs the recipe (or `script`) with torchrun on the CPU accelerator to the end; returns the finished process."""
    return subprocess.run(torchrun(config, overrides, nproc=nproc, script=script), env=launch_env(extra_env),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def script_env(extra: dict | None = None) -> dict:
    """The environment for launch/*.sh and plain recipe processes: this one without a surrounding job's rank and
    launcher variables (the scripts start their own job), one thread per process, the repository importable, no model
    hub; DS_ACCELERATOR as it is here (the scripts pick the device when it is unset). tools.launch.launch_env."""
    return launch_env(extra, accelerator=None, job=False, unbuffered=False)


def run_script(script: str, args: list[str], *, extra_env: dict | None = None,
               timeout: int = 900) -> subprocess.CompletedProcess:
    """``bash launch/<script> ARGS`` (run.sh, multinode.sh) from the repository root, to the end."""
    return subprocess.run(["bash", str(ROOT / "launch" / script), *args], env=script_env(extra_env), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def run_plain(config: str, overrides: list[str], *, extra_env: dict | None = None,
              timeout: int = 300) -> subprocess.CompletedProcess:
    """``python recipes/flux_grpo.py --config CONFIG OVERRIDES`` as one process (no launcher) on the CPU accelerator."""
    return subprocess.run([sys.executable, str(ROOT / "recipes" / "flux_grpo.py"), "--config", str(ROOT / config),
                           *overrides], env=script_env({"DS_ACCELERATOR": "cpu", **(extra_env or {})}), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@dataclass
class Run:
    """A background launcher process whose output goes to `log`."""

    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, cmd: list[str], log: Path, extra_env: dict | None = None) -> "Run":
        f = open(log, "w")
        proc = subprocess.Popen(cmd, env=launch_env(extra_env), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        f.close()
        return cls(proc, log)

    def workers(self) -> list[psutil.Process]:
        found = []
        for p in self._tree()[1:]:
            try:
                if "flux_grpo.py" in " ".join(p.cmdline()):
                    found.append(p)
            except psutil.NoSuchProcess:  # zombies included (e.g. launch scripts' finished helpers)
                pass
        return found

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_workers(self, sig: int) -> None:
        for p in self.workers():
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def kill_all(self) -> None:
        """SIGKILL the launcher and every process below it (a node or a whole run dying at once)."""
        for p in self._tree():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"run did not finish within {timeout}s; log tail:\n{self.tail()}") from None

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def train_rows(out: Path) -> list[dict]:
    """The training rows of a run's metrics.jsonl (no eval rows)."""
    return [r for r in metrics_rows(out) if "reward_mean" in r]


def metrics_rows(out: Path) -> list[dict]:
    """Every complete row of a run's metrics.jsonl so far."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return rows


HEALTH = re.compile(r"flux_grpo step (\d+) \|")


def steps_logged(run: Run) -> list[int]:
    """Steps whose health line this run (its rank 0) has logged so far."""
    return [int(m.group(1)) for m in HEALTH.finditer(run.log.read_text(errors="replace"))]


def wait_for_step(run: Run, step: int, timeout: float = 400) -> None:
    """Block until the run has logged the health line of `step` (fails if it ends or times out first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s >= step for s in steps_logged(run)):
            return
        if run.proc.poll() is not None:
            raise AssertionError(f"run exited with {run.proc.returncode} before step {step}:\n{run.tail()}")
        time.sleep(0.05)
    run.kill_all()
    raise AssertionError(f"step {step} not reached within {timeout}s:\n{run.tail()}")


def trained_weights(checkpoint: Path, which: str) -> dict:
    from grpo.export import trained_weights as tw

    return tw(checkpoint, which)[0]


def assert_two_steps_agree(one: dict, two: dict) -> None:
    """Two steps of a run on 1 and on 2 processes ({"dir": output_dir, "rows": its training rows}) agree. Step 0 to
    float rounding, as tests/recipe/test_recipe_distributed.py's one step; step 1 starts from weights that Adam's first
    step left a rounding apart (about lr x sign(g) on elements whose gradient is ~0), so its reward and gradient agree
    to 1e-4 and its loss is not compared: at ratio 1 a grpo loss is minus the mean of zero-mean advantages, a
    rounding-level number (measured on tiny FLUX.2: 9.5e-5 against -7.5e-5 with RatioNorm)."""
    a, b = one["rows"], two["rows"]
    assert len(a) == len(b) == 2
    for key in ("reward_mean", "loss", "grad_norm"):
        assert b[0][key] == pytest.approx(a[0][key], rel=1e-5, abs=1e-9), (0, key)
    for key in ("reward_mean", "grad_norm"):
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-4), (1, key)
    w1, w2 = (trained_weights(run["dir"] / "checkpoints" / "step_00000002", "model") for run in (one, two))
    assert all((w2[k] - w1[k]).norm() <= 1e-3 * w1[k].norm() for k in w1)


def two_one_resumed(run: Callable[[str, str, int, list[str]], dict], config: str, extra: list[str],
                    two: dict | None = None) -> dict:
    """The runs that the 1-vs-2 and resume checks compare, by `run(name, config, nproc, overrides)`: "two" on 2
    processes with a checkpoint every step (or the one given), "one" the same on 1, "resumed" on 2 again from two's
    step-1 checkpoint."""
    two = two if two is not None else run("two", config, 2, extra)
    return {"two": two, "one": run("one", config, 1, extra),
            "resumed": run("resumed", config, 2, [*extra, f"checkpoint.resume={two['dir']}/checkpoints/step_00000001"])}


def assert_resumed_step_exact(two: dict, resumed: dict, at: int = 1) -> None:
    """A run resumed from `two`'s step-`at` checkpoint (1: after its first step) logs `two`'s steps from there on
    (every key but the timings) and ends with its last checkpoint's weights exactly."""
    from grpo.checkpoint.files import checkpoint_name

    timed = ("step_time_s", "samples_per_s")  # and time/*, perf/* (model FLOPs over a phase's wall time)
    untimed = lambda r: {k: v for k, v in r.items()  # noqa: E731
                         if not k.startswith(("time/", "perf/")) and k not in timed}
    assert [r["step"] for r in resumed["rows"]] == [r["step"] for r in two["rows"][at:]]
    assert [untimed(r) for r in resumed["rows"]] == [untimed(r) for r in two["rows"][at:]]
    last = f"checkpoints/{checkpoint_name(len(two['rows']))}"
    assert max_abs_diff(*(trained_weights(run["dir"] / last, "model") for run in (resumed, two))) == 0


def one_error_line(log: str) -> str:
    """The error line of a refused or failed run, after asserting it is the only one and the last, with no traceback
    (DeepSpeed's accelerator notice may precede it)."""
    lines = log.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return errors[0]


def max_abs_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def kill_leftovers(runs: list[Run]) -> None:
    for r in runs:
        if r.proc.poll() is None:
            r.kill_all()
