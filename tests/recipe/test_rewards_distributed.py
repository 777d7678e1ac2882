"""Sharded scoring: 2 processes (gloo, 127.0.0.1) each score only their share; the gathered scores equal scoring
everything in one process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo.device import free_port
from grpo.rewards import build_rewards, mix

from tests.unit.reward_inputs import PROMPTS, images

WORLD = 2
N = 8  # 4 groups of 2; rank r scores samples r, r + 2, ... so every group spans both ranks


def _batch() -> tuple[torch.Tensor, list[str]]:
    prompts = [PROMPTS[i // 2 % len(PROMPTS)] for i in range(N)]
    return images(N, 64, 64, seed=5), prompts


def _worker(rank: int, port: int, spec: dict[str, Any], out: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        from grpo.distributed import gather_by_index

        rewards = build_rewards(spec, "cpu")
        x, prompts = _batch()
        index = torch.arange(rank, N, WORLD)
        local = rewards(x[index], [prompts[i] for i in index])  # this rank's images only
        gathered = gather_by_index(local, index, N)
        torch.save({"gathered": gathered, "local_rows": local.shape[0]}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_gather_equals_single_process(tiny_reward_spec, tmp_path) -> None:
    spec = {
        "hpsv2": tiny_reward_spec["hpsv2"],
        "jpeg_incompressibility": {"weight": 0.01},
        "tiny_world": {"weight": 0.5},
    }
    mp.spawn(_worker, args=(free_port(), spec, str(tmp_path)), nprocs=WORLD, join=True)
    x, prompts = _batch()
    rewards = build_rewards(spec, "cpu")
    everything = rewards(x, prompts)
    group_ids = torch.arange(N) // 2
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert result["local_rows"] == N // WORLD
        torch.testing.assert_close(result["gathered"], everything, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mix(result["gathered"], rewards.weights, group_ids, normalize_per_group=True),
                                   mix(everything, rewards.weights, group_ids, normalize_per_group=True),
                                   atol=1e-3, rtol=1e-4)
