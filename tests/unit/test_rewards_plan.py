"""The planner's reward part (tools/plan.py): served rewards cost no device memory; offload and serving as levers."""

from __future__ import annotations

import json

from grpo.config import load_config
from tools import plan as P

from tests import ROOT

HPS_BYTES = P.BACKBONE_PARAMS["ViT-H-14"] * 4  # float32


def test_served_rewards_cost_no_device_memory() -> None:
    resident, visiting, notes = P._reward_bytes({
        "hpsv2": 1.0,
        "remote@pickscore": {"url": "http://rewards:8000", "reward": "pickscore"},
        "vlm_judge": {"url": "http://judge:8000/v1", "model": "qwen"},
        "aesthetic": {"offload": True},
    })
    assert resident == HPS_BYTES and visiting == P.BACKBONE_PARAMS["ViT-L-14"] * 4
    assert notes == ["reward remote@pickscore: scored by the server at http://rewards:8000, no device memory here",
                     "reward vlm_judge: scored by the server at http://judge:8000/v1, no device memory here"]


def test_reward_levers_are_valid_overrides_that_free_the_device() -> None:
    rewards = {"hpsv2": {"weight": 0.7}, "aesthetic": 0.3, "clip_score": {"device": "cpu"}, "tiny_world": 1.0}
    levers = P._reward_levers(rewards)
    assert [label for label, _ in levers] == [
        "reward hpsv2 offloaded between scorings",
        "reward hpsv2 served by `python -m tools.rewards serve` on another machine",
        "reward aesthetic served by `python -m tools.rewards serve` on another machine",  # a bare weight: no offload
    ]
    assert levers[0][1] == ["rewards.hpsv2.offload=true"]
    base = ["rewards=" + json.dumps(rewards)]
    for (_, change), freed in zip(levers[1:], (HPS_BYTES, P.BACKBONE_PARAMS["ViT-L-14"] * 4)):
        before = P._reward_bytes(load_config(str(ROOT / "recipes/configs/tiny/grpo_lora.yaml"), base).rewards)[0]
        cfg = load_config(str(ROOT / "recipes/configs/tiny/grpo_lora.yaml"), [*base, *change])
        assert len(cfg.rewards) == len(rewards)  # the other rewards are kept
        assert before - P._reward_bytes(cfg.rewards)[0] == freed


def test_imagereward_and_hpsv3_are_counted_in_their_dtypes() -> None:
    resident, visiting, _ = P._reward_bytes({"imagereward": 1.0, "hpsv3": {"offload": True}})
    assert resident == P.BACKBONE_PARAMS["BLIP-L (ImageReward)"] * 4  # float32 by default
    assert visiting == P.BACKBONE_PARAMS["Qwen2-VL-7B (HPSv3)"] * 2  # bfloat16 by default, as the package runs it
    assert P._reward_bytes({"hpsv3": {"dtype": "float32"}})[0] == P.BACKBONE_PARAMS["Qwen2-VL-7B (HPSv3)"] * 4
