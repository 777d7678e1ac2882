"""Shared pieces of the benchmarks: model presets, random-weight model folders, the machine's matmul rate, memory
readings and FLOP counting (jobs start through tools.launch). Not a library module: benchmarks and their tests only."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-flux"

# Transformer sizes on top of the tiny model's (which fixes in_channels 16 for the tiny VAE and the RoPE axes).
# Parameters: a double block holds ~36 D^2, a single block ~15 D^2 (D = heads x head_dim).
PRESETS: dict[str, dict] = {
    "tiny": {},  # assets/tiny-flux itself: 2.3 M parameters
    # 'small' (~37 M): the step-efficiency and rollout preset, big enough that matmuls dominate on a CPU.
    "small": {"num_attention_heads": 8, "attention_head_dim": 64, "axes_dims_rope": [16, 24, 24],
              "num_layers": 2, "num_single_layers": 4, "joint_attention_dim": 512, "pooled_projection_dim": 128},
    # 'medium' (~82 M, ~330 MB in fp32): the loading-memory model ("a few hundred MB").
    "medium": {"num_attention_heads": 10, "attention_head_dim": 64, "axes_dims_rope": [16, 24, 24],
               "num_layers": 3, "num_single_layers": 6, "joint_attention_dim": 512, "pooled_projection_dim": 128},
}


def add_workload_args(parser, repeats: int, smoke_steps: int) -> None:
    """The CPU benchmarks' shared workload: transformer preset, micro-batch, steps, resolution, text tokens, repeats,
    and --smoke (tiny model, `smoke_steps` steps, 1 repeat: a test of the script). Apply with `smoke_workload`."""
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--text-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--smoke", action="store_const", const=smoke_steps, default=0,
                        help=f"tiny model, {smoke_steps} steps, 1 repeat (tests the script)")


def smoke_workload(args) -> None:
    if args.smoke:
        args.preset, args.batch, args.steps, args.resolution, args.repeats = "tiny", 2, args.smoke, 64, 1


def transformer_config(preset: str) -> dict:
    cfg = json.loads((TINY / "transformer" / "config.json").read_text())
    return {k: v for k, v in {**cfg, **PRESETS[preset]}.items() if not k.startswith("_")}


def build_transformer(config: dict, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A FLUX.1 transformer with random weights (diffusers' own init, seeded)."""
    from grpo.models.flux1 import FLUX1

    torch.manual_seed(seed)
    model = FLUX1.transformer_class().from_config(config).eval()
    for p in model.parameters():  # not .to(dtype): diffusers warns on every cast of a model without fp32 modules
        p.data = p.data.to(dtype)
    return model


def write_model_folder(folder: Path, config: dict, dtype: torch.dtype = torch.float32, seed: int = 0,
                       max_shard_size: str | None = None) -> Path:
    """Write `<folder>/transformer` (config + safetensors, sharded with an index when max_shard_size is given) and
    copy the tiny pipeline's other parts, so the folder loads like a diffusers FLUX folder."""
    import shutil

    folder = Path(folder)
    model = build_transformer(config, dtype, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder / "transformer", safe_serialization=True, **kwargs)
    for part in TINY.iterdir():
        if part.name != "transformer" and not (folder / part.name).exists():
            (shutil.copytree if part.is_dir() else shutil.copy)(part, folder / part.name)
    return folder


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ------------------------------------------------------------------------------------------------- machine rates
def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA or NPU, through DeepSpeed's accelerator); a no-op on the CPU."""
    if device.type != "cpu":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize(device.index)


def wall_and_cpu(fn, device: torch.device) -> tuple[float, float, object]:
    """Wall seconds, this process's CPU seconds and fn()'s result. On a shared host the CPU time leaves out what other
    guests take from the cores (steal time), which is most of the round-to-round spread of the wall time there."""
    sync(device)
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    sync(device)
    return time.perf_counter() - t, time.process_time() - c, out


def matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 1.0,
                 ) -> float:
    """Sustained FLOP/s of square n x n matmuls on `device` (best of several timed bursts)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = a @ b
    best, spent, reps = 0.0, 0.0, 1
    while spent < seconds:
        sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            c = torch.mm(a, b, out=c)
        sync(device)
        dt = time.perf_counter() - t
        spent += dt
        best = max(best, 2 * n**3 * reps / dt)
        if dt < 0.05:
            reps *= 2
    return best


# ------------------------------------------------------------------------------------------------------ FLOPs
def register_cpu_attention_flops() -> None:
    """torch's flop counter knows the CUDA SDPA kernels but not the CPU flash kernel: count it like them."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    fwd = aten._scaled_dot_product_flash_attention_for_cpu
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
    if fwd in fc.flop_registry:
        return

    @fc.register_flop_formula(fwd, get_raw=True)
    def _fwd(query, key, value, *args, out_val=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query.shape, key.shape, value.shape)

    @fc.register_flop_formula(bwd, get_raw=True)
    def _bwd(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def count_flops(fn) -> tuple[int, object]:
    from torch.utils.flop_counter import FlopCounterMode

    register_cpu_attention_flops()
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return counter.get_total_flops(), out


# ----------------------------------------------------------------------------------------------------- memory
def rss() -> int:
    """Resident set size of this process now, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """Peak resident set size of this process so far (ru_maxrss), bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS (VmHWM) of this process; False where /proc/self/clear_refs is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm() -> int:
    """Peak RSS since the last reset_peak_rss (VmHWM), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def gb(x: float) -> str:
    return f"{x / 2**30:.3f} GiB"


def mb(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable from Python in this process (deduplicated; meta tensors excluded).
    Allocator-independent: what the tensors occupy, not what malloc kept."""
    import gc
    import warnings

    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
    for o in objects:
        try:
            if not isinstance(o, torch.Tensor) or o.is_meta:
                continue
            s = o.untyped_storage()
        except Exception:  # noqa: BLE001 -- odd tensor subclasses without storage
            continue
        if s.nbytes():
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def engine_state_bytes(engine) -> dict[str, int]:
    """Model-state bytes this rank holds for a ZeRO-3 engine, read from DeepSpeed's own buffers (deduplicated by
    storage, so views into the flat buffers count once): weights (partitions + whole persistent parameters),
    gradients (partitioned accumulation buffer), master (fp32 copy, shared with the weights in fp32), optimizer
    (Adam moments), and the reduce bucket (a communication buffer, not a model state)."""
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    params = list(engine.module.parameters())
    out = {"weights": nbytes([p.ds_tensor for p in params] + [p.data for p in params])}
    opt = engine.optimizer
    if opt is None or not hasattr(opt, "fp32_partitioned_groups_flat"):
        return {**out, "gradients": 0, "master": 0, "optimizer": 0, "reduce bucket": 0}
    out["master"] = nbytes(opt.fp32_partitioned_groups_flat)
    out["gradients"] = nbytes([opt.grad_partitions_flat_buffer])
    out["optimizer"] = nbytes([v for st in opt.optimizer.state.values() for v in st.values()
                               if torch.is_tensor(v) and v.dim() > 0])
    out["reduce bucket"] = nbytes([b.buffer for b in opt.ipg_buckets.values() if b.buffer is not None])
    return out
