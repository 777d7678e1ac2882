"""Held-out reward per unit of transformer compute: DanceGRPO against the fast flow-GRPO strategies, side by side.

Every strategy starts from the same base model (assets/tiny-flux) with its tiny preset (recipes/configs/tiny/*.yaml:
the same batch, LoRA, learning rate and seeds as the default run), and gets the same budget of transformer compute,
counted in forward-equivalents per image (a rollout step or a no-grad forward costs 1, a trained transition or noise
level 3: its forward and a backward that costs 2). The
baseline runs `--budget-steps` steps; each strategy runs as many steps as fit in the baseline's compute. The
held-out reward (eta = 0, the same fixed noise for every run, so the comparison is paired) is read every few steps.

    python benchmarks/time_to_reward.py [--budget-steps 40] [--only NAME ...] [--seeds 42 43 44] [--eval-seeds N]
                                        [--eval-cfg-scale W] [--family flux1|flux2] [--ceiling R]
                                        [--out runs/time_to_reward] [--reuse | --report-only] [--smoke]

`--family flux2` runs the same presets on the tiny FLUX.2 [klein] world (assets/tiny-flux2): each resolved with
recipes/configs/tiny_flux2/base.yaml, the tiny FLUX.2 model base, in place of tiny/base.yaml.

Every strategy trains once per training seed, three by default (42 43 44: one seed's reading moved 2x between seeds
before, RESULTS.md "Goal 1 met"); each seed's evals are paired across strategies (the eval noise is a function of the
seed). Per seed a strategy reads its speed-up against the baseline's run of that seed, its final held-out gain over
the seed's step-0 eval, and that gain's share of the gap from the step-0 eval to `--ceiling` (what ground-truth
images score on the family's tiny world); over the seeds, each reading's mean, worst seed and spread (sample std,
min .. max: benchmarks/_seeds.py). The curves averaged over the seeds are plotted and read too (the speed-up of the
mean curve, as the headline was read before 2026-12-07).

Speed-up = compute the baseline needs to reach its final held-out gain / compute the strategy needs to reach the same
gain (linear between eval points; 0 when it never does). Headline (last line): `time_to_reward_speedup: M (NAME,
mean of 3 seeds; worst seed S: W)`, the best strategy's mean per-seed speed-up with its worst seed beside it.
The compute a strategy spends per step comes from grpo's own window and solver functions, and is checked against
the `forwards_per_image` each run logs. `--report-only` trains nothing: it rebuilds the tables from the runs saved
under `--out` (each run's metrics.jsonl; `seeds.json` holds the per-seed readings the last invocation printed).

The default budget is 40 DanceGRPO steps. With 20, the baseline's final gain was +0.011 over two seeds (+0.017 and
+0.004, where one seed's 144-image eval has a paired standard error of about 0.007), so the headline read the start of
the curves, where they are still in the noise; at 40 its gain is +0.022 to +0.030 on each of three seeds
(benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._seeds import headline, summary_lines  # noqa: E402
from grpo.config import load_config  # noqa: E402
from grpo.rollout_plan import RolloutPlan  # noqa: E402
from grpo.schema import read_preset  # noqa: E402
from tools.launch import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# name -> (preset, overrides, what it is). The fast presets scale their sources' windows to the tiny world's 6 steps;
# nft and awm follow Flow-Factory's FLUX examples (2 noise levels per image). Every preset shares the default run's
# batch, LoRA, learning rate and seed.
CFG = ["sampling.true_cfg.scale=4.0"]
STRATEGIES: dict[str, tuple[str, list[str], str]] = {
    "dancegrpo": ("recipes/configs/tiny/grpo_lora.yaml", [], "every step SDE, every transition trained (DanceGRPO)"),
    "mixgrpo": ("recipes/configs/tiny/mixgrpo_lora.yaml", [], "Flow-SDE window of 2 sliding every 4 steps (MixGRPO)"),
    "mixgrpo_flash": ("recipes/configs/tiny/mixgrpo_flash_lora.yaml", [], "MixGRPO + DPM-Solver++(2M) tail (Flash)"),
    "flash_frozen": ("recipes/configs/experimental/tiny_mixgrpo_flash_frozen_lora.yaml", [],
                     "Flow-SDE at step 0 only + DPM-Solver++(2M) tail (Flash*)"),
    "flowgrpo_fast": ("recipes/configs/tiny/flowgrpo_fast_lora.yaml", [], "CPS window of 2, random start (Fast)"),
    "flashgrpo": ("recipes/configs/tiny/flashgrpo_lora.yaml", [],
                  "one SDE step per group, shared, its loss rescaled per timestep (Flash-GRPO)"),
    "branchgrpo": ("recipes/configs/tiny/branchgrpo_lora.yaml", [], "trees of 4 splitting at steps 0, 2 (BranchGRPO)"),
    "nft": ("recipes/configs/tiny/nft_lora.yaml", [], "DiffusionNFT: ODE rollouts, implicit +/- policies"),
    "nft_dpm": ("recipes/configs/tiny/nft_lora.yaml", ["sampling.tail=dpm2", "sampling.compress_ratio=0.5"],
                "DiffusionNFT, rollouts by DPM-Solver++(2M) in 3 calls (its source's solver)"),
    # AWM as its source (one noise per image); the preset shares a group's (awm_group_noise)
    "awm": ("recipes/configs/tiny/awm_lora.yaml", ["awm.group_noise=false"],
            "AWM: ODE rollouts, advantage-weighted matching"),
    "grpo_candidates": ("recipes/configs/experimental/tiny_grpo_candidates_lora.yaml", [],
                        "DanceGRPO on the best 2 + worst 2 of 8 candidates, previewed in 3 ODE steps (Sol-RL)"),
    "nft_candidates": ("recipes/configs/tiny/nft_candidates_lora.yaml", [],
                       "DiffusionNFT on the best 2 + worst 2 of 8 candidates, previewed in 3 ODE steps (Sol-RL)"),
    "awm_t1": ("recipes/configs/tiny/awm_lora.yaml", ["awm.timesteps=1", "awm.group_noise=false"],
               "AWM at one noise level per image instead of 2 (a cheaper update)"),
    "awm_t1_lr2": ("recipes/configs/tiny/awm_lora.yaml", ["awm.timesteps=1", "optim.lr=2e-3", "awm.group_noise=false"],
                   "AWM at one noise level per image, lr 2e-3 (measured: no faster start)"),
    "awm_group_noise": ("recipes/configs/tiny/awm_lora.yaml", ["awm.group_noise=true"],
                        "AWM, a group's images noised with one eps at a point (common random numbers)"),
    "awm_t1_group_noise": ("recipes/configs/tiny/awm_lora.yaml", ["awm.timesteps=1", "awm.group_noise=true"],
                           "AWM at one noise level per image, a group's images noised with one eps"),
    "awm_t1_group8": ("recipes/configs/tiny/awm_lora.yaml", ["awm.timesteps=1", "awm.group_noise=true",
                                                             "sampling.group_size=8", "batch.prompts_per_step=8"],
                      "AWM at one noise level, groups of 8 (8 prompts a step) sharing their noise (measured: slower)"),
    "awm_t1_no_anchor": ("recipes/configs/tiny/awm_lora.yaml", ["awm.timesteps=1", "awm.group_noise=true",
                                                                "awm.anchor_coef=0"],
                         "AWM at one noise level, group noise, no anchor: 9 forwards a step, not 10 (measured: faster "
                         "start, lower end)"),
    "awm_t1_no_anchor_4": ("recipes/configs/tiny/awm_lora.yaml", ["awm.timesteps=1", "awm.group_noise=true",
                                                                  "awm.anchor_coef=0", "sampling.num_steps=4",
                                                                  "sampling.eval_num_steps=6"],
                           "the same on 4-step rollouts, evals on 6 (Flow-GRPO's denoising reduction): 7 a step"),
    "awm_t1_no_anchor_3": ("recipes/configs/tiny/awm_lora.yaml", ["awm.timesteps=1", "awm.group_noise=true",
                                                                  "awm.anchor_coef=0", "sampling.num_steps=3",
                                                                  "sampling.eval_num_steps=6"],
                           "the same on 3-step rollouts, evals on 6: 6 a step, every noise level at sigma 0.86"),
    "awm_t1_3": ("recipes/configs/tiny/awm_lora.yaml", ["awm.timesteps=1", "awm.group_noise=true", "sampling.num_steps=3",
                                                      "sampling.eval_num_steps=6"],
                 "AWM at one noise level, group noise, the anchor kept, on 3-step rollouts, evals on 6: 7 a step"),
    "nft_group_noise": ("recipes/configs/tiny/nft_lora.yaml", ["nft.group_noise=true"],
                        "DiffusionNFT, a group's images noised with one eps at a point (common random numbers)"),
    "awm_candidates": ("recipes/configs/tiny/awm_lora.yaml", ["awm.group_noise=false", *(
        f"sampling.candidates.{k}={v}"
        for k, v in (("pool", 8), ("keep_top", 2), ("keep_bottom", 2), ("preview_steps", 3)))],
                       "AWM on the best 2 + worst 2 of 8 candidates, previewed in 3 ODE steps (Sol-RL)"),
    # GARDO (tinnerhrhe/GARDO@1cc77fb, config/gardo.py:hps_flux) at its defaults: a share of 0.1, kl_coef 0.01 and
    # kl_threshold 3e-4 on KL·dt, a refresh every 16 steps. Scaled: the tiny world has no aesthetic or ImageReward
    # model, so JPEG compressibility (scored at weight 0, trained on by nothing) is the one auxiliary reward whose
    # rank disagreement with tiny_world gates the KL; 64 images a step rank against each other, not GARDO's 1152.
    "dancegrpo_gardo": ("recipes/configs/tiny/grpo_lora.yaml",
                        ["rewards={tiny_world: 1.0, jpeg_compressibility: 0.0}",
                         "grpo.gardo.aux_rewards=[jpeg_compressibility]"],
                        "DanceGRPO + GARDO's KL on the samples JPEG size ranks apart, to a reference refreshed "
                        "every 16 steps or when that KL passes 3e-4"),
    # Flow-DPPO's trust region acts only off-policy: the tiny presets make one update a rollout (ratio exactly 1,
    # nothing clipped or masked), so both arms take DanceGRPO's own 2 update blocks a rollout, and differ only in
    # the clip (1e-4, DanceGRPO's) or the KL mask at the threshold of UniRL@1a7b501 and verl-omni@a1139ba (1e-5).
    "dancegrpo_u2": ("recipes/configs/tiny/grpo_lora.yaml", ["batch.updates_per_step=2"],
                     "DanceGRPO, 2 update blocks a rollout (its own), the ratio clipped at 1e-4"),
    "dancegrpo_dppo": ("recipes/configs/tiny/grpo_lora.yaml",
                       ["batch.updates_per_step=2", "grpo.trust_region={kl_threshold: 1.0e-5}"],
                       "DanceGRPO, 2 update blocks a rollout, Flow-DPPO's KL mask (1e-5) in place of the clip"),
    "opgrpo": ("recipes/configs/experimental/tiny_opgrpo_lora.yaml", [],
               "DanceGRPO + a replay block of past best trajectories a step, importance-weighted (OP-GRPO)"),
    # True CFG in the rollouts (Flux2KleinPipeline's scale 4, negative prompt ""): for a non-distilled model such as
    # the tiny FLUX.2 [klein] world; read with --eval-cfg-scale, so every run is judged at one inference setting
    "dancegrpo_cfg": ("recipes/configs/tiny/grpo_lora.yaml", [*CFG],
                      "DanceGRPO with true CFG 4 in the rollouts and the update (the guided transitions)"),
    "nft_cfg": ("recipes/configs/tiny/nft_lora.yaml", [*CFG, "sampling.true_cfg.train=conditional"],
                "DiffusionNFT on rollouts with true CFG 4, training the conditional velocity"),
    "nft_cfg_guided": ("recipes/configs/tiny/nft_lora.yaml", [*CFG, "sampling.true_cfg.train=guided"],
                       "DiffusionNFT on rollouts with true CFG 4, training the guided velocity"),
    "awm_group_noise_cfg": ("recipes/configs/tiny/awm_lora.yaml", [*CFG, "sampling.true_cfg.train=conditional"],
                            "AWM (group noise) on rollouts with true CFG 4, training the conditional velocity "
                            "(AWM's train.cfg False)"),
    "awm_group_noise_cfg_guided": ("recipes/configs/tiny/awm_lora.yaml", [*CFG, "sampling.true_cfg.train=guided"],
                                   "AWM (group noise) on rollouts with true CFG 4, training the guided velocity "
                                   "(AWM's train.cfg True)"),
}

# The model base each family's runs resolve the strategy presets on, in place of the tiny FLUX.1 world's (their own:
# None): the same objective, strategy and tiny-world settings on another model (grpo.schema.read_preset's swap).
FAMILIES = {"flux1": None, "flux2": "recipes/configs/tiny_flux2/base.yaml"}
TINY_BASE = "recipes/configs/tiny/base.yaml"
# What ground-truth images score on each family's tiny world (docs/tiny_world.md; FLUX.1's is the one docs/results.md
# reads its shares against): a seed's final gain is read as a share of the gap from its step-0 eval to it.
CEILINGS = {"flux1": 0.9966, "flux2": 0.9952}
SEEDS = [42, 43, 44]

SMOKE = ["batch.prompts_per_step=4", "sampling.group_size=2", "batch.micro_batch_size=4", "logging.eval_seeds=1",
         "logging.tensorboard=false", "logging.sample_every=0", "logging.progress=false"]


def preset_file(name: str, family: str, folder: Path) -> str:
    """The preset a strategy's runs use on `family`: its own file, or that preset resolved on the family's model base
    and written into `folder` (one file the recipe reads)."""
    preset = STRATEGIES[name][0]
    if FAMILIES[family] is None:
        return preset
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}_{family}.yaml"
    out.write_text(yaml.safe_dump(read_preset(ROOT / preset, swap={ROOT / TINY_BASE: ROOT / FAMILIES[family]})))
    return str(out)


def strategy_config(name: str, extra: list[str], family: str = "flux1"):
    """The settings a strategy's runs use: its preset (on the family's model base), its own overrides, then `extra`."""
    own = STRATEGIES[name][1]
    with tempfile.TemporaryDirectory() as tmp:
        return load_config(preset_file(name, family, Path(tmp)), [*own, *extra])


def step_cost(cfg, step: int) -> float:
    """Forward-equivalents per image of step `step`: the recipe's own cost model (grpo/rollout_plan.py), the
    objective's extra blocks as it expects them (e.g. grpo.replay's block from the step its buffer first holds one,
    assuming each step adds per_step trajectories; `curve` checks it against the log)."""
    return RolloutPlan.of(cfg).forwards_per_image(step)


def steps_within(cfg, budget: float) -> int:
    """How many steps of `cfg` fit in `budget` forward-equivalents per image (at least 1)."""
    spent, n = 0.0, 0
    while spent + step_cost(cfg, n) <= budget + 1e-9:
        spent += step_cost(cfg, n)
        n += 1
    return max(n, 1)


def run(name: str, family: str, overrides: list[str], steps: int, eval_every: int, run_dir: Path,
        reuse: bool, train: bool = True) -> list[dict]:
    """A run's metrics rows: a finished run's under `run_dir` with `reuse` (or without `train`), else trained now."""
    metrics = run_dir / "metrics.jsonl"
    if (reuse or not train) and (run_dir / "final").exists() and metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        ran = 1 + max((r["step"] for r in rows if "forwards_per_image" in r), default=-1)
        if ran != steps:
            raise SystemExit(f"{run_dir}: a run of {ran} steps, this budget gives {name} {steps}; give the "
                             f"--budget-steps it ran with, or another --out")
        return rows
    if not train:
        raise SystemExit(f"{run_dir}: no finished run of {name} (--report-only trains nothing; drop it, with --reuse, "
                         f"to train what is missing)")
    own = STRATEGIES[name][1]
    preset = preset_file(name, family, run_dir.parent / "presets")
    # The trained weights are read, not an EMA (awm_lora.yaml's default run keeps one): an average lags the curve
    # the benchmark times, and every strategy is compared on the same footing.
    cmd = ["bash", str(ROOT / "launch" / "run.sh"), preset, *own, *overrides, f"output_dir={run_dir}",
           f"max_steps={steps}", f"logging.eval_every={eval_every}", "checkpoint.every=0", "logging.progress=false",
           "ema.decay=null"]
    env = {**os.environ, "MASTER_PORT": str(free_port())}  # two benchmarks (or a run) on one machine must not collide
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def curve(rows: list[dict], cfg) -> list[tuple[float, float]]:
    """(compute per image spent before the eval, held-out reward) at every eval of a run; checks the cost model."""
    spent, out = {0: 0.0}, []
    for r in rows:
        if "forwards_per_image" in r:
            expected = step_cost(cfg, r["step"])
            if r["forwards_per_image"] != expected:
                raise SystemExit(f"step {r['step']}: the run logged {r['forwards_per_image']} forwards per image, "
                                 f"the cost model says {expected}")
            spent[r["step"] + 1] = spent[r["step"]] + expected
    for r in rows:
        if "eval/reward_mean" in r:
            out.append((spent[r["step"]], r["eval/reward_mean"]))
    return out


def compute_to_reach(points: list[tuple[float, float]], gain: float) -> float | None:
    """The compute at which the held-out gain over the first eval first reaches `gain` (linear between evals)."""
    base = points[0][1]
    for (c0, r0), (c1, r1) in zip(points, points[1:]):
        if r1 - base >= gain:
            g0 = r0 - base
            return c1 if r1 == r0 else c0 + (c1 - c0) * max(0.0, (gain - g0) / (r1 - r0))
    return None


def speedup(base: list[tuple[float, float]], other: list[tuple[float, float]]) -> tuple[float, float | None, float]:
    """(the baseline's final gain, the compute `other` needs to reach it or None, the speed-up: the compute the
    baseline first reached it at over that; 0 when either never does)."""
    gain = base[-1][1] - base[0][1]
    need_base = compute_to_reach(base, gain) if gain > 0 else None
    need = compute_to_reach(other, gain) if need_base is not None else None
    return gain, need, need_base / need if need else 0.0


def seed_readings(base: list[list[tuple[float, float]]], other: list[list[tuple[float, float]]],
                  ceiling: float) -> dict[str, list[float | None]]:
    """Per training seed, `other`'s run against the baseline's run of that seed: the speed-up (None where that baseline
    gained nothing: no reading), the final held-out gain over the seed's step-0 eval, and its share of the gap from
    that eval to `ceiling`."""
    out = {"speed-up": [], "final gain": [], "share of the gap": []}
    for b, c in zip(base, other, strict=True):
        gain = c[-1][1] - c[0][1]
        out["speed-up"].append(speedup(b, c)[2] if b[-1][1] > b[0][1] else None)
        out["final gain"].append(gain)
        out["share of the gap"].append(gain / (ceiling - c[0][1]))
    return out


def mean_curve(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The point-by-point mean of one strategy's curves over seeds (the same steps, so the same compute points)."""
    return [(pts[0][0], sum(r for _, r in pts) / len(pts)) for pts in zip(*curves)]


