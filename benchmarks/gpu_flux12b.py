"""A FLUX.1-dev-sized LoRA GRPO iteration on one GPU: seconds per image, MFU against the measured matmul rate, and
peak memory against the planner's prediction (tools/plan.py).

    python benchmarks/gpu_flux12b.py                       # one GPU; sized for an H200 (141 GB), < 8 minutes
    python benchmarks/gpu_flux12b.py --smoke               # the tiny config on the CPU: tests the script only
    python benchmarks/gpu_flux12b.py --compile             # the blocks compiled (model.compile), compile time apart
    python benchmarks/gpu_flux12b.py --fetch-blocks        # ZeRO-3 gathers whole blocks (deepspeed.fetch_blocks)

The transformer has FLUX.1-dev's config (11.9 B parameters, tools/flux_configs.json) with random bf16 weights,
built directly on the GPU; it goes through the recipe's own path: LoRA (rank 128 on to_q/k/v/out, the flux1_dev
preset), a ZeRO-3 engine on one process (ds_configs/zero3.json, bf16), activation checkpointing of every block. One
iteration = an SDE rollout of --batch images over --steps steps at --resolution with weights gathered once
(deepspeed.gather_for_rollout), then the update on the trained transitions (timestep fraction 0.6) and the optimizer
step. The VAE and the rewards are left out (their cost is small next to the transformer's and is planned separately).

FLOPs are counted by torch's FlopCounterMode on one rollout forward and one update transition (forward, recompute and
backward) and scaled by the counts; MFU uses model FLOPs (without the recompute), HFU all executed FLOPs. The matmul
rate is the best of 8192^3 bf16 matmuls in the same run. Memory: the accelerator's max_memory_allocated (CUDA or
NPU, through deepspeed.accelerator) per phase against the planner's phase totals for the same settings. Headline: `gpu_flux12b_s_per_image: X`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import ROOT, count_flops, matmul_flops, sync, transformer_config  # noqa: E402
from tools._recipe import load_recipe  # noqa: E402

SHIPPED = ROOT / "tools" / "flux_configs.json"


def build_model(tcfg: dict, dtype: torch.dtype, device: torch.device):
    """Random weights (diffusers' own init) created on `device` directly in `dtype`: no host copy, no fp32 copy."""
    from grpo.models.flux1 import FLUX1

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = FLUX1.transformer_class().from_config(tcfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def recipe_config(args):
    from grpo.config import load_config

    return load_config(ROOT / "recipes/configs/flux1_dev/grpo_lora.yaml", [
        "batch.prompts_per_step=1", f"sampling.group_size={args.batch}", f"batch.micro_batch_size={args.batch}",
        f"sampling.resolution={args.resolution}", f"sampling.num_steps={args.steps}",
        f"data.max_sequence_length={args.text_tokens}", "rewards={tiny_world: 1.0}", "data.eval_prompts=null",
        f"data.train_prompts={ROOT / 'assets/prompts/tiny_train.txt'}",  # the preset names none
        f"deepspeed.config={ROOT / 'ds_configs/zero3.json'}", "model.gradient_checkpointing=true",
        f"model.compile={str(args.compile).lower()}", f"deepspeed.fetch_blocks={str(args.fetch_blocks).lower()}",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="images per rollout micro-batch")
    parser.add_argument("--steps", type=int, default=16, help="denoising steps (DanceGRPO's FLUX setting)")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--text-tokens", type=int, default=512, help="T5 tokens (FLUX.1-dev: 512)")
    parser.add_argument("--iterations", type=int, default=2, help="the last one is reported (the first warms up)")
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU (a test of the script)")
    parser.add_argument("--compile", action="store_true",
                        help="model.compile: the blocks compiled (regional); compile time is reported apart")
    parser.add_argument("--fetch-blocks", action="store_true",
                        help="deepspeed.fetch_blocks: ZeRO-3 gathers each FLUX block as one unit")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.steps, args.resolution, args.text_tokens, args.iterations = 2, 3, 64, 32, 1
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from grpo import device as dev
    from grpo import engine as eng
    from grpo.layout import derive_layout
    from grpo.inputs import load_ds_config
    from grpo.models.blocks import compile_seconds
    from grpo.models.flux1 import FLUX1
    from grpo.loss import grpo_loss
    from grpo.rollout import SDEParams, sample, transition
    from grpo.sde import shifted_sigmas
    from tools import plan as planner
    from deepspeed.accelerator import get_accelerator

    info = dev.init_distributed()
    device = info.device
    accel = device.type != "cpu"  # CUDA or NPU: timings synchronised and peak memory read through get_accelerator()
    if args.smoke:
        tcfg, vsf = transformer_config("tiny"), 4
    else:
        tcfg, vsf = json.loads(SHIPPED.read_text())["black-forest-labs/FLUX.1-dev"]["transformer"], 8
    tcfg = {k: v for k, v in tcfg.items() if not k.startswith("_")}
    cfg = recipe_config(args)
    layout = derive_layout(cfg, 1)
    ds = load_ds_config(cfg.deepspeed.config, cfg, layout)
    dtype = eng.precision(ds)

    t0 = time.perf_counter()
    engine, _ = load_recipe().build_policy(build_model(tcfg, dtype, device), cfg, ds)
    setup_s = time.perf_counter() - t0
    n_params = sum(p.ds_numel for p in engine.module.parameters())
    n_train = sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad)

    g = torch.Generator().manual_seed(0)
    latent = 2 * (args.resolution // (vsf * 2))
    init = FLUX1.pack(torch.randn(args.batch, tcfg["in_channels"] // 4, latent, latent, generator=g)).to(device)
    embeds = {"prompt_embeds": torch.randn(args.batch, args.text_tokens, tcfg["joint_attention_dim"], generator=g),
              "pooled": torch.randn(args.batch, tcfg["pooled_projection_dim"], generator=g)}
    cond = FLUX1.conditioning(embeds, latent, 3.5, tcfg.get("guidance_embeds", False), device, dtype)
    v = FLUX1.velocity_of
    sigmas = shifted_sigmas(args.steps, 3.0)
    sde = SDEParams(0.3, "dance")
    trained = list(range(layout.trained_transitions))
    advantages = torch.randn(args.batch, generator=g).to(device)

    def reset_peak():
        if accel:
            get_accelerator().reset_peak_memory_stats(device.index)

    def peak() -> int:
        return get_accelerator().max_memory_allocated(device.index) if accel else 0

    def iteration() -> dict:
        out = {}
        reset_peak()
        sync(device)
        t = time.perf_counter()
        with torch.no_grad(), eng.inference_module(engine, cfg.deepspeed.gather_for_rollout) as model:
            traj = sample(v(model), cond, init, sigmas, sde,
                          [torch.Generator().manual_seed(i) for i in range(args.batch)])
        sync(device)
        out["rollout_s"], out["rollout_peak"] = time.perf_counter() - t, peak()
        reset_peak()
        t = time.perf_counter()
        for j in trained:
            step = transition(v(engine), cond, traj.latents, sigmas, j, sde)
            loss, _ = grpo_loss(step.log_prob, traj.log_probs[:, j], advantages, clip_range=1e-4)
            engine.backward(loss)
            engine.step()
        sync(device)
        out["update_s"], out["update_peak"] = time.perf_counter() - t, peak()
        out["traj"] = traj
        return out

    compiling = compile_seconds()
    for _ in range(args.iterations):
        result = iteration()
    compile_s = compile_seconds() - compiling  # in the first (warm-up) iteration with --compile
    traj = result.pop("traj")

    # FLOPs: one rollout forward, one update transition (with its recompute), counted once each.
    with torch.no_grad(), eng.inference_module(engine, cfg.deepspeed.gather_for_rollout) as model:
        fwd_flops, _ = count_flops(lambda: transition(v(model), cond, traj.latents, sigmas, 0, sde))
    def one_transition():
        s = transition(v(engine), cond, traj.latents, sigmas, 0, sde)
        engine.backward(grpo_loss(s.log_prob, traj.log_probs[:, 0], advantages, clip_range=1e-4)[0])
    upd_flops, _ = count_flops(one_transition)
    engine.optimizer.zero_grad()
    executed = args.steps * fwd_flops + len(trained) * upd_flops
    model_flops = executed - len(trained) * fwd_flops  # checkpointing recomputes one forward per transition
    rate = matmul_flops(device, dtype if accel else torch.float32, n=8192 if accel else 512)
    total_s = result["rollout_s"] + result["update_s"]

    p = planner.plan(cfg, 1, ds=json.loads((ROOT / "ds_configs/zero3.json").read_text()),
                     transformer_config=tcfg, vae_config=None)
    print(f"FLUX.1-dev-sized LoRA GRPO iteration on {device} ({n_params / 1e9:.2f} B params, {n_train / 1e6:.1f} M "
          f"trainable, {dtype}); {args.batch} images x {args.steps} steps at {args.resolution}px, "
          f"{len(trained)} trained transitions; engine setup {setup_s:.1f} s; model.compile {args.compile} "
          f"(compile time {compile_s:.1f} s, apart), deepspeed.fetch_blocks {args.fetch_blocks}")
    print(f"  rollout {result['rollout_s']:.2f} s, update {result['update_s']:.2f} s: "
          f"{total_s / args.batch:.3f} s per image")
    print(f"  matmul rate {rate / 1e12:.1f} TFLOP/s; model FLOPs {model_flops / 1e12:.1f} T, executed "
          f"{executed / 1e12:.1f} T; MFU {model_flops / total_s / rate:.3f}, HFU {executed / total_s / rate:.3f}")
    if accel:
        for phase, key in (("rollout", "rollout_peak"), ("update", "update_peak")):
            want = p.phase_total(phase)
            print(f"  peak memory {phase}: measured {result[key] / 2**30:.2f} GiB, planner {want / 2**30:.2f} GiB "
                  f"({want / result[key] - 1:+.1%})")
        want = max(p.phase_total(k) for k in ("rollout", "update", "optimizer step"))
        got = max(result["rollout_peak"], result["update_peak"])
        print(f"  peak memory: measured {got / 2**30:.2f} GiB, planner {want / 2**30:.2f} GiB ({want / got - 1:+.1%})")
    else:
        print("  peak memory: not measured on the CPU (the accelerator's max_memory_allocated needs a GPU or NPU)")
    print(f"gpu_flux12b_s_per_image: {total_s / args.batch:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
