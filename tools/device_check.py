"""Check your first GPU or NPU machine in one command: device tests, tiny run, alignment against the CPU, benchmark.

The device tests, a short tiny-preset run, block-by-block alignment against the CPU and the FLUX.1-dev-sized
benchmark, within a time budget, every log in one folder.

    bash launch/device_check.sh OUT_DIR                  # sources launch/npu_env.sh where torch_npu is installed
    python -m tools.device_check --out OUT_DIR [--budget-s 540]
    python -m tools.device_check --out OUT_DIR --cpu     # the same parts on the CPU, tiny sizes, 4x the time limits:
                                                         # a test of the plumbing

The accelerator is the one deepspeed.accelerator picks (torch_npu importable -> npu, else CUDA, else cpu; DS_ACCELERATOR
overrides); without --cpu a cpu answer is refused (exit 2). The parts run one after the other, each in its own process
group with its own time limit, and each writes OUT_DIR/<part>.log:

    tests   pytest tests/recipe/test_on_device.py -m "<kind> and not slow": device layer, tiny FLUX vs CPU
    ratio   2 steps of the tiny LoRA preset (bf16, 1 process): ratio_max_dev <= 1e-5 on every step (model.deterministic)
    align   one tiny step on the device against the CPU, fp32 (tools.align): every transformer block rel < 1e-3,
            step-mean reward rel < 1e-3, PSNR > 40 dB
    bench   benchmarks/gpu_flux12b.py (--smoke with --cpu): its gpu_flux12b_s_per_image headline and MFU line

The benchmark gets what the others leave of the budget (default 540 s = 9 minutes; the others' limits leave it at least
180 s). One line per part goes to stdout and OUT_DIR/summary.txt; the exit code is 0 when every part passed, else 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tools.launch import launch_env

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "recipes/configs/tiny/grpo_lora.yaml"
# A step of 2 prompts x 2 images over 3 denoising steps: seconds on a device, about a minute on 2 CPU cores.
TINY = ["batch.prompts_per_step=2", "sampling.group_size=2", "batch.micro_batch_size=2", "sampling.num_steps=3",
        "data.eval_prompts=null", "logging.tensorboard=false", "logging.sample_every=0", "logging.progress=false"]
RATIO_MAX, BLOCK_REL_MAX, REWARD_REL_MAX, PSNR_MIN = 1e-5, 1e-3, 1e-3, 40.0
LIMITS_S = {"tests": 90, "ratio": 120, "align": 150}
BUDGET_S, CPU_SCALE = 540, 4


@dataclass
class Part:
    name: str
    cmd: list[str]
    verdict: Callable[[str, Path], tuple[bool, str]]  # (log text, OUT_DIR) -> (passed, detail)


def detect(cpu: bool) -> str:
    """The accelerator deepspeed.accelerator picks ("cuda", "npu", or "cpu" when --cpu forces it)."""
    if cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def worst_block(report: dict) -> float:
    """The largest rel over the transformer blocks of a tools.align comparison (not the embedders: bf16 rounds the
    guidance scale 3.5 to 3.504 before the blocks)."""
    return max(e["rel"] for m, by_step in report["blocks"].items() if "transformer_blocks" in m
               for e in by_step.values())


def pytest_verdict(log: str, out: Path) -> tuple[bool, str]:
    tail = [line for line in log.splitlines() if re.match(r"=+ .*\d+ (passed|failed|skipped|error)", line)]
    summary = tail[-1].strip("= ") if tail else "no pytest summary"
    return ("failed" not in summary and "error" not in summary and bool(tail)), summary


def ratio_verdict(log: str, out: Path) -> tuple[bool, str]:
    path = out / "ratio_run" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    devs = [r["ratio_max_dev"] for r in rows if r.get("ratio_max_dev") is not None]
    if len(devs) < 2:
        return False, f"{len(devs)} steps with ratio_max_dev in {path}"
    worst = max(devs)
    return worst <= RATIO_MAX, f"ratio_max_dev max {worst:.3g} over {len(devs)} steps (limit {RATIO_MAX:g})"


def align_verdict(log: str, out: Path) -> tuple[bool, str]:
    path = out / "align.json"
    if not path.exists():
        return False, f"no {path.name}"
    report = json.loads(path.read_text())
    block, reward, psnr = worst_block(report), report["reward_mean"]["rel"], report["images"]["psnr_db"]
    ok = block < BLOCK_REL_MAX and reward < REWARD_REL_MAX and psnr > PSNR_MIN
    return ok, (f"{report['a']['device']} vs {report['b']['device']} fp32: worst block rel {block:.2g} (< "
                f"{BLOCK_REL_MAX:g}), reward rel {reward:.2g}, PSNR {psnr:.1f} dB")


def bench_verdict(log: str, out: Path) -> tuple[bool, str]:
    head = re.findall(r"^gpu_flux12b_s_per_image: (\S+)$", log, re.M)
    if not head:
        return False, "no gpu_flux12b_s_per_image headline"
    mfu = re.findall(r"MFU [^;,\n]*", log)
    return math.isfinite(float(head[-1])), f"{head[-1]} s/image" + (f", {mfu[-1]}" if mfu else "")


def parts(kind: str, out: Path) -> list[Part]:
    py = sys.executable
    marks = "not slow" if kind == "cpu" else f"{kind} and not slow"  # on the CPU every device test skips
    bf16 = [] if kind == "cpu" else ["deepspeed.config=ds_configs/zero3.json"]  # the device tests' precision
    return [
        Part("tests", [py, "-m", "pytest", "tests/recipe/test_on_device.py", "-m", marks, "-v", "-rs",
                       "-p", "no:cacheprovider"], pytest_verdict),
        Part("ratio", [py, "recipes/flux_grpo.py", "--config", CONFIG, *TINY, "max_steps=2", *bf16,
                       f"output_dir={out / 'ratio_run'}", f"data.cache_dir={out / 'cache'}"], ratio_verdict),
        Part("align", [py, "-m", "tools.align", CONFIG, *TINY, f"data.cache_dir={out / 'cache'}", "--a",
                       f"device={kind}", "--b", "device=cpu", "--json", str(out / "align.json")], align_verdict),
        Part("bench", [py, "benchmarks/gpu_flux12b.py", *(["--smoke"] if kind == "cpu" else [])], bench_verdict),
    ]


def run_part(part: Part, out: Path, limit_s: float, env: dict) -> str:
    """Runs `part` in its own process group (a timeout kills all it started) with its output in OUT/<name>.log;
    returns its summary line."""
    log = out / f"{part.name}.log"
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(part.cmd)}\n")
        f.flush()
        proc = subprocess.Popen(part.cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    took = time.monotonic() - start
    text = log.read_text(errors="replace")
    if code is None:
        status, detail = "TIMEOUT", f"killed after {limit_s:.0f} s"
    else:
        try:
            passed, detail = part.verdict(text, out)
        except (OSError, ValueError, KeyError) as e:  # a malformed result file is a failed part, not a crash
            passed, detail = False, f"result unreadable: {type(e).__name__}: {e}"
        status = "PASS" if passed and code == 0 else "FAIL"
        if code != 0:
            detail = f"exit {code}; {detail}"
    return f"{part.name:<6} {status:<7} {took:6.0f} s  {detail}  ({log.name})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.device_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="folder for the logs and summary.txt (created)")
    p.add_argument("--cpu", action="store_true", help="run the same parts on the CPU with tiny sizes")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help=f"all parts together, in seconds (x{CPU_SCALE} with --cpu)")
    p.add_argument("--only", nargs="+", choices=["tests", "ratio", "align", "bench"], help="run only these parts")
    args = p.parse_args(argv)
    kind = detect(args.cpu)
    if kind == "cpu" and not args.cpu:
        print("error: deepspeed.accelerator found no GPU or NPU (it picked cpu); check the driver, or source "
              "launch/npu_env.sh, or run with --cpu to check the plumbing", file=sys.stderr)
        return 2
    args.out = args.out.resolve()  # the parts run from the repository root
    args.out.mkdir(parents=True, exist_ok=True)
    # Each part is a plain process on `kind` (no surrounding job's ranks) with the machine's own thread count.
    env = launch_env(accelerator=kind, job=False, threads=None)
    # The CPU is far slower than any accelerator: the plumbing check scales every limit
    scale = CPU_SCALE if kind == "cpu" else 1
    budget = args.budget_s * scale
    deadline = time.monotonic() + budget
    lines = [f"device_check: {kind} (deepspeed.accelerator), budget {budget:.0f} s, logs in {args.out}"]
    print(lines[0], flush=True)
    for part in parts(kind, args.out):
        if args.only and part.name not in args.only:
            continue
        left = deadline - time.monotonic()
        limit = min(LIMITS_S.get(part.name, left) * scale, left)  # the benchmark: all that is left
        lines.append(run_part(part, args.out, limit, env) if limit > 0 else f"{part.name:<6} SKIPPED  budget spent")
        print(lines[-1], flush=True)
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    return 0 if all(" PASS " in line for line in lines[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
