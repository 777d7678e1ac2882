"""Step efficiency: the FLOPs of one GRPO iteration over its wall time, divided by this machine's matmul FLOP/s
measured in the same run, on the 'small' preset (~37 M parameters, full fine-tune).

    python benchmarks/step_efficiency.py [--preset small] [--batch 4] [--steps 8] [--resolution 128] [--smoke]

One iteration is what the recipe does per micro-batch: an SDE rollout of `--batch` images over `--steps` steps
(no grad, log-probs recorded), then the GRPO update on the trained transitions (timestep fraction 0.6: forward +
backward each, gradients accumulated) and one AdamW step with clipping. FLOPs come from
torch.utils.flop_counter.FlopCounterMode (matmuls and attention; the CPU flash-attention kernel is registered here,
torch only knows the GPU ones). The machine's rate is the best sustained 1024^3 fp32 matmul rate, measured before
and after the timed iterations with the same threads (the cores are shared, so both see the same contention).

The runs side by side, interleaved round by round (the cores are shared: medians over `--repeats` rounds): plain
PyTorch (the model, torch AdamW fused as the recipe chooses it, torch's own F.linear), the recipe's path, a
DeepSpeed ZeRO-3 engine on one process (ds_configs/zero3_fp32.json as grpo.inputs.load_ds_config fills it, rollout
through grpo.engine.inference_module as the recipe does it), whose extra time is DeepSpeed's overhead (per-module
fetch/release hooks, its F.linear replacement, gradient partitioning and the flat optimizer step), the same engine
with deepspeed.fetch_blocks (each FLUX block gathered as one unit: hooks on 6 blocks instead of on their 132
sub-modules), and the same engine with model.compile (the FLUX blocks compiled by inductor; compile time is spent in
the warm-up and reported apart). torch.profiler tables of the plain and the ZeRO-3 iteration say where time goes, and
ZeRO-3's extra time is also given in seconds and split by phase (rollout, forward, backward, optimizer step): it is
mostly a cost per module and parameter (hooks, flat buffers) that grows far slower than the work, so its share falls
as images grow (`--resolution 256`: 4.6x the FLOPs; RESULTS.md).
Headline: `step_efficiency: E` of the ZeRO-3 run (goal E >= 0.7 on a CPU). Each run's wall and CPU time are both
reported: on a shared host the CPU time leaves out what other guests take from the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import (ROOT, add_workload_args, build_transformer, count_flops, matmul_flops,  # noqa: E402
                                smoke_workload, transformer_config, wall_and_cpu)
from tools._recipe import load_recipe  # noqa: E402


PHASES = ("rollout", "forward", "backward", "optimizer step")


class Iteration:
    """The inputs of one GRPO iteration and the iteration itself, for any model/backward/step."""

    def __init__(self, tcfg: dict, batch: int, steps: int, resolution: int, text_tokens: int, device: torch.device):
        from grpo.objectives.grpo import trained_transitions
        from grpo.models.flux1 import FLUX1
        from grpo.sde import shifted_sigmas

        g = torch.Generator().manual_seed(0)
        latent = 2 * (resolution // 8)  # tiny VAE: scale factor 4
        self.init = FLUX1.pack(torch.randn(batch, tcfg["in_channels"] // 4, latent, latent, generator=g)).to(device)
        embeds = {"prompt_embeds": torch.randn(batch, text_tokens, tcfg["joint_attention_dim"], generator=g),
                  "pooled": torch.randn(batch, tcfg["pooled_projection_dim"], generator=g)}
        self.cond = FLUX1.conditioning(embeds, latent, 3.5, tcfg["guidance_embeds"], device, torch.float32)
        self.sigmas = shifted_sigmas(steps, 3.0)
        self.k = trained_transitions(steps, 0.6)
        self.trained = list(range(0, steps - 1, max(1, (steps - 1) // self.k)))[: self.k]
        self.advantages = torch.randn(batch, generator=g).to(device)
        self.batch = batch
        self.phases: dict[str, float] = {}  # wall seconds of the last call, by phase

    def __call__(self, model, backward, step, rollout=None) -> None:
        """`rollout()`: a context giving the module to sample with (the model itself by default)."""
        from grpo.loss import grpo_loss
        from grpo.models.flux1 import FLUX1
        from grpo.rollout import SDEParams, sample, transition

        phases = dict.fromkeys(PHASES, 0.0)
        last = time.perf_counter()

        def lap(phase: str) -> None:  # the benchmark runs on the CPU: no device sync needed between phases
            nonlocal last
            now = time.perf_counter()
            phases[phase] += now - last
            last = now

        sde = SDEParams(0.7, "dance")
        with torch.no_grad(), (rollout or (lambda: contextlib.nullcontext(model)))() as sampler:
            traj = sample(FLUX1.velocity_of(sampler), self.cond, self.init, self.sigmas, sde,
                          [torch.Generator().manual_seed(i) for i in range(self.batch)])
        lap("rollout")
        for j in self.trained:
            out = transition(FLUX1.velocity_of(model), self.cond, traj.latents, self.sigmas, j, sde)
            loss, _ = grpo_loss(out.log_prob, traj.log_probs[:, j], self.advantages, clip_range=1e-4)
            lap("forward")
            backward(loss)
            lap("backward")
            step()
            lap("optimizer step")
        self.phases = phases


def plain(model: torch.nn.Module, max_norm: float = 1.0):
    from grpo.device import fused_adamw

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=1e-4, fused=fused_adamw(None))  # the recipe's
    calls = {"n": 0}

    def backward(loss):
        loss.backward()

    def step(k: int):
        calls["n"] += 1
        if calls["n"] % k == 0:  # accumulate over the iteration's transitions, like the engine
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return backward, step


def deepspeed_engine(tcfg: dict, it: Iteration, steps: int, *overrides: str):
    from grpo import device as dev
    from grpo.config import load_config
    from grpo.layout import derive_layout
    from grpo.inputs import load_ds_config

    dev.init_distributed()
    cfg = load_config(ROOT / "recipes/configs/tiny/grpo_full.yaml",
                      ["batch.prompts_per_step=1", f"sampling.group_size={it.batch}",
                       f"batch.micro_batch_size={it.batch}", f"sampling.num_steps={steps}",
                       "grpo.timestep_fraction=0.6", "optim.lr=1e-5", "deepspeed.config=ds_configs/zero3_fp32.json",
                       *overrides])
    layout = derive_layout(cfg, 1)
    assert layout.grad_accum_steps == it.k, (layout.grad_accum_steps, it.k)
    ds = load_ds_config(cfg.deepspeed.config, cfg, layout)
    engine, _ = load_recipe().build_policy(build_transformer(tcfg), cfg, ds)
    return engine


def engine_iteration(it: Iteration, engine):
    """The recipe's iteration on a ZeRO-3 engine: the rollout on the module gathered once (deepspeed.
    gather_for_rollout, on in every preset), the update through the engine's hooks."""
    from grpo.engine import inference_module

    return lambda: it(engine, engine.backward, engine.step, rollout=lambda: inference_module(engine, gather=True))


