"""ZeRO-3 memory, measured side by side: model states per rank on 1 and 2 processes (full fine-tune and LoRA), the
extra memory of the KL reference (full: a second sharded engine; LoRA: the policy with adapters off), the planner's
predictions for the same runs, and host memory of loading a transformer (zero.Init + safetensors vs from_pretrained
on every rank).

    python benchmarks/zero3_memory.py [--preset small] [--load-preset medium] [--smoke]

Model states are read from DeepSpeed's own buffers after one optimizer step (benchmarks/_common.engine_state_bytes)
and cross-checked against every tensor alive in the process. Loading memory is the peak resident set (VmHWM) of each
process over the load and partitioning, minus its resident set before, summed over the processes.

Headline: `zero3_state_ratio: S`, full fine-tune model-state bytes per rank on 2 processes over 1 (goal <= 0.55).
Workers (run by this script under torchrun): --worker states | load | load-check.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import (ROOT, engine_state_bytes, hwm, live_tensor_bytes, mb, reset_peak_rss, rss,  # noqa: E402
                                transformer_config, write_model_folder)
from tools._recipe import load_recipe  # noqa: E402
from tools.launch import launch_env, run_torchrun  # noqa: E402

FULL, LORA = "recipes/configs/tiny/grpo_full.yaml", "recipes/configs/tiny/grpo_lora.yaml"
DS_FP32 = "ds_configs/zero3_fp32.json"
RUNS = {"full": (FULL, 0.0), "full+reference": (FULL, 0.1), "lora": (LORA, 0.0), "lora+reference": (LORA, 0.1)}
# 4 images a step, micro-batch 2: valid on 1 and 2 processes.
BATCH = ["batch.prompts_per_step=2", "sampling.group_size=2", "batch.micro_batch_size=2", "data.eval_prompts=null"]
TEXT_TOKENS = 32
ACT_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
# (lora, checkpointing) cases of the activation check: plain, all blocks, every 2nd / 3rd block.
ACT_CASES = [(False, False), (True, False), (False, True), (True, True), (False, 2), (True, 3)]


def recipe_config(yaml: str, kl: float, extra: list[str] = ()):
    from grpo.config import load_config

    return load_config(ROOT / yaml, [*BATCH, f"grpo.kl_coef={kl}", f"deepspeed.config={ROOT / DS_FP32}", *extra])


def filled_ds(cfg, world: int, one_step: bool = True) -> dict:
    """The recipe's DeepSpeed config; one_step: accumulation 1, so a single backward already steps the optimizer
    (its state exists only after a step)."""
    from grpo.layout import derive_layout
    from grpo.inputs import load_ds_config

    ds = load_ds_config(cfg.deepspeed.config, cfg, derive_layout(cfg, world))
    if one_step:
        ds.update(gradient_accumulation_steps=1, train_batch_size=ds["train_micro_batch_size_per_gpu"] * world)
    return ds


# ------------------------------------------------------------------------------------------------------ workers
def worker_states(preset: str, out: Path) -> None:
    """Every run of RUNS in turn: build the engine(s), one optimizer step, account the bytes (rank 0 writes)."""
    import torch.distributed as dist

    from benchmarks._common import build_transformer
    from grpo import device as dev
    from grpo import engine as eng
    from tools.plan import transformer_inputs

    info = dev.init_distributed()
    tcfg = transformer_config(preset)
    results = {}
    for name, (yaml, kl) in RUNS.items():
        cfg = recipe_config(yaml, kl)
        ds = filled_ds(cfg, info.world_size)
        gc.collect()
        before = live_tensor_bytes()
        engine, _ = load_recipe().build_policy(build_transformer(tcfg), cfg, ds)
        reference = None
        if kl > 0 and cfg.lora is None:
            reference = eng.build_reference(build_transformer(tcfg), ds)
        inputs = transformer_inputs(tcfg, 2, 64, 8, torch.float32, device=info.device)
        loss = engine(**inputs)[0].float().square().mean()
        engine.backward(loss)
        engine.step()
        del loss
        with torch.no_grad():  # the reference forward: nothing of it may stay behind
            if reference is not None:
                reference(**inputs)
            elif kl > 0:
                engine.module.disable_adapters()
                engine(**inputs)
                engine.module.enable_adapters()
        gc.collect()
        results[name] = {"policy": engine_state_bytes(engine),
                         "reference": engine_state_bytes(reference) if reference is not None else {"weights": 0},
                         "live_bytes": live_tensor_bytes() - before,
                         "params": sum(p.ds_numel for p in engine.module.parameters()),
                         "trainable": sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad)}
        del engine, reference
        gc.collect()
    if info.rank == 0:
        out.write_text(json.dumps({"world": info.world_size, "runs": results}))
    dist.barrier()


def worker_load(model: Path, mode: str, out: Path) -> None:
    """Load the transformer (zero3: zero.Init + safetensors; naive: from_pretrained) and partition it."""
    import torch.distributed as dist

    from grpo import device as dev
    from grpo import engine as eng
    from grpo.loading import load_transformer_zero3
    from grpo.models.flux1 import FLUX1

    info = dev.init_distributed()
    ds = filled_ds(recipe_config(FULL, 0.0), info.world_size, one_step=False)
    import diffusers  # noqa: F401 -- imported before the baseline so that only the model is measured

    gc.collect()
    dist.barrier()
    base = rss()
    reset_peak_rss()
    model_fn = load_transformer_zero3 if mode == "zero3" else (lambda p, d, _: FLUX1.load_transformer(p, d))
    engine = eng.build_reference(model_fn(str(model), torch.float32, ds), ds)
    peak = hwm()
    rows = [None] * info.world_size
    dist.all_gather_object(rows, {"rank": info.rank, "base": base, "peak": peak, "after": rss(),
                                  "params": sum(p.ds_numel for p in engine.module.parameters())})
    if info.rank == 0:
        out.write_text(json.dumps(rows))
    dist.barrier()


def worker_load_check(folders: list[Path], out: Path) -> None:
    """For each folder: zero3-loaded weights == from_pretrained's (bit-exact), then LoRA + engine + a step work."""
    import deepspeed
    import torch.distributed as dist

    from grpo import device as dev
    from grpo import engine as eng
    from grpo.loading import load_transformer_zero3
    from grpo.models.flux1 import FLUX1
    from tools.plan import transformer_inputs

    info = dev.init_distributed()
    report = {}
    for folder in folders:
        ds_file = "ds_configs/zero3.json" if "bf16" in folder.name else DS_FP32
        cfg = recipe_config(LORA, 0.0, [f"deepspeed.config={ROOT / ds_file}"])
        ds = filled_ds(cfg, info.world_size)
        dtype = eng.precision(ds)
        model = load_transformer_zero3(str(folder), dtype, ds)
        params = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            got = {n: p.detach().clone() for n, p in params.items()}
        local_numel = sum(p.ds_tensor.numel() for p in params.values())
        expected = FLUX1.load_transformer(str(folder), dtype)
        mismatched = [n for n, t in expected.state_dict().items() if not torch.equal(got[n], t)]
        dtypes = sorted({str(t.dtype) for t in got.values()})
        del got
        engine, _ = load_recipe().build_policy(model, cfg, ds)  # adds the LoRA adapters
        tcfg = json.loads((folder / "transformer" / "config.json").read_text())
        inputs = transformer_inputs(tcfg, 2, 16, 8, dtype, device=info.device)
        out_engine = engine(**inputs)[0]
        with torch.no_grad():
            out_expected = expected(**inputs)[0]
        engine.backward(out_engine.float().square().mean())
        engine.step()
        lora = [p for n, p in engine.module.named_parameters() if "lora_" in n]
        with deepspeed.zero.GatheredParameters(lora, modifier_rank=None):
            checksum = torch.stack([p.detach().float().sum() for p in lora]).to(info.device)
        sums = [torch.zeros_like(checksum) for _ in range(info.world_size)]
        dist.all_gather(sums, checksum)
        report[folder.name] = {
            "mismatched": mismatched, "n_params": len(params), "dtypes": dtypes,
            "local_numel": local_numel, "full_numel": sum(p.ds_numel for p in params.values()),
            "lora_params": len(lora), "lora_same_on_all_ranks": all(torch.equal(s, sums[0]) for s in sums),
            "forward_max_diff": (out_engine.detach().float() - out_expected.float()).abs().max().item(),
        }
        del engine, model, expected
        gc.collect()
    if info.rank == 0:
        out.write_text(json.dumps({"world": info.world_size, "folders": report}))
    dist.barrier()


