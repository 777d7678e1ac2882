"""Every reward loaded through its real loading code from tiny hub-like folders: interface, programmatic references,
dtype, offload, ZeRO-3 guards (parity with the upstream scorers: test_rewards_parity.py)."""

from __future__ import annotations

import io
import sys
import types
import weakref

import pytest
import torch
from PIL import Image

from grpo.rewards import ModelReward, build_rewards

from tests.unit.reward_inputs import PROMPTS, images


@pytest.fixture(scope="module")
def built(tiny_reward_spec):
    """All rewards of the tiny spec, built once (float32, CPU)."""
    return build_rewards(tiny_reward_spec, "cpu")


@pytest.fixture(scope="module")
def batch():
    return images(len(PROMPTS), 64, 96, seed=1), list(PROMPTS)


def test_interface(built, batch) -> None:
    x, prompts = batch
    comps = built(x, prompts)
    assert built.names == ["hpsv2", "pickscore", "clip_score", "aesthetic", "tiny_world", "jpeg_compressibility",
                           "jpeg_incompressibility"]
    assert comps.shape == (len(prompts), len(built.names)) and comps.dtype == torch.float32
    assert torch.isfinite(comps).all()
    for name in built.names:
        reward = built[name]
        for module in reward.modules():
            assert not module.training and not any(p.requires_grad for p in module.parameters())
        # Splitting a batch changes nothing but float rounding.
        reward.batch_size, saved = 4, reward.batch_size
        torch.testing.assert_close(reward(x, prompts), comps[:, built.names.index(name)], atol=2e-6, rtol=1e-5)
        reward.batch_size = saved
    # Images of another dtype are accepted; scores come back float32.
    assert built(x.to(torch.bfloat16), prompts).dtype == torch.float32


def test_jpeg_matches_ddpo(built, batch) -> None:
    x, prompts = batch
    sizes = []
    for img in (x * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy().transpose(0, 2, 3, 1):
        buffer = io.BytesIO()
        Image.fromarray(img).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    sizes = torch.tensor(sizes)
    torch.testing.assert_close(built["jpeg_incompressibility"](x, prompts), sizes)
    torch.testing.assert_close(built["jpeg_compressibility"](x, prompts), -sizes)


def test_tiny_world_is_the_world_score(built) -> None:
    from grpo.tiny import world

    prompts = world.all_prompts()[:4]
    x = images(4, 64, 64, seed=3)
    torch.testing.assert_close(built["tiny_world"](x, prompts), world.score(x, prompts))


def test_dtype_option(tiny_reward_spec, batch) -> None:
    x, prompts = batch
    spec = {"hpsv2": {**tiny_reward_spec["hpsv2"], "dtype": "bfloat16"}}
    low = build_rewards(spec, "cpu")
    for module in low["hpsv2"].model.modules():
        want = torch.float32 if isinstance(module, torch.nn.LayerNorm) else torch.bfloat16
        assert all(p.dtype == want for p in module.parameters(recurse=False)), module
    full = build_rewards({"hpsv2": tiny_reward_spec["hpsv2"]}, "cpu")
    out = low(x, prompts)
    assert out.dtype == torch.float32
    # Measured on the tiny models (LayerNorms in float32): bf16 4.2e-3 (4.9e-3 with bf16 norms), fp16 1.1e-3.
    torch.testing.assert_close(out, full(x, prompts), atol=8.5e-3, rtol=0)
    half = build_rewards({"hpsv2": {**tiny_reward_spec["hpsv2"], "dtype": "float16"}}, "cpu")
    torch.testing.assert_close(half(x, prompts), full(x, prompts), atol=2.2e-3, rtol=0)


def test_offload_moves_only_offloadable_models(tiny_reward_spec, monkeypatch) -> None:
    """on_device() loads models built with offload: true and offloads them afterwards; others stay put.

    A CPU-only machine has no second device, so the moves are recorded instead of made.
    """
    moves: list[tuple[str, str]] = []
    monkeypatch.setattr(ModelReward, "_move", lambda self, device: (moves.append((self.name, str(device))),
                                                                     setattr(self, "_where", device)))
    spec = {
        "hpsv2": {**tiny_reward_spec["hpsv2"], "offload": True},
        "clip_score": tiny_reward_spec["clip_score"],
        "clip_score@cpu": {**tiny_reward_spec["clip_score"], "device": "cpu", "offload": True},
    }
    rewards = build_rewards(spec, "meta")  # "meta" stands in for the accelerator; nothing is moved there
    assert rewards["hpsv2"].device.type == "cpu"  # offloadable: starts on the CPU
    assert rewards["clip_score"].device.type == "meta" and rewards["clip_score@cpu"].device.type == "cpu"
    with rewards.on_device():
        assert rewards["hpsv2"].device.type == "meta"
    assert rewards["hpsv2"].device.type == "cpu"
    assert moves == [("hpsv2", "meta"), ("hpsv2", "cpu")]


def test_refuses_zero_init_and_hides_hf_zero3(tiny_reward_spec, monkeypatch) -> None:
    fake = types.ModuleType("deepspeed.runtime.zero.partition_parameters")
    fake.zero_init_context = 1
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero.partition_parameters", fake)
    with pytest.raises(RuntimeError, match="inside deepspeed.zero.Init"):
        build_rewards({"jpeg_compressibility": 1.0}, "cpu")
    fake.zero_init_context = 0

    from transformers.integrations import deepspeed as hf_ds

    class Zero3:
        def is_zero3(self) -> bool:
            return True

    cfg = Zero3()
    monkeypatch.setattr(hf_ds, "_hf_deepspeed_config_weak_ref", weakref.ref(cfg))
    rewards = build_rewards({"pickscore": tiny_reward_spec["pickscore"]}, "cpu")
    assert not any(hasattr(p, "ds_id") for p in rewards["pickscore"].model.parameters())
    assert hf_ds.is_deepspeed_zero3_enabled()  # restored after loading