@contextlib.contextmanager
def torch_linear():
    """DeepSpeed's zero.Init swaps torch.nn.functional.linear for its ZeRO-3 autograd function, process-wide and
    for good (zero3_linear_wrap, ds_config memory_efficient_linear); the plain run gets torch's own back."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patched

    saved = torch.nn.functional.linear
    torch.nn.functional.linear = getattr(patched, "linear_bk", saved)
    try:
        yield
    finally:
        torch.nn.functional.linear = saved


def timed(fn, device: torch.device) -> float:
    return wall_and_cpu(fn, device)[0]


def profile_table(fn, rows: int = 10) -> tuple[str, float]:
    """torch.profiler's top ops by self CPU time, and the share of time in matmul/attention kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    dense = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention",
             "aten::_flash_attention", "aten::_scaled_dot_product_efficient_attention", "aten::linear_backward")
    matmul = sum(e.self_cpu_time_total for e in events if e.key.startswith(dense))
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]
    lines = [f"    {e.key:<58}{e.self_cpu_time_total / total:7.1%}  ({e.count} calls)" for e in top]
    return "\n".join(lines), matmul / total


def main(argv: list[str] | None = None) -> int:
    from grpo.models.blocks import compile_seconds

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, repeats=3, smoke_steps=3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the engine with model.compile (default: on, off with --smoke)")
    args = parser.parse_args(argv)
    with_compile = args.compile if args.compile is not None else not args.smoke
    smoke_workload(args)
    device = torch.device("cpu")
    tcfg = transformer_config(args.preset)
    it = Iteration(tcfg, args.batch, args.steps, args.resolution, args.text_tokens, device)

    model = build_transformer(tcfg).to(device).train()
    backward, step = plain(model)
    plain_iteration = lambda: it(model, backward, lambda: step(it.k))  # noqa: E731
    flops, _ = count_flops(plain_iteration)

    def run_plain():
        with torch_linear():
            plain_iteration()

    runs = {"plain": run_plain, "zero3": engine_iteration(it, deepspeed_engine(tcfg, it, args.steps)),
            "zero3 blocks": engine_iteration(it, deepspeed_engine(tcfg, it, args.steps, "deepspeed.fetch_blocks=true"))}
    rate = matmul_flops(device)
    for run in runs.values():  # warm-up (allocations, DeepSpeed's first trace)
        run()
    if with_compile:
        compiled = engine_iteration(it, deepspeed_engine(tcfg, it, args.steps, "model.compile=true"))
        compiling = compile_seconds()
        warm = timed(compiled, device)  # the compiled engine's warm-up compiles the blocks (forward, backward)
        compile_s = compile_seconds() - compiling
        runs["zero3+compile"] = compiled
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    phases: dict[str, list[dict[str, float]]] = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved: each round sees the same load on the shared cores
        for k, fn in runs.items():
            wall, used, _ = wall_and_cpu(fn, device)
            times[k].append(wall)
            cpu[k].append(used)
            phases[k].append(it.phases)
    rate = max(rate, matmul_flops(device))
    plain_table, plain_share = profile_table(runs["plain"])
    zero3_table, zero3_share = profile_table(runs["zero3"], rows=16)

    median = {k: statistics.median(v) for k, v in times.items()}
    eff = {k: flops / t / rate for k, t in median.items()}

    def per_round(k: str, t: dict[str, list[float]] = times) -> float:
        return statistics.median(a / b for a, b in zip(t[k], t["plain"]))

    def extra(k: str, phase: str | None = None) -> float:
        """Seconds run k takes over plain per iteration (or in one phase): median of the per-round differences."""
        t = times if phase is None else {r: [p[phase] for p in phases[r]] for r in ("plain", k)}
        return statistics.median(a - b for a, b in zip(t[k], t["plain"]))

    n = sum(p.numel() for p in model.parameters())
    print(f"one GRPO iteration, preset {args.preset} ({n / 1e6:.1f} M params, full fine-tune, fp32): {args.batch} "
          f"images x {args.steps} steps at {args.resolution}px, {it.k} trained transitions; "
          f"{torch.get_num_threads()} thread(s); median of {args.repeats} interleaved rounds")
    print(f"  FLOPs per iteration           {flops / 1e9:10.1f} GFLOP (FlopCounterMode)")
    print(f"  machine matmul rate           {rate / 1e9:10.1f} GFLOP/s (1024^3 fp32, best)")
    for k, t in median.items():
        print(f"  {k:<14} iteration {t:8.2f} s  {flops / t / 1e9:8.1f} GFLOP/s  efficiency {eff[k]:.3f}  "
              f"(rounds: {', '.join(f'{x:.2f}' for x in times[k])})")
    for k, what in (("zero3", "DeepSpeed ZeRO-3 overhead (1 process)"),
                    ("zero3 blocks", "the same with deepspeed.fetch_blocks (one fetch a FLUX block)")):
        print(f"  {what}: {per_round(k) - 1:+.1%} wall time ({extra(k):+.2f} s), {per_round(k, cpu) - 1:+.1%} CPU "
              "time (medians of the per-round ratios and differences to plain)")
        print(f"    by phase, wall s (plain -> {k}, difference): " + "; ".join(
            f"{ph} {statistics.median(p[ph] for p in phases['plain']):.2f} -> "
            f"{statistics.median(p[ph] for p in phases[k]):.2f} ({extra(k, ph):+.2f})" for ph in PHASES))
    if with_compile:
        print(f"  ZeRO-3 + model.compile: {per_round('zero3+compile') - 1:+.1%} time vs plain; compile time (its "
              f"warm-up, apart from the above) {compile_s:.1f} s, warm-up iteration {warm:.1f} s")
    print(f"  where the plain iteration's time goes (self CPU time; {plain_share:.0%} in matmul/attention):")
    print(plain_table)
    print(f"  where the ZeRO-3 iteration's time goes (self CPU time; {zero3_share:.0%} in matmul/attention):")
    print(zero3_table)
    print(f"step_efficiency: {eff['zero3']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