def plot(curves: dict[str, list[tuple[float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in curves.items():
        ax.plot([c for c, _ in pts], [r for _, r in pts], marker="o", label=name)
    ax.set_xlabel("transformer compute per image (forward-equivalents)")
    ax.set_ylabel("held-out reward (eta = 0)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-steps", type=int, default=40, help="baseline steps; its compute is everyone's budget")
    parser.add_argument("--evals", type=int, default=5, help="held-out evals per run after step 0")
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES), help="strategies to run (baseline first)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help=f"training seeds (default {' '.join(map(str, SEEDS))}; --smoke: the first two): every "
                             f"reading per seed, then its mean, worst seed and spread")
    parser.add_argument("--eval-seeds", type=int, default=None,
                        help="held-out images per prompt (default: the presets' logging.eval_seeds)")
    parser.add_argument("--eval-cfg-scale", type=float, default=None,
                        help="every run's held-out evals at this true CFG scale (sampling.eval_cfg_scale; 1 = none), "
                             "whatever its rollouts use; default: each run's own")
    parser.add_argument("--family", choices=list(FAMILIES), default="flux1",
                        help="flux2: the tiny FLUX.2 [klein] world (assets/tiny-flux2) instead of tiny FLUX.1")
    parser.add_argument("--ceiling", type=float, default=None,
                        help="what ground-truth images score, the top of the gap a gain is a share of (default: the "
                             "family's tiny world's, " + ", ".join(f"{k} {v}" for k, v in CEILINGS.items()) + ")")
    parser.add_argument("--out", default="runs/time_to_reward")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found under --out")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: the tables from the finished runs under --out (an error names a "
                             "missing one)")
    parser.add_argument("--smoke", action="store_true",
                        help="2 baseline steps on 8 images a step, baseline and MixGRPO-Flash only (tests the script)")
    args = parser.parse_args()
    extra = [*(SMOKE if args.smoke else [])]
    if args.eval_seeds is not None:
        extra = [*extra, f"logging.eval_seeds={args.eval_seeds}"]
    if args.eval_cfg_scale is not None:
        extra = [*extra, f"sampling.eval_cfg_scale={args.eval_cfg_scale}"]
    if args.smoke:
        args.only = ["mixgrpo_flash"]
    seeds = args.seeds or (SEEDS[:2] if args.smoke else SEEDS)
    ceiling = CEILINGS[args.family] if args.ceiling is None else args.ceiling
    budget_steps = 2 if args.smoke else args.budget_steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    names = ["dancegrpo"] + [n for n in args.only if n != "dancegrpo"]
    cfgs = {n: strategy_config(n, extra, args.family) for n in names}
    budget = sum(step_cost(cfgs["dancegrpo"], k) for k in range(budget_steps))
    curves, seed_curves = {}, {}
    print(f"budget: {budget:.0f} forward-equivalents per image ({budget_steps} DanceGRPO steps), "
          f"training seeds {seeds}")
    for n in names:
        steps = budget_steps if n == "dancegrpo" else steps_within(cfgs[n], budget)
        per_seed, wall = [], 0.0
        for seed in seeds:
            # The first seed keeps the strategy's own folder name, so --reuse finds one-seed runs of before.
            run_dir = out / (n if seed == seeds[0] else f"{n}_seed{seed}")
            rows = run(n, args.family, [*extra, f"seed={seed}"], steps, max(1, math.ceil(steps / args.evals)),
                       run_dir, args.reuse, train=not args.report_only)
            per_seed.append(curve(rows, cfgs[n]))
            wall += sum(r.get("step_time_s", 0.0) for r in rows)
        curves[n], seed_curves[n] = mean_curve(per_seed), per_seed
        gains = [c[-1][1] - c[0][1] for c in per_seed]
        print(f"{n:>14}: {steps:3d} steps, {step_cost(cfgs[n], 0):5.2f} fwd/image at step 0, train wall "
              f"{wall:6.1f} s | held-out {curves[n][0][1]:.4f} -> {curves[n][-1][1]:.4f} | gain per seed "
              f"{' '.join(f'{g:+.4f}' for g in gains)} | {STRATEGIES[n][2]}")
    (out / "curves.json").write_text(json.dumps(curves, indent=1))
    plot(curves, out / "time_to_reward.png")

    # each seed's runs against the baseline's run of that seed: what the summary over the seeds is of
    readings = {n: seed_readings(seed_curves["dancegrpo"], seed_curves[n], ceiling) for n in names}
    del readings["dancegrpo"]["speed-up"]  # 1 on every seed where it gained
    base = curves["dancegrpo"]
    gain, need_base, _ = speedup(base, base)
    print(f"baseline held-out gain {gain:+.4f} at {base[-1][0]:.0f} fwd/image (reached at {need_base}); the seed-mean "
          f"curves:")
    for n in names[1:]:
        _, need, ratio = speedup(base, curves[n])
        final = curves[n][-1][1] - curves[n][0][1]
        at_budget = f"{final / gain:.2f}x the baseline's" if gain > 0 else "-"
        own = ", ".join(f"{seed}: {'-' if x is None else f'{x:.2f}x'}"
                        for seed, x in zip(seeds, readings[n]["speed-up"]))
        print(f"{n:>14}: final gain {final:+.4f} ({at_budget}); reaches the baseline's gain at "
              f"{'never' if need is None else f'{need:.0f}'} fwd/image -> speed-up {ratio:.2f}x (per seed {own})")
    (out / "seeds.json").write_text(json.dumps({"seeds": seeds, "ceiling": ceiling, "readings": readings}, indent=1))
    print(f"over training seeds {' '.join(map(str, seeds))}: mean | worst (seed) | std | min .. max (share of the gap "
          f"from each seed's step-0 eval to {ceiling})")
    for n in names:
        print("\n".join(summary_lines(n, readings[n], seeds)))
    print(f"plot: {out / 'time_to_reward.png'}")
    print(headline({n: readings[n]["speed-up"] for n in names[1:]}, seeds))


if __name__ == "__main__":
    main()
