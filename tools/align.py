"""Precision alignment: one seeded GRPO step under two settings, compared block by block.

    # two settings on this machine (each side is its own job, torchrun for N processes; one after the other)
    python -m tools.align CONFIG [key=value ...] --a SETTING ... --b SETTING ... [--nproc-a 1 --nproc-b 2]
    # one side to a file, e.g. on an NPU box and on a GPU box, then compare the two files anywhere
    python -m tools.align CONFIG [key=value ...] [device=npu] [--nproc N] --dump npu.safetensors
    python -m tools.align --compare npu.safetensors gpu.safetensors

A SETTING is a dotted config override (``deepspeed.config=ds_configs/zero3.json``, ``model.attention_backend=flash``),
``device=cpu|cuda|npu`` (the side's ``DS_ACCELERATOR``) or ``env.NAME=value`` (an environment variable of that side).
Overrides given right after CONFIG apply to both sides.

Each side builds the recipe of the preset (recipes/flux_grpo.py, loaded by path as tools.npu_audit does) and runs
step 0 through the recipe's own methods: rollout, reward, advantage, update. It records

* the outputs of the transformer's blocks (``time_text_embed``, ``context_embedder``, ``x_embedder``, ``pos_embed``,
  ``transformer_blocks.*``, ``single_transformer_blocks.*``, ``norm_out``, ``proj_out``) through forward hooks, during
  the rollout, for the chosen denoising steps (``--record-steps``, default the first and the last) of rank 0's first
  micro-batch. The recipe assigns samples to ranks in contiguous, world-size-independent blocks (grpo.layout.Layout),
  so rank 0's first micro-batch is always global samples 0..micro_batch_size-1, on 1 process or on N: the same
  trajectories, fed in the same micro-batch, on both sides;
* the whole step's trajectories (latents along the way, the decoded x0 prediction), rollout log-probs, rewards,
  advantages and images, gathered from every rank in global sample order;
* the update's statistics (loss, grad norm, ...) and the trainable weights before and after the optimizer step.

Prompts, initial noise and SDE noise are pure functions of (seed, step, sample index), drawn on the CPU (grpo/data.py),
so both sides see identical noise whatever their device or process count; whatever differs comes from the numerics.

The table gives, for A against B (B is the reference), ``rel = ||a - b|| / ||b||`` and ``max = max |a - b|`` per block
and per output, the reward's relative error (of the step's mean reward and per sample), and image agreement: PSNR and
the share of pixels whose three channels all lie within ``--pixel-tol`` (default one 8-bit level, 1/255).

A dump is one safetensors file: the recorded tensors plus JSON metadata in its header (key ``align``: settings,
resolved config, device, dtype, world size, versions, the update's statistics). ``--samples N`` limits what is
recorded (the step itself always runs in full); ``--record-steps all`` records every denoising step.

Reading the table:

* Block rows run in execution order; where the error jumps is where the two settings' kernels part. In bf16,
  ``time_text_embed`` is far off on its own (10-30% in the tiny model, where the blocks stay near 3e-2): diffusers
  casts the guidance scale to the model dtype before multiplying by 1000 (3.5 -> 3504 in bf16), on every device,
  exactly as FluxPipeline does.
* ``log-prob (rollout)`` is each side's log-density of its own sampled transitions. Both sides add the same CPU noise
  to their own SDE mean, so it depends on that noise and the SDE std, hardly on the transformer: an error here points at
  the float32 SDE math, not at the model. The transformer's drift shows in the block rows and the latents.
* ``weight update``: Adam's first step is about lr * sign(grad), so weights with near-zero gradients flip sign under
  any rounding difference; expect O(0.1-1) whenever anything differs, zero only for identical runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tools._recipe import RECIPE_PATH, REPO_ROOT, has_override
from tools.align_report import AlignError, Comparison, compare, format_table, load_dump
from tools.launch import torchrun_cmd

logger = logging.getLogger(__name__)


# ================================================================================================ settings of a side
@dataclass
class Side:
    """How one side runs: config overrides, environment and process count."""

    overrides: list[str]
    env: dict[str, str]
    nproc: int

    @classmethod
    def parse(cls, settings: Sequence[str], nproc: int) -> Side:
        """Splits ``key=value`` settings into config overrides and environment (``device=``, ``env.NAME=``).

        Raises:
            grpo.errors.ConfigError: A setting without ``=``, an unknown device, or nproc < 1.
        """
        from grpo.errors import ConfigError

        if nproc < 1:
            raise ConfigError(f"--nproc: {nproc}; use 1 or more processes")
        overrides, env = [], {}
        for item in settings:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"setting {item!r}: expected key=value, e.g. device=npu or sampling.num_steps=4")
            if key == "device":
                if value not in ("cpu", "cuda", "npu"):
                    raise ConfigError(f"device: {value!r} is unknown; use cpu, cuda or npu")
                env["DS_ACCELERATOR"] = value
            elif key.startswith("env."):
                env[key[4:]] = value
            else:
                overrides.append(item)
        return cls(overrides, env, nproc)


# ================================================================================================ orchestration
def run_side(name: str, config: str, side: Side, out: Path, workdir: Path, args: argparse.Namespace) -> None:
    """Runs one side as a job of ``side.nproc`` processes (torchrun when more than one); its rank 0 writes ``out``.

    Raises:
        AlignError: The job failed (the end of its output is in the message).
    """
    overrides = list(side.overrides)
    if not has_override(overrides, "output_dir"):
        overrides.append(f"output_dir={workdir / f'run_{name}'}")
    # One process needs no launcher (grpo.device.init_distributed fills in a 1-process job): saves a torch import.


    worker = ["-m", "tools.align", config, *overrides, "--worker", str(out), "--record-steps",
              args.record_steps, "--max-weights", str(args.max_weights), "--recipe", str(args.recipe)]
    if args.samples is not None:
        worker += ["--samples", str(args.samples)]
    cmd = [sys.executable, *worker] if side.nproc == 1 else torchrun_cmd(side.nproc, worker)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(side.env)
    logger.info("align: side %s: %d process(es)%s %s", name, side.nproc,
                   f" {' '.join(f'{k}={v}' for k, v in side.env.items())}" if side.env else "", " ".join(side.overrides))
    tail: deque[str] = deque(maxlen=60)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line)
        if args.verbose:
            sys.stderr.write(line)
    if proc.wait() != 0 or not out.is_file():
        raise AlignError(f"side {name} failed (exit {proc.returncode}); its last output:\n{''.join(tail)}")


def _check_settings(config: str, side: Side) -> None:
    """Fails fast, before any process starts, on settings the recipe would reject (ConfigError)."""
    from grpo.config import load_config
    from grpo.layout import derive_layout

    derive_layout(load_config(config, side.overrides), side.nproc)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.align", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:8]))
    p.add_argument("config", nargs="?", help="YAML preset, e.g. recipes/configs/tiny/grpo_lora.yaml")
    p.add_argument("overrides", nargs="*", help="settings for both sides: key=value, device=..., env.NAME=...")
    p.add_argument("--a", nargs="+", default=[], action="extend", metavar="SETTING", help="settings of side A")
    p.add_argument("--b", nargs="+", default=[], action="extend", metavar="SETTING",
                   help="settings of side B (the reference)")
    p.add_argument("--nproc", type=int, default=1, help="processes per side (default 1)")
    p.add_argument("--nproc-a", type=int, help="processes of side A (default --nproc)")
    p.add_argument("--nproc-b", type=int, help="processes of side B (default --nproc)")
    p.add_argument("--dump", metavar="PATH", help="run one side (CONFIG + overrides) and write it to PATH")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two dumps (B is the reference)")
    p.add_argument("--keep", metavar="DIR", help="A/B mode: keep the two dumps as DIR/a.safetensors, DIR/b.safetensors")
    p.add_argument("--json", metavar="PATH", help="also write the comparison as JSON")
    p.add_argument("--record-steps", default="0,-1", help="denoising steps whose block outputs are recorded: "
                   "comma-separated indices (negative from the end) or 'all' (default 0,-1)")
    p.add_argument("--samples", type=int, help="record only the first N global samples (default: the whole step)")
    p.add_argument("--max-weights", type=int, default=50_000_000,
                   help="compare trainable weights only up to this many (default 5e7)")
    p.add_argument("--pixel-tol", type=float, default=1 / 255, help="pixel agreement tolerance (default 1/255)")
    p.add_argument("--recipe", default=str(RECIPE_PATH), help="recipe script (default: recipes/flux_grpo.py)")
    p.add_argument("-v", "--verbose", action="store_true", help="stream the sides' output")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return p


def _report(comparison: Comparison, json_path: str | None) -> None:
    print(format_table(comparison))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(comparison.to_json(), indent=1, default=str))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; exit 0 after a table or a dump, 1 when a side fails, 2 on bad usage or settings."""
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    from grpo.errors import ConfigError

    if args.worker:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
        from tools.align_record import record

        try:
            record(args.config, args.overrides, args.worker, args.record_steps, args.samples, args.max_weights,
                   args.recipe)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)  # progress lines of the sides
    try:
        if args.compare:
            if args.config or args.a or args.b or args.dump:
                raise ConfigError("--compare: takes two dumps and nothing else; drop CONFIG, --a/--b and --dump")
            _report(compare(load_dump(args.compare[0]), load_dump(args.compare[1]), args.pixel_tol), args.json)
            return 0
        if not args.config:
            raise ConfigError("CONFIG: missing; give a preset (e.g. recipes/configs/tiny/grpo_lora.yaml) or --compare A B")
        if args.dump:
            if args.a or args.b:
                raise ConfigError("--dump: writes one side; put its settings after CONFIG, not in --a/--b")
            side = Side.parse(args.overrides, args.nproc)
            _check_settings(args.config, side)
            with tempfile.TemporaryDirectory(prefix="align_") as tmp:
                run_side("dump", args.config, side, Path(args.dump), Path(tmp), args)
            print(f"align: wrote {args.dump}")
            return 0
        sides = {"a": Side.parse([*args.overrides, *args.a], args.nproc_a or args.nproc),
                 "b": Side.parse([*args.overrides, *args.b], args.nproc_b or args.nproc)}
        for side in sides.values():
            _check_settings(args.config, side)
        with tempfile.TemporaryDirectory(prefix="align_") as tmp:
            keep = Path(args.keep) if args.keep else Path(tmp)
            paths = {name: keep / f"{name}.safetensors" for name in sides}
            for name, side in sides.items():
                run_side(name, args.config, side, paths[name], Path(tmp), args)
            _report(compare(load_dump(paths["a"]), load_dump(paths["b"]), args.pixel_tol), args.json)
        return 0
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except AlignError as err:
        print(f"align: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