def worker_activations(preset: str, batch: int, resolution: int, lora: bool, checkpointing: str, out: Path) -> None:
    """One update forward + backward of the plain model on the CPU, memory read from the resident set. Run with
    MALLOC_MMAP_THRESHOLD_=65536 (see ACT_ENV) so that a freed tensor goes back to the OS at once and the peak
    resident set (VmHWM, reset before the step) follows the live tensors."""
    from peft import LoraConfig as PeftLoraConfig

    from benchmarks._common import build_transformer
    from grpo.models.blocks import enable_checkpointing
    from tools.plan import transformer_inputs

    torch.set_num_threads(1)
    tcfg = transformer_config(preset)
    model = build_transformer(tcfg).train()
    if lora:
        spec = recipe_config(LORA, 0.0).lora
        model.requires_grad_(False)
        model.add_adapter(PeftLoraConfig(r=spec.rank, lora_alpha=spec.alpha, init_lora_weights=spec.init,
                                         target_modules=spec.target_modules))
    enable_checkpointing(model, json.loads(checkpointing))
    for p in model.parameters():  # ZeRO-3 moves each gradient to its bucket at once; so do we
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    inputs = transformer_inputs(tcfg, batch, (resolution // 8) ** 2, TEXT_TOKENS, torch.float32, device="cpu")

    def step() -> int:
        out = model(**inputs)[0]
        after_forward = rss()
        out.float().square().mean().backward()
        return after_forward

    step()  # warm-up: lazily allocated buffers, thread pools
    gc.collect()
    base = rss()
    reset_peak_rss()
    after_forward = step() - base
    out.write_text(json.dumps({"after_forward": after_forward, "peak": hwm() - base}))


def predicted_activations(preset: str, batch: int, resolution: int, lora: bool, checkpointing) -> tuple[int, int]:
    from tools import plan as P

    spec = recipe_config(LORA, 0.0).lora if lora else None
    t = P.transformer_trace(transformer_config(preset), torch.float32, spec, batch, (resolution // 8) ** 2,
                            TEXT_TOKENS)
    saved, extra = t.update_bytes(checkpointing)
    return saved, saved + extra


def measure_activations(preset: str, batch: int, resolution: int, lora: bool, checkpointing, tmp: Path) -> dict:
    import subprocess

    out = tmp / "act.json"
    cmd = [sys.executable, __file__, "--worker", "activations", "--preset", preset, "--batch", str(batch),
           "--resolution", str(resolution), "--checkpointing", json.dumps(checkpointing), "--out", str(out)]
    if lora:
        cmd.append("--lora")
    env = launch_env(ACT_ENV, accelerator=None, unbuffered=False)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------------------- driver
def predicted_states(preset: str, world: int) -> dict[str, dict[str, int]]:
    """The planner's model-state and reference bytes for the same runs."""
    from tools import plan as P

    tcfg = transformer_config(preset)
    ds = json.loads((ROOT / DS_FP32).read_text())
    zero, b = P.zero_settings(ds), P.precision_bytes(ds)
    out = {}
    for name, (yaml, kl) in RUNS.items():
        cfg = recipe_config(yaml, kl)
        params = P.transformer_trace(tcfg, torch.float32, cfg.lora, 1, 16, 8).params
        states = P.model_states(params, world, b, zero)
        ref = P.model_states([(n, False) for n, _ in params], world, b, zero, optimizer=False)["weights"] if (
            kl > 0 and cfg.lora is None) else 0
        out[name] = {**states, "reference": ref}
    return out


def states_bytes(r: dict) -> int:
    return sum(r["policy"][k] for k in ("weights", "gradients", "master", "optimizer"))


def measure_states(preset: str, tmp: Path) -> dict[int, dict]:
    res = {}
    for world in (1, 2):
        out = tmp / f"states_{world}.json"
        run_torchrun(world, [__file__, "--worker", "states", "--preset", preset, "--out", str(out)],
                     accelerator=None)
        res[world] = json.loads(out.read_text())["runs"]
    return res


def measure_loading(preset: str, tmp: Path, allocators: dict[str, dict]) -> dict[tuple[str, str], list[dict]]:
    folder = write_model_folder(tmp / f"model_{preset}", transformer_config(preset), max_shard_size="100MB")
    res = {}
    for alloc, env in allocators.items():
        for mode in ("naive", "zero3"):
            out = tmp / f"load_{mode}.json"
            run_torchrun(2, [__file__, "--worker", "load", "--mode", mode, "--model", str(folder), "--out", str(out)],
                         extra_env=env, accelerator=None)
            res[mode, alloc] = json.loads(out.read_text())
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="transformer preset for the model states")
    parser.add_argument("--load-preset", default="medium", help="transformer preset for the loading measurement")
    parser.add_argument("--smoke", action="store_true", help="tiny presets (a test of the script, not a benchmark)")
    parser.add_argument("--skip-loading", action="store_true")
    parser.add_argument("--act-batch", type=int, default=2, help="micro-batch of the activation check")
    parser.add_argument("--act-resolution", type=int, default=256, help="resolution of the activation check")
    parser.add_argument("--worker", choices=["states", "load", "load-check", "activations"], help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--resolution", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", default="false", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["naive", "zero3"], help=argparse.SUPPRESS)
    parser.add_argument("--model", nargs="*", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "states":
        worker_states(args.preset, args.out)
        return 0
    if args.worker == "load":
        worker_load(args.model[0], args.mode, args.out)
        return 0
    if args.worker == "load-check":
        worker_load_check(args.model, args.out)
        return 0
    if args.worker == "activations":
        worker_activations(args.preset, args.batch, args.resolution, args.lora, args.checkpointing, args.out)
        return 0
    if args.smoke:
        args.preset = args.load_preset = "tiny"
        args.act_resolution = 64

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        measured = measure_states(args.preset, tmp)
        allocators = {"default malloc": {}}
        if not args.smoke:  # glibc returns every freed block >= 64 KiB to the OS at once: RSS follows live memory
            allocators["MALLOC_MMAP_THRESHOLD_=65536"] = {"MALLOC_MMAP_THRESHOLD_": "65536"}
        loading = None if args.skip_loading else measure_loading(args.load_preset, tmp, allocators)
        acts = {case: measure_activations(args.preset, args.act_batch, args.act_resolution, *case, tmp)
                for case in ACT_CASES}
    predicted = {w: predicted_states(args.preset, w) for w in (1, 2)}

    print(f"model states per rank, preset {args.preset} ({measured[1]['full']['params'] / 1e6:.1f} M params), fp32 "
          f"({DS_FP32}), after one optimizer step; measured | planner")
    print(f"{'run':<16}{'world':>6}{'weights':>12}{'gradients':>12}{'master':>10}{'optimizer':>12}{'states':>12}"
          f"{'planner':>12}{'err':>8}{'reference':>12}{'all live':>12}")
    worst = 0.0
    for world in (1, 2):
        for name, r in measured[world].items():
            p = predicted[world][name]
            got = states_bytes(r)
            want = sum(p[k] for k in ("weights", "gradients", "master", "optimizer"))
            err = want / got - 1
            worst = max(worst, abs(err))
            pol = r["policy"]
            print(f"{name:<16}{world:>6}{mb(pol['weights']):>12}{mb(pol['gradients']):>12}{mb(pol['master']):>10}"
                  f"{mb(pol['optimizer']):>12}{mb(got):>12}{mb(want):>12}{err:>+8.1%}"
                  f"{mb(r['reference']['weights']):>12}"
                  f"{mb(r['live_bytes']):>12}")
    lora_ref = {w: states_bytes(measured[w]["lora+reference"]) + measured[w]["lora+reference"]["reference"]["weights"]
                - states_bytes(measured[w]["lora"]) for w in (1, 2)}
    full_ref = {w: measured[w]["full+reference"]["reference"]["weights"] for w in (1, 2)}
    print(f"reference extra per rank: LoRA (adapters off) {mb(lora_ref[1])} / {mb(lora_ref[2])} on 1 / 2 processes; "
          f"full fine-tune (second ZeRO-3 engine) {mb(full_ref[1])} / {mb(full_ref[2])}")
    print(f"planner vs measured model states: worst error {worst:.1%}")
    print("'all live' = every tensor alive after the step minus before the engine; it adds the reduce bucket "
          "(reduce_bucket_size elements, empty pages on a CPU) and small runtime tensors to the states")
    print(f"update activations, preset {args.preset}, micro-batch {args.act_batch}, {args.act_resolution}px "
          f"({(args.act_resolution // 8) ** 2} image + {TEXT_TOKENS} text tokens), fp32 on the CPU; measured "
          "(resident set) | planner (meta-device trace):")
    print(f"{'run':<8}{'checkpointing':>14}{'after forward':>15}{'planner':>11}{'err':>8}{'peak':>11}{'planner':>11}"
          f"{'err':>8}")
    worst_act = 0.0
    for (lora, ck), got in acts.items():
        saved, peak = predicted_activations(args.preset, args.act_batch, args.act_resolution, lora, ck)
        e1, e2 = saved / got["after_forward"] - 1, peak / got["peak"] - 1
        worst_act = max(worst_act, abs(e1), abs(e2))
        print(f"{'lora' if lora else 'full':<8}{str(ck):>14}{mb(got['after_forward']):>15}{mb(saved):>11}{e1:>+8.1%}"
              f"{mb(got['peak']):>11}{mb(peak):>11}{e2:>+8.1%}")
    print(f"planner vs measured activations: worst error {worst_act:.1%}"
          + (" (smoke: a few MiB, within page-level noise)" if args.smoke else ""))
    if loading is not None:
        print(f"loading a {args.load_preset} transformer on 2 processes (peak RSS over load + partition, minus the "
              "RSS before):")
        model_bytes = next(iter(loading.values()))[0]["params"] * 4
        for (mode, alloc), rows in loading.items():
            total = sum(r["peak"] - r["base"] for r in rows)
            per = ", ".join(f"rank {r['rank']} {mb(r['peak'] - r['base'])}" for r in rows)
            print(f"  {mode:<6} {alloc:<30} {per}; sum {mb(total)} = {total / model_bytes:.2f} model copies "
                  f"({mb(model_bytes)})")
    full = {w: states_bytes(measured[w]["full"]) for w in (1, 2)}
    print(f"zero3_state_ratio: {full[2] / full[1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
