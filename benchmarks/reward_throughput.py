"""Reward scoring throughput (images/s) of every registered reward on tiny random-weight models.

    python benchmarks/reward_throughput.py [--images 32] [--size 64] [--repeats 3] [--device cpu]

Runs on the CPU, or unchanged on a GPU (the device is cuda when available). The tiny models measure the reward
plumbing (preprocessing, tokenisation, batching, transfers), not the real models' cost. Prints one line per reward;
the last line, `reward_throughput: N images/s`, is one Rewards call scoring every reward (the line before says so).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny local files only; never the network
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from grpo.rewards import build_rewards  # noqa: E402
from grpo.rewards.tiny_models import write_tiny_reward_files  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(n: int) -> list[str]:
    from grpo.tiny import world

    prompts = world.all_prompts()
    # GRPO-like: groups of 4 images share a prompt.
    return [prompts[(i // 4) % len(prompts)] for i in range(n)]


def measure(reward, images: torch.Tensor, prompts: list[str], repeats: int) -> float:
    """Best-of-`repeats` images/s of scoring the whole batch (after one warm-up call)."""
    device = images.device
    reward(images, prompts)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        reward(images, prompts)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return images.shape[0] / best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=32, help="images per scoring call")
    parser.add_argument("--size", type=int, default=64, help="image side (the tiny FLUX makes 64x64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(args.images, 3, args.size, args.size, generator=generator).to(device)
    prompts = _prompts(args.images)
    with tempfile.TemporaryDirectory() as tmp:
        spec = write_tiny_reward_files(tmp)
        rewards = build_rewards(spec, device)
        rates = {}
        for name in rewards.names:
            rates[name] = measure(rewards[name], images, prompts, args.repeats)
            print(f"{name}: {rates[name]:.1f} images/s", flush=True)
        together = measure(rewards, images, prompts, args.repeats)
    print(f"device {device}, {args.images} images of {args.size}x{args.size}; below: one Rewards call scoring all "
          f"{len(rates)} rewards above (the mix a recipe would score)")
    print(f"reward_throughput: {together:.1f} images/s")


if __name__ == "__main__":
    main()
