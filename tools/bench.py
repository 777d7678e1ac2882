"""Benchmark a checkpoint on a prompt suite under the suite's pinned protocol: base vs checkpoint, paired, with reports.

    python -m tools.bench CONFIG suite=NAME|PATH [checkpoint=RUN_OR_CKPT[,RUN_OR_CKPT...]] [weights=auto|ema|model]
                          [out=DIR] [nproc=N] [key=value ...]

A suite is a folder (NAME: ``assets/suites/NAME``) holding its prompts (a prompt set: .jsonl with per-prompt
metadata, .txt, ...), its licence and source (``SOURCE.md``, ``LICENSE``) and ``protocol.yaml``, which pins how its
images are sampled: resolution, steps, guidance (the distilled embedding), cfg_scale (true CFG, 1.0 = none),
seeds_per_prompt, seed, eta (0: the deterministic ODE sampler, the only one evals use) and the metadata keys to
tabulate (tags). The protocol is applied over the preset (an override of a pinned setting is refused), so every bench
of a suite samples the same images from the same model, whatever preset trained the checkpoint.

The sampling and scoring are tools.eval's (the base model and each checkpoint on the same noise, scored by the
preset's rewards, local or remote; ``rewards.NAME=W`` picks others). Results go beside the evaluated run:
``RUN/bench/<suite>/<checkpoint>/`` for ``RUN/checkpoints/<checkpoint>`` (``output_dir/bench/<suite>/base/`` for the
base alone): tools.eval's ``grid.png`` and ``scores.json`` (``python -m tools.compare`` reads it), ``report.json`` and
``report.md``: the protocol, the package versions and code commit, the mean reward, the paired gain with its standard
error and share of images up, per tag value. Several checkpoints (e.g. one per training seed) each get their folder;
the joint report, with the spread of the gains between them (tools.compare.spread), goes to ``out=DIR`` (required).

``nproc=N``: the checks here, then N processes under tools.torchrun (or start it under torchrun yourself), each
sampling and scoring its shards of the images; the same images and rewards on any N (tools/shards.py). Finished
shards are kept under each results folder's ``shards/``, keyed by a hash of everything they depend on: a rerun
samples only what is left, and never reuses the shards of another protocol, setting or checkpoint.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from pathlib import Path

import yaml

from grpo import device as dev
from grpo import manifest
from grpo.best import paired
from grpo.checkpoint import find_checkpoint
from grpo.checkpoint.files import write_text_atomic
from grpo.config import RecipeConfig, load_config
from grpo.errors import ConfigError
from tools.compare import spread
from tools.eval import config_tool, evaluate_checkpoint, inputs

log = logging.getLogger(__name__)

SUITES = Path(__file__).resolve().parents[1] / "assets" / "suites"
# protocol.yaml's keys -> the settings they pin (the held-out eval's: tools.eval samples what the recipe's evals do)
PINNED = {"resolution": "sampling.resolution", "steps": "sampling.eval_num_steps", "guidance": "sampling.guidance",
          "cfg_scale": "sampling.eval_cfg_scale", "seeds_per_prompt": "logging.eval_seeds", "seed": "seed"}
PROTOCOL_KEYS = (*PINNED, "prompts", "eta", "tags")


def find_suite(name: str) -> Path:
    """A suite folder: NAME under assets/suites/, or a path."""
    folder = SUITES / name if (SUITES / name).is_dir() else Path(name)
    if not (folder / "protocol.yaml").is_file():
        known = ", ".join(sorted(p.name for p in SUITES.iterdir() if (p / "protocol.yaml").is_file()))
        raise ConfigError(f"suite={name}: no protocol.yaml there; a folder with one, or one of: {known}")
    return folder


def read_protocol(folder: Path) -> dict:
    """protocol.yaml, checked: every key known, every pinned setting present, eta 0."""
    try:
        protocol = yaml.safe_load((folder / "protocol.yaml").read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{folder}/protocol.yaml: not YAML ({e.__class__.__name__})") from None
    if not isinstance(protocol, dict):
        raise ConfigError(f"{folder}/protocol.yaml: expected a mapping of {', '.join(PROTOCOL_KEYS)}")
    unknown = sorted(set(protocol) - set(PROTOCOL_KEYS))
    missing = [k for k in (*PINNED, "prompts", "eta") if k not in protocol]
    if unknown or missing:
        raise ConfigError(f"{folder}/protocol.yaml: unknown keys {unknown}, missing {missing}; a protocol pins "
                          f"{', '.join(PROTOCOL_KEYS)} (tags optional)")
    if protocol["eta"] != 0:
        raise ConfigError(f"{folder}/protocol.yaml: eta {protocol['eta']}; benches sample with the ODE (eta 0)")
    if not (folder / protocol["prompts"]).is_file():
        raise ConfigError(f"{folder}/protocol.yaml: prompts {protocol['prompts']!r}: no such file in the suite")
    return {**protocol, "tags": list(protocol.get("tags") or [])}


def apply_protocol(protocol: dict, folder: Path, overrides: list[str]) -> list[str]:
    """The overrides that pin the protocol, after the user's; a user override of a pinned setting is refused (it
    would make this bench incomparable with every other of the suite)."""
    pinned = {f"{setting}={json.dumps(protocol[key])}" for key, setting in PINNED.items()}
    clash = sorted({o.split("=", 1)[0] for o in overrides} & {*PINNED.values(), "data.eval_prompts"})
    if clash:
        raise ConfigError(f"{clash[0]}: pinned by the suite's protocol.yaml; bench another suite (a copy of its "
                          f"folder with another protocol) to sample otherwise")
    prompts = folder / protocol["prompts"]
    # a bench trains nothing, and the real models' presets name no training prompts: the suite's stand in
    untrained = [] if any(o.startswith("data.train_prompts=") for o in overrides) else [f"data.train_prompts={prompts}"]
    return [*overrides, *untrained, *sorted(pinned), f"data.eval_prompts={prompts}"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _gain(before: list[float], after: list[float]) -> dict:
    return {"base": _mean(before), "checkpoint": _mean(after), **paired(before, after)}


def summarize(prompts: list[str], metadata: list[dict], tags: list[str], base: list[float],
              checkpoints: list[list[float]]) -> dict:
    """The report's numbers from per-image rewards (image j shows prompt j % len(prompts)).

    Args:
        base: the base model's reward per image.
        checkpoints: each checkpoint's reward per image, on the base's noise (none: the base alone).

    Returns:
        {"images", "base", "runs": [paired gain of each checkpoint], "spread": the gains' spread between checkpoints
        (std None for one; None without checkpoints), "tags": {tag: {value: paired gain of the checkpoints' per-image
        mean over that value's images; the base alone: {"n", "base"}}}}.
    """
    groups = {tag: {} for tag in tags}  # tag -> value -> its images
    for tag, values in groups.items():
        for j in range(len(base)):
            values.setdefault(str(metadata[j % len(prompts)].get(tag)), []).append(j)
    mean_run = [sum(xs) / len(xs) for xs in zip(*checkpoints)]  # the checkpoints' mean per image (one: itself)

    def row(idx: list[int]) -> dict:
        before = [base[j] for j in idx]
        return _gain(before, [mean_run[j] for j in idx]) if checkpoints else {"n": len(idx),
                                                                              "base": sum(before) / len(before)}

    runs = [_gain(base, c) for c in checkpoints]
    return {"images": len(base), "base": sum(base) / len(base), "runs": runs,
            "spread": spread([r["mean"] for r in runs])._asdict() if runs else None,
            "tags": {tag: {v: row(idx) for v, idx in sorted(values.items())} for tag, values in groups.items()}}


def _table(rows: dict[str, dict], head: str) -> list[str]:
    lines = [f"| {head} | images | base | checkpoint | gain | SE | higher |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {k} | {r['n']} | {r['base']:.4f} | {r['checkpoint']:.4f} | {r['mean']:+.4f} | {r['se']:.4f} | "
              f"{100 * r['higher']:.0f}% |" for k, r in rows.items()]
    return lines


def render(report: dict) -> str:
    """report.md from report.json's object."""
    p, s, stats = report["protocol"], report["settings"], report["stats"]
    lines = [f"# Bench: {report['suite']['name']}", "",
             f"{report['suite']['prompts']} prompts x {p['seeds_per_prompt']} seeds = {stats['images']} images, "
             f"model `{s['model']}`, rewards {json.dumps(report['rewards'])}.", "",
             "## Protocol", "", *(f"- {k}: {json.dumps(v)}" for k, v in p.items()),
             f"- settings as sampled: {json.dumps(s)}", "", "## Result", ""]
    if not stats["runs"]:
        lines.append(f"Base model only: mean reward {stats['base']:.4f}.")
        for tag, rows in stats["tags"].items():
            lines += ["", f"### By {tag}", "", f"| {tag} | images | base |", "|---|---:|---:|",
                      *(f"| {k} | {r['n']} | {r['base']:.4f} |" for k, r in rows.items())]
    else:
        lines += _table({c["path"]: r for c, r in zip(report["checkpoints"], stats["runs"])}, "checkpoint")
        sp = stats["spread"]
        if sp["std"] is not None:
            lines += ["", f"Between the {sp['n']} checkpoints: gain {sp['mean']:+.4f}, std {sp['std']:.4f}, range "
                          f"{sp['low']:+.4f} .. {sp['high']:+.4f}."]
        mean = " (per image: the checkpoints' mean)" if len(stats["runs"]) > 1 else ""
        for tag, rows in stats["tags"].items():
            lines += ["", f"### By {tag}{mean}", "", *_table(rows, tag)]
    lines += ["", "Each reward's mean (base, then each checkpoint): " + "; ".join(
        f"{name} {c['base']:.4f}" + "".join(f" | {x:.4f}" for x in c["checkpoints"])
        for name, c in report["components"].items()) + "."]
    lines += ["", *(f"![{c['path']}]({c['grid']}) (rows: prompts; columns: base | checkpoint)"
                    for c in report["checkpoints"])]
    lines += ["", "Gain: mean of the per-image differences (checkpoint - base, on the same noise); SE: its standard "
                  "error (n - 1); higher: the share of images that score higher.", "",
              "## Provenance", "", f"- date: {report['date']}", f"- command: `{' '.join(report['command'])}`",
              f"- code: {json.dumps(report['code'])}", f"- packages: {json.dumps(report['packages'])}",
              f"- device: {report['device']}", f"- suite: {report['suite']['path']} ({report['suite']['source']})"]
    return "\n".join(lines) + "\n"


def _run_dir(cfg: RecipeConfig, suite: str, found: Path | None) -> Path:
    """RUN/bench/<suite>/<checkpoint> beside the evaluated run; output_dir/bench/<suite>/base for the base alone."""
    if found is None:
        return Path(cfg.output_dir) / "bench" / suite / "base"
    run = found.parent.parent if found.parent.name == "checkpoints" else found.parent
    return run / "bench" / suite / found.name


def prepare(config: str, suite: str, checkpoints: list[str], weights: str = "auto", out: str | None = None,
            overrides: list[str] = ()) -> tuple[Path, dict, RecipeConfig, list[Path]]:
    """The suite's folder and protocol, the preset under it and the checkpoints found, every input checked before
    any model loads (ConfigError: one line); see :func:`bench` for the arguments."""
    folder = find_suite(suite)
    protocol = read_protocol(folder)
    cfg = load_config(config, apply_protocol(protocol, folder, list(overrides)))
    if len(checkpoints) > 1 and out is None:
        raise ConfigError("checkpoint: several given; name the folder of their joint report with out=DIR")
    found = ([find_checkpoint(Path(c)) for c in checkpoints] if checkpoints
             else [c for c in [find_checkpoint(Path(cfg.output_dir), required=False)] if c is not None])
    for c in found or [None]:
        inputs(cfg, c, weights)
    return folder, protocol, cfg, found


def bench(config: str, suite: str, checkpoints: list[str], weights: str = "auto", out: str | None = None,
          overrides: list[str] = ()) -> Path | None:
    """Bench the base model and `checkpoints` (none: the newest under output_dir, or the base alone) on `suite`, in
    shards over this job's processes (tools/shards.py); returns the folder of report.md and report.json (on rank 0;
    None on the others)."""
    folder, protocol, cfg, found = prepare(config, suite, checkpoints, weights, out, overrides)
    # each checkpoint's grid and scores.json beside its run (out=DIR: there, for one checkpoint or the base alone);
    # the grid's images only: a suite has thousands
    alone = out is not None and len(found) <= 1
    results = [evaluate_checkpoint(cfg, c, weights, Path(out) if alone else _run_dir(cfg, folder.name, c),
                                   all_images=False)
               for c in (found or [None])]
    first = results[0]
    if first is None:  # a rank other than 0 of several: rank 0 writes the reports
        return None
    stats = summarize(first["prompts"], first["metadata"], protocol["tags"], first["base"]["per_image"],
                      [r["checkpoint"]["per_image"] for r in results if r["checkpoint"]])
    s = cfg.sampling
    where = Path(out) if out else Path(first["dir"])
    source = (folder / "SOURCE.md").read_text().strip().splitlines() if (folder / "SOURCE.md").is_file() else []
    report = {
        "suite": {"name": folder.name, "path": str(folder), "prompts": len(first["prompts"]),
                  "source": " ".join(source[1:]).strip() or "no SOURCE.md"},
        "protocol": {k: v for k, v in protocol.items() if k != "prompts"},
        "settings": {"model": cfg.model.path, "resolution": s.resolution, "steps": s.eval_num_steps or s.num_steps,
                     "guidance": s.guidance, "true_cfg": None if s.eval_true_cfg is None else s.eval_true_cfg.scale,
                     "shift": s.shift, "eval_seeds": cfg.logging.eval_seeds, "seed": cfg.seed, "eta": 0.0},
        "rewards": cfg.rewards,
        "checkpoints": [{"path": r["checkpoint"]["path"], "step": r["checkpoint"]["step"],
                         "weights": r["checkpoint"]["weights"], "dir": r["dir"],
                         "grid": os.path.relpath(Path(r["dir"]) / "grid.png", where)}  # relative: the page moves
                        for r in results if r["checkpoint"]],
        "stats": stats,
        # each reward's own mean (the weighted total above mixes them): base, then each checkpoint
        "components": {name: {"base": _mean(images),
                              "checkpoints": [_mean(r["checkpoint"]["components"][name]) for r in results
                                              if r["checkpoint"]]}
                       for name, images in first["base"]["components"].items()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv, "code": manifest.code_version(), "packages": manifest.packages(),
        "device": manifest.device_name(dev.device_for_local_rank(0)),
    }
    where.mkdir(parents=True, exist_ok=True)
    write_text_atomic(where / "report.json", json.dumps(report, indent=1, default=str))
    write_text_atomic(where / "report.md", render(report))
    log.info("bench %s: base %.4f%s -> %s", folder.name, stats["base"],
             "".join(f" | gain {r['mean']:+.4f} +- {r['se']:.4f}" for r in stats["runs"]), where)
    return where


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.bench CONFIG suite=NAME|PATH [checkpoint=A[,B...]] [weights=...] [out=DIR] [key=value ...]`."""
    def args(config: str, own: dict[str, str], overrides: list[str]) -> tuple:
        if not own.get("suite"):
            raise ConfigError("suite: missing; suite=NAME (under assets/suites/) or suite=PATH")
        checkpoints = [c for c in own.get("checkpoint", "").split(",") if c]
        return config, own["suite"], checkpoints, own.get("weights", "auto"), own.get("out") or None, overrides

    def body(config: str, own: dict[str, str], overrides: list[str]) -> str | None:
        where = bench(*args(config, own, overrides))
        return None if where is None else str(where)

    return config_tool(argv, __doc__, ("suite", "checkpoint", "weights", "out"), body, "tools.bench",
                       lambda *a: prepare(*args(*a)))


if __name__ == "__main__":
    sys.exit(main())
