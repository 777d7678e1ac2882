"""The tiny worlds' build command line: ``python -m maintainer.tiny_worlds [--family F] --out OUT [flags]`` (the
package docstring lists the uses); `main` checks the flags and runs `build.build` with the family's `Builder`, or
`kontext.build_kontext`. Bad flags exit 2 with one line (argparse's usage, or SystemExit's message)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from maintainer.tiny_worlds import flux1, flux2, flux3
from maintainer.tiny_worlds.build import UNTRAINED, build
from maintainer.tiny_worlds.kontext import SOURCE, build_kontext

PROG = "python -m maintainer.tiny_worlds"


_UNSET = object()


def _given(p: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The flags the command line sets, also those set to the parser's default: the FLUX.3 and Kontext builders have
    defaults of their own, so `--images-per-prompt 32` (the parser's default) must still reach them."""
    defaults = {a.dest: a.default for a in p._actions if a.dest != "help"}
    p.set_defaults(**dict.fromkeys(defaults, _UNSET))
    try:
        return {k for k, v in vars(p.parse_args(argv)).items() if v is not _UNSET}
    finally:
        p.set_defaults(**defaults)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description="Build a tiny world's model folder, fully offline.")
    p.add_argument("--out", type=Path, required=True, help="output folder (diffusers layout of the family's pipeline)")
    p.add_argument("--family", choices=("flux1", "flux2", "flux2-dev", "flux1-kontext", "flux3"), default="flux1",
                   help="flux1: FluxPipeline (default); flux2: Flux2KleinPipeline; flux2-dev: Flux2Pipeline, untrained "
                        "only (maintainer/tiny_worlds/flux2.py); flux1-kontext: the --init-from FLUX.1 build as a "
                        "FluxKontextPipeline folder, its transformer trained to edit with --transformer-steps "
                        "(maintainer/tiny_worlds/kontext.py); flux3: a Flux3ModularPipeline folder with the tiny "
                        "FLUX.2 VAE (maintainer/tiny_worlds/flux3.py)")
    p.add_argument("--copy", action="store_true", help="flux1-kontext: copy the components instead of linking them")
    p.add_argument("--untrained", action="store_true",
                   help="no training and no evaluation, in seconds (build.UNTRAINED)")
    p.add_argument("--vae-steps", type=int, default=300)
    p.add_argument("--transformer-steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-batch", type=int, default=16)
    p.add_argument("--transformer-batch", type=int, default=32)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--decoder-steps", type=int, default=None,
                   help="sharpen the VAE decoder, encoder frozen (default 2000 for a new build, 0 with --init-from)")
    p.add_argument("--transformer-lr", type=float, default=1e-3)
    p.add_argument("--shift", type=float, default=3.0, help="time shift of the training sigma distribution")
    p.add_argument("--images-per-prompt", type=int, default=32, help="rendered latents per prompt in the training pool")
    p.add_argument("--layers", type=int, default=2, help="double-stream blocks")
    p.add_argument("--single-layers", type=int, default=4, help="single-stream blocks")
    p.add_argument("--eval-steps", type=int, default=12)
    p.add_argument("--eval-seeds", type=int, default=2, help="0 skips the held-out evaluation")
    p.add_argument("--latent-stat-images", type=int, default=512,
                   help="rendered images whose latents set the VAE's latent normalisation")
    p.add_argument("--init-from", type=Path, default=None,
                   help="an earlier build to continue (transformer, and the decoder with --decoder-steps)")
    # One thread by default: on a shared 2-core machine two OpenMP threads per process ran ~8x slower per step.
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (results depend on it bit-wise)")
    klein_only = p.add_argument_group("flux2 and flux3")
    klein_only.add_argument("--cfg-dropout", type=float, default=None,
                       help="share of training prompts replaced by the empty prompt, which CFG's negative prompt is "
                            "(default 0.1)")
    klein_only.add_argument("--long-text-every", type=int, default=None,
                       help="every N-th step, batch/8 samples see the pipeline's default 512-token padding instead "
                            "of 32 (default 8; 0: never)")
    args = p.parse_args(argv)
    if args.family == "flux1-kontext":
        given = _given(p, argv)
        other = sorted(given - {"family", "out", "init_from", "copy", "threads", "transformer_steps",
                                "transformer_batch", "transformer_lr", "shift", "images_per_prompt", "seed",
                                "eval_steps", "eval_seeds"})
        if other:
            raise SystemExit(f"--{other[0].replace('_', '-')}: --family flux1-kontext trains the transformer only "
                             "(--transformer-steps); drop it")
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        torch.set_num_threads(args.threads)
        # Without --transformer-steps the folder is a layout of the source only (its transformer never edits).
        steps = args.transformer_steps if "transformer_steps" in given else 0
        print(build_kontext(args.out, args.init_from or SOURCE, copy=args.copy, transformer_steps=steps,
                            transformer_batch=args.transformer_batch, transformer_lr=args.transformer_lr,
                            shift=args.shift, images_per_prompt=args.images_per_prompt, seed=args.seed,
                            eval_steps=args.eval_steps, eval_seeds=args.eval_seeds))
        return
    if args.family == "flux3":
        given = _given(p, argv)
        other = sorted(given - {"family", "out", "threads", "transformer_steps", "transformer_batch", "transformer_lr",
                                "shift", "images_per_prompt", "seed", "eval_steps", "eval_seeds", "layers",
                                "single_layers", "cfg_dropout"})
        if other:
            raise SystemExit(f"--{other[0].replace('_', '-')}: --family flux3 reuses the tiny FLUX.2 VAE and trains "
                             "the transformer only; drop it")
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        torch.set_num_threads(args.threads)
        keep = ("transformer_steps", "transformer_batch", "transformer_lr", "shift", "images_per_prompt", "seed",
                "eval_steps", "eval_seeds", "layers", "single_layers", "cfg_dropout")
        print(flux3.build_flux3(args.out, **{k: getattr(args, k) for k in keep if k in given}))
        return
    if args.copy:
        raise SystemExit("--copy: a flux1-kontext option (--family flux1-kontext)")
    for name, value in (UNTRAINED if args.untrained else {}).items():
        flag = f"--{name.replace('_', '-')}"
        if getattr(args, name) != p.get_default(name):
            raise SystemExit(f"--untrained sets {flag} {value}: drop {flag}")
        setattr(args, name, value)
    for name in ("vae_steps", "decoder_steps", "transformer_steps", "eval_seeds", "eval_steps", "long_text_every",
                 "latent_stat_images"):
        if (getattr(args, name) or 0) < 0:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(args, name)}")
    if args.init_from is not None and not (args.init_from / "build_info.json").is_file():
        raise SystemExit(f"--init-from: {args.init_from} is not a build of this tool (no build_info.json)")
    flux2_options = {k: v for k, v in (("cfg_dropout", args.cfg_dropout), ("long_text_every", args.long_text_every))
                     if v is not None}
    if args.family != "flux2" and flux2_options:  # flux3 returned above
        raise SystemExit(f"--{next(iter(flux2_options)).replace('_', '-')}: a flux2 option (--family flux2)")
    if args.family == "flux2":
        builder = flux2.klein(**flux2_options)
    else:
        builder = {"flux1": flux1.BUILDER, "flux2-dev": flux2.DEV}[args.family]
    if builder.train_transformer is None and args.transformer_steps > 0:
        raise SystemExit(f"--family {builder.name}: builds an untrained transformer only; add --untrained (or "
                         "--transformer-steps 0)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    build(
        args.out,
        builder,
        vae_steps=args.vae_steps,
        transformer_steps=args.transformer_steps,
        seed=args.seed,
        vae_batch=args.vae_batch,
        transformer_batch=args.transformer_batch,
        vae_lr=args.vae_lr,
        decoder_steps=args.decoder_steps,
        transformer_lr=args.transformer_lr,
        shift=args.shift,
        images_per_prompt=args.images_per_prompt,
        layers=args.layers,
        single_layers=args.single_layers,
        eval_steps=args.eval_steps,
        eval_seeds=args.eval_seeds,
        init_from=args.init_from,
        latent_stat_images=args.latent_stat_images,
    )

