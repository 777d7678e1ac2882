"""One markdown page of a run, from what the run wrote: `RUN/report.md`, publishable as the run folder is.

    python -m tools.report RUN [--out FILE]

The page reads, in order: the curves (`reward_curve.png` and the last sample grid, linked: they are the run's own
files beside the page), training (the first and last steps' rewards, the held-out evals of metrics.jsonl), the
held-out table of every `python -m tools.eval` of the run (`RUN/eval/*/scores.json`: base and checkpoint means and
the paired gain with its standard error, as `tools.compare` computes it), throughput (per phase, the mean over the
steps after the first, which holds the warm-up), and the manifest (each start's command, code, hosts, devices,
packages; the SHA256 of the exports and the kept checkpoints, as `sha256sum -c` reads them). Nothing is recomputed
from images or weights: the page is a view of the run's files, written in well under a second.

Bad input (no run folder, no metrics.jsonl) exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from grpo.checkpoint.files import write_text_atomic
from grpo.errors import ConfigError, run_command
from grpo.manifest import MANIFEST
from grpo.metrics import CURVE, _read_rows
from tools.compare import paired

# (phase, its seconds, its images/s, its perf/* suffix: model TFLOP/s per device and MFU, grpo/perf.py)
PHASES = (("rollout", "time/rollout_s", "time/rollout_images_per_s", "rollout"), ("reward", "time/reward_s", None, None),
          ("update", "time/update_s", "time/update_images_per_s", "update"),
          ("step", "step_time_s", "samples_per_s", None))


def _num(v, digits: int = 4) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and math.isfinite(v) else "–"


def _mean(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _curves(run: Path) -> list[str]:
    lines = ["## Curves", ""]
    if (run / CURVE).is_file():
        lines += [f"![training and held-out reward]({CURVE})", ""]
    grids = sorted((run / "samples").glob("step_*.png")) if (run / "samples").is_dir() else []
    if grids:
        rel = grids[-1].relative_to(run).as_posix()
        lines += [f"Rollouts of the last sampled step (one row per prompt's group): ![{grids[-1].stem}]({rel})", ""]
    return lines if len(lines) > 2 else []


def _training(rows: list[dict]) -> list[str]:
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval/reward_mean" in r]
    lines = ["## Training", ""]
    if train:
        first, last = train[0], train[-1]
        lines += [f"{len(train)} steps logged ({first['step']} to {last['step']}); training reward (rollouts) "
                  f"{_num(first['reward_mean'])} at step {first['step']}, {_num(last['reward_mean'])} at step "
                  f"{last['step']}.", ""]
    if evals:
        lines += ["Held-out reward during training (eta = 0, fixed noise; step = completed steps):", "",
                  *_table(["step", "eval/reward_mean"], [[str(r["step"]), _num(r["eval/reward_mean"])] for r in evals]),
                  ""]
    return lines


def _heldout(run: Path) -> list[str]:
    found = sorted((run / "eval").glob("*/scores.json")) if (run / "eval").is_dir() else []
    rows = []
    for path in found:
        scores = json.loads(path.read_text())
        base, ckpt = scores["base"], scores.get("checkpoint")
        row = [path.parent.name, str(len(base.get("per_image", []))), _num(base["reward_mean"])]
        if ckpt and "per_image" in ckpt and "per_image" in base:
            gain = paired(base["per_image"], ckpt["per_image"])
            row += [f"{ckpt['step']} ({ckpt['weights']})", _num(ckpt["reward_mean"]),
                    f"{gain['mean']:+.4f} ± {gain['se']:.4f}", f"{gain['higher']:.0%}"]
        else:
            row += ["–"] * 4
        rows.append(row)
    if not rows:
        return []
    return ["## Held-out evaluation (`python -m tools.eval`)", "",
            *_table(["eval", "images", "base", "checkpoint step (weights)", "checkpoint", "gain ± SE (paired)",
                     "higher"], rows), ""]


def _throughput(rows: list[dict]) -> list[str]:
    train = [r for r in rows if "reward_mean" in r]
    steady = train[1:] or train  # the first step holds the warm-up (allocations, compiles)
    if not steady:
        return []
    table = []
    for name, seconds, rate, perf in PHASES:
        s = _mean([r.get(seconds) for r in steady])
        if s is not None:
            tflops = _mean([r.get(f"perf/tflops/{perf}") for r in steady]) if perf else None
            mfu = _mean([r.get(f"perf/mfu/{perf}") for r in steady]) if perf else None
            table.append([name, _num(s, 3), _num(_mean([r.get(rate) for r in steady]), 2) if rate else "–",
                          _num(tflops, 3), "–" if mfu is None else f"{100 * mfu:.1f}%"])
    logged = any(k.startswith("perf/mfu/") for r in steady for k in r)
    note = ("Model TFLOP/s are per device (the transformer's forwards and backwards, grpo/perf.py); MFU is over the "
            "device's peak" + ("." if logged else ", not logged: the device's peak is not known (set "
                               "perf.peak_tflops)."))
    return ["## Throughput", "", f"Means over {len(steady)} step(s){' after the first' if len(train) > 1 else ''}:",
            "", *_table(["phase", "seconds", "images/s", "model TFLOP/s", "MFU"], table), "", note, ""]


def _manifest(run: Path) -> list[str]:
    path = run / MANIFEST
    if not path.is_file():
        return ["## Manifest", "", f"No {MANIFEST} (a run from before manifests).", ""]
    data = json.loads(path.read_text())
    lines = ["## Manifest", "", f"From `{MANIFEST}` ({len(data['segments'])} start(s)).", ""]
    rows = []
    for i, s in enumerate(data["segments"]):
        code = s["code"]
        commit = "not a git checkout" if code is None else code["commit"][:12] + (" (dirty)" if code["dirty"] else "")
        devices = ", ".join(f"{n} × {name}" for name, n in s["devices"].items())
        rows.append([str(i), s["start"], s["end"] or "–", "yes" if s["finished"] else "no", str(s["first_step"]),
                     str(s["world_size"]), ", ".join(s["hosts"]), devices, commit, s["config_sha256"][:12]])
    lines += _table(["start #", "start", "end", "finished", "from step", "world", "hosts", "devices", "commit",
                     "config.yaml sha256"], rows)
    last = data["segments"][-1]
    lines += ["", "Command of the last start: `" + " ".join(last["command"]) + "`", "",
              "Packages: " + ", ".join(f"{k} {v}" for k, v in last["packages"].items()), ""]
    sums = [f"{sha}  {name}" for name, sha in sorted(data["exports"].items())]
    for name, entry in sorted(data["checkpoints"].items()):
        if not entry["removed"]:
            sums += [f"{sha}  checkpoints/{name}/{f}" for f, sha in sorted(entry["files"].items())]
    if sums:
        lines += ["SHA256 of the exports and the kept checkpoints (from the run folder: `sha256sum -c`):", "",
                  "```", *sums, "```", ""]
    return lines


def report(run: str | Path) -> str:
    """The markdown page of the run folder `run`."""
    run = Path(run)
    if not (run / "metrics.jsonl").is_file():
        raise ConfigError(f"{run}: no metrics.jsonl; pass a run folder (a recipe's output_dir)")
    rows = _read_rows(run / "metrics.jsonl")
    lines = [f"# Run `{run.name}`", ""]
    for part in (_curves(run), _training(rows), _heldout(run), _throughput(rows), _manifest(run)):
        lines += part
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.report RUN [--out FILE]`: writes RUN/report.md (or FILE) and prints its path."""
    parser = argparse.ArgumentParser(prog="flux-grpo report", description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run folder (a recipe's output_dir)")
    parser.add_argument("--out", help="where to write the page (default RUN/report.md; links are relative to RUN)")
    args = parser.parse_args(argv)

    def body() -> str:
        page = report(args.run)
        out = Path(args.out) if args.out else Path(args.run) / "report.md"
        write_text_atomic(out, page)
        return str(out)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
