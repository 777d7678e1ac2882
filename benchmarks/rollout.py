"""Rollout throughput: our SDE sampler (grpo.rollout.sample, which also records every step's latents and log-probs)
against diffusers' FluxPipeline on the same transformer, VAE, batch, steps and resolution; and sharded rollouts under
ZeRO-3 on 2 processes: weights gathered once per rollout phase vs layer by layer at every step.

    python benchmarks/rollout.py [--preset small] [--batch 4] [--steps 8] [--resolution 128] [--repeats 5] [--smoke]
    python benchmarks/rollout.py --skip-zero3        # without the 2-process part

Both samplers start from the same packed noise and prompt embeddings, use the same sigmas (FluxPipeline's dynamic
shift) and decode with the same VAE. The two run back to back `--repeats` times, alternating which goes first (the
cores are shared: a pair sees the same load); forward hooks on the transformer split each run into transformer time
and the samplers' own time.

Headline: `rollout_vs_diffusers: R` = the median over pairs of our images/s over FluxPipeline's, decoding included
on both sides (goal R >= 1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import (ROOT, TINY, add_workload_args, build_transformer, smoke_workload, sync,  # noqa: E402
                                transformer_config, wall_and_cpu)
from tools._recipe import load_recipe  # noqa: E402
from tools.launch import run_torchrun  # noqa: E402


def _inputs(tcfg: dict, batch: int, resolution: int, text_tokens: int, device: torch.device, seed: int = 0):
    """Packed initial noise [B, S, C], prompt embeddings [B, L, D] and pooled [B, Dp] (random: the transformer
    and the samplers do not care what the text was)."""
    from grpo.models.flux1 import FLUX1

    g = torch.Generator().manual_seed(seed)
    latent = 2 * (resolution // (4 * 2))  # tiny VAE: scale factor 4
    noise = torch.randn(batch, tcfg["in_channels"] // 4, latent, latent, generator=g)
    embeds = torch.randn(batch, text_tokens, tcfg["joint_attention_dim"], generator=g)
    pooled = torch.randn(batch, tcfg["pooled_projection_dim"], generator=g)
    return FLUX1.pack(noise).to(device), embeds.to(device), pooled.to(device), latent


def _sigmas(pipe, steps: int, latent: int) -> torch.Tensor:
    from grpo.models.flux1 import FLUX1

    return FLUX1.dynamic_sigmas(steps, (latent // 2) ** 2, dict(pipe.scheduler.config))


def samplers(pipe, args, tcfg: dict, device: torch.device):
    """(ours, diffusers): rollouts of `batch` images with pipe.transformer, returning images (or x0 latents)."""
    from grpo.models.flux1 import FLUX1
    from grpo.rollout import SDEParams, sample

    vsf = 2 ** (len(pipe.vae.config.block_out_channels) - 1)

    def ours(batch: int, with_decode: bool):
        init, embeds, pooled, latent = _inputs(tcfg, batch, args.resolution, args.text_tokens, device)
        cond = FLUX1.conditioning({"prompt_embeds": embeds, "pooled": pooled}, latent, 3.5, tcfg["guidance_embeds"],
                                  device, torch.float32)
        gens = [torch.Generator().manual_seed(i) for i in range(batch)]
        traj = sample(FLUX1.velocity_of(pipe.transformer), cond, init, _sigmas(pipe, args.steps, latent),
                      SDEParams(0.7, "dance"), gens)
        return FLUX1.decode(pipe.vae, traj.x0, args.resolution, vsf) if with_decode else traj.x0

    def diffusers(batch: int, with_decode: bool):
        init, embeds, pooled, _ = _inputs(tcfg, batch, args.resolution, args.text_tokens, device)
        return pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, latents=init, height=args.resolution,
                    width=args.resolution, num_inference_steps=args.steps, guidance_scale=3.5,
                    output_type="pt" if with_decode else "latent").images

    return ours, diffusers


def pipeline(tcfg: dict, device: torch.device, compiled: bool = False):
    """FluxPipeline around a seeded random transformer of the preset (the same weights on every call), its blocks
    compiled (model.compile's regional compilation) or not."""

    from grpo.models.blocks import compile_blocks
    from grpo.models.flux1 import FLUX1

    transformer = build_transformer(tcfg).to(device)
    compile_blocks(transformer, compiled)
    pipe = FLUX1.pipeline_class().from_pretrained(str(TINY), transformer=transformer, dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def single_process(args, device: torch.device) -> dict:
    tcfg = transformer_config(args.preset)
    pipe = pipeline(tcfg, device)
    transformer = pipe.transformer
    ours, diffusers = samplers(pipe, args, tcfg, device)

    inside = [0.0]  # seconds spent inside the transformer's forward

    def start(*_):
        sync(device)
        inside.append(time.perf_counter())

    def stop(*_):
        sync(device)
        inside[0] += time.perf_counter() - inside.pop()

    transformer.register_forward_pre_hook(start)
    transformer.register_forward_hook(stop)

    def timed(fn, batch: int, with_decode: bool) -> tuple[float, float]:
        """(wall seconds, seconds outside the transformer: the sampler's own work and the decode)."""
        inside[0] = 0.0
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            fn(batch, with_decode)
        sync(device)
        wall = time.perf_counter() - t
        return wall, wall - inside[0]

    for fn in (ours, diffusers):  # warm-up
        timed(fn, args.batch, True)
    # The headline pairs the two samplers run back to back and takes the median ratio: the cores are shared, and
    # a pair sees the same load.
    pairs, runs = [], {}
    for i in range(args.repeats):
        if i % 2:  # alternate who goes first, so that an order effect cancels
            b, a = timed(diffusers, args.batch, True), timed(ours, args.batch, True)
        else:
            a, b = timed(ours, args.batch, True), timed(diffusers, args.batch, True)
        pairs.append(b[0] / a[0])
        for key, r in (("ours", a), ("diffusers", b)):
            runs.setdefault(key, []).append(r)
    for key, fn, batch in (("ours (latents only)", ours, args.batch), ("diffusers (latents only)", diffusers,
                                                                       args.batch), ("ours batch 1", ours, 1)):
        runs[key] = [timed(fn, batch, "latents" not in key)]
    batches = {"ours batch 1": 1}
    ips = {k: batches.get(k, args.batch) / min(w for w, _ in v) for k, v in runs.items()}
    overhead = {k: min(o for _, o in v) / args.steps for k, v in runs.items() if "latents only" in k}
    # Both samplers call the same transformer on the same inputs; the best time spent inside it, per sampler, shows
    # whether a gap is the samplers' or the machine's.
    transformer_s = {k: min(w - o for w, o in runs[k]) for k in ("ours", "diffusers")}
    return {"images_per_s": ips, "ratio": sorted(pairs)[len(pairs) // 2], "pairs": pairs,
            "overhead_per_step": overhead, "transformer_s": transformer_s,
            "outside_s": {k: min(o for _, o in runs[k]) for k in ("ours", "diffusers")},
            "params": sum(p.numel() for p in transformer.parameters())}


def compiled(args, device: torch.device) -> dict:
    """model.compile's rollout against the eager one (same weights, same noise: the samples must agree) and against
    FluxPipeline around a transformer compiled the same way. Interleaved rounds, medians; compile time apart."""
    from grpo.models.blocks import compile_seconds

    tcfg = transformer_config(args.preset)
    ours_eager, _ = samplers(pipeline(tcfg, device), args, tcfg, device)
    ours_compiled, diffusers_compiled = samplers(pipeline(tcfg, device, compiled=True), args, tcfg, device)

    def timed(fn) -> tuple[float, float, torch.Tensor]:
        with torch.no_grad():
            return wall_and_cpu(lambda: fn(args.batch, False), device)

    compiling = compile_seconds()
    *_, x0_compiled = timed(ours_compiled)  # compiles the blocks (no-grad graphs)
    timed(diffusers_compiled), timed(ours_eager)  # warm-up
    compile_s = compile_seconds() - compiling
    rounds = {"eager": [], "compiled": [], "diffusers compiled": []}
    cpu = {k: [] for k in rounds}
    for _ in range(args.repeats):
        for key, fn in (("eager", ours_eager), ("compiled", ours_compiled), ("diffusers compiled", diffusers_compiled)):
            t, c, x0 = timed(fn)
            rounds[key].append(t)
            cpu[key].append(c)
            if key == "eager":
                x0_eager = x0

    def med(a: str, b: str, t: dict = rounds) -> float:
        return statistics.median(x / y for x, y in zip(t[a], t[b]))

    return {"speedup": med("eager", "compiled"), "speedup_cpu": med("eager", "compiled", cpu),
            "vs_diffusers": med("diffusers compiled", "compiled"),
            "max_abs_diff": (x0_compiled - x0_eager).abs().max().item(), "compile_s": compile_s,
            "images_per_s": {k: args.batch / statistics.median(v) for k, v in rounds.items()}}


def worker_zero3(args, out: Path) -> None:
    """2 processes: the same rollout through a ZeRO-3 engine, gathered once (unwrap) vs layer-wise hooks."""
    import torch.distributed as dist

    from grpo import device as dev
    from grpo import engine as eng
    from grpo.config import load_config
    from grpo.layout import derive_layout
    from grpo.inputs import load_ds_config
    from grpo.models.flux1 import FLUX1
    from grpo.rollout import SDEParams, sample
    from grpo.sde import shifted_sigmas

    info = dev.init_distributed()
    tcfg = transformer_config(args.preset)
    cfg = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml",
                      ["batch.prompts_per_step=2", f"sampling.group_size={args.batch}",
                       f"batch.micro_batch_size={args.batch}", "deepspeed.config=ds_configs/zero3_fp32.json"])
    ds = load_ds_config(cfg.deepspeed.config, cfg, derive_layout(cfg, info.world_size))
    engine, _ = load_recipe().build_policy(build_transformer(tcfg), cfg, ds)
    init, embeds, pooled, latent = _inputs(tcfg, args.batch, args.resolution, args.text_tokens, info.device,
                                           seed=info.rank)
    cond = FLUX1.conditioning({"prompt_embeds": embeds, "pooled": pooled}, latent, 3.5, tcfg["guidance_embeds"],
                              info.device, torch.float32)
    sigmas = shifted_sigmas(args.steps, 3.0)

    def rollout(gather: bool) -> float:
        dist.barrier()
        t = time.perf_counter()
        with torch.no_grad(), eng.inference_module(engine, gather) as model:
            sample(FLUX1.velocity_of(model), cond, init, sigmas, SDEParams(0.7, "dance"),
                   [torch.Generator().manual_seed(i) for i in range(args.batch)])
        dist.barrier()
        return time.perf_counter() - t

    rollout(True), rollout(False)  # warm-up
    best = {True: float("inf"), False: float("inf")}
    for _ in range(args.repeats):
        for gather in (True, False):
            best[gather] = min(best[gather], rollout(gather))
    if info.rank == 0:
        n = args.batch * info.world_size
        out.write_text(json.dumps({"gathered": n / best[True], "layerwise": n / best[False]}))
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, repeats=5, smoke_steps=2)
    parser.add_argument("--skip-zero3", action="store_true")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also time model.compile's rollout (default: on, off with --smoke)")
    parser.add_argument("--worker", choices=["zero3"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    smoke_workload(args)
    if args.worker == "zero3":
        worker_zero3(args, args.out)
        return 0

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = single_process(args, device)
    ips = res["images_per_s"]
    print(f"rollout of {args.batch} images, {args.steps} steps, {args.resolution}px, preset {args.preset} "
          f"({res['params'] / 1e6:.1f} M params), {device}, {torch.get_num_threads()} thread(s):")
    for name, v in ips.items():
        print(f"  {name:<32} {v:8.3f} images/s")
    print(f"  ours / diffusers per pair (with decode): {', '.join(f'{r:.3f}' for r in res['pairs'])}; "
          f"latents only, best of 1: {ips['ours (latents only)'] / ips['diffusers (latents only)']:.3f}")
    print("  time per step outside the transformer (sampler bookkeeping; ours also draws per-trajectory noise and "
          "computes log-probs): " + ", ".join(f"{k.split(' ')[0]} {v * 1e3:.1f} ms"
                                             for k, v in res["overhead_per_step"].items()))
    t, o = res["transformer_s"], res["outside_s"]
    common = min(t.values())
    print(f"  best time inside the transformer: ours {t['ours']:.2f} s, diffusers {t['diffusers']:.2f} s; outside it "
          f"(sampler + decode): ours {o['ours']:.2f} s, diffusers {o['diffusers']:.2f} s -> with the transformer's "
          f"time equal for both, ours / diffusers = {(common + o['diffusers']) / (common + o['ours']):.3f}")
    print(f"  ours batch {args.batch} / batch 1 (DanceGRPO rolls out one image at a time): "
          f"{ips['ours'] / ips['ours batch 1']:.2f}x images/s")
    if args.compile if args.compile is not None else not args.smoke:
        c = compiled(args, device)
        ips = c["images_per_s"]
        print(f"model.compile (regional, inductor): compile {c['compile_s']:.1f} s (apart); latents only, median of "
              f"{args.repeats} interleaved rounds: " + ", ".join(f"{k} {v:.3f}" for k, v in ips.items()) + " images/s")
        print(f"  compiled / eager {c['speedup']:.3f}x ({c['speedup_cpu']:.3f}x in CPU time), compiled ours / compiled "
              f"FluxPipeline {c['vs_diffusers']:.3f}; "
              f"max |x0 compiled - x0 eager| = {c['max_abs_diff']:.2e}")
        print(f"compiled_rollout_speedup: {c['speedup']:.3f}")
    if not args.skip_zero3:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "zero3.json"
            script = [__file__, "--worker", "zero3", "--out", str(out), "--preset", args.preset, "--batch",
                      str(args.batch), "--steps", str(args.steps), "--resolution", str(args.resolution),
                      "--repeats", str(args.repeats)]
            run_torchrun(2, script, accelerator=None)
            z = json.loads(out.read_text())
        print(f"ZeRO-3 on 2 processes, LoRA policy, {args.batch} images per process: gathered once per rollout "
              f"{z['gathered']:.3f} images/s, layer-wise {z['layerwise']:.3f} images/s "
              f"(gather_for_rollout speed-up {z['gathered'] / z['layerwise']:.2f}x)")
    print(f"rollout_vs_diffusers: {res['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
