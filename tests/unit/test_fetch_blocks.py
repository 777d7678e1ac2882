"""deepspeed.fetch_blocks: ZeRO-3 gathers each FLUX block as one unit (DeepSpeed leaf modules). The keyword inputs must
reach the blocks positionally (else DeepSpeed's leaf gradient hook fires before the block's backward and crashes).
That it trains what the module-by-module path trains runs in a fresh process: tests/recipe/test_fetch_blocks.py."""

import torch

from grpo.config import load_config
from tests import ROOT

LORA = ROOT / "recipes/configs/tiny/grpo_lora.yaml"


def test_keyword_inputs_reach_the_blocks_by_position():
    from benchmarks._common import build_transformer, transformer_config
    from grpo.engine import _inputs_by_position

    model = build_transformer(transformer_config("tiny")).requires_grad_(False)
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    h, e, temb = torch.randn(1, 4, 128), torch.randn(1, 2, 128), torch.randn(1, 128)
    args, kwargs = _inputs_by_position(double, (), dict(hidden_states=h, encoder_hidden_states=e, temb=temb,
                                                        image_rotary_emb=None, joint_attention_kwargs=None))
    assert args[:3] == (h, e, temb) and kwargs == {}
    args, kwargs = _inputs_by_position(single, (h,), dict(encoder_hidden_states=e, temb=temb))
    assert args == (h, e, temb) and kwargs == {}
    # A trainable block fed by frozen layers (LoRA's first block): its hidden states are made to require a gradient,
    # so that DeepSpeed's hook waits for the block's backward; nothing changes without grad or when one is required.
    single.requires_grad_(True)
    with torch.enable_grad():
        (x, *rest), _ = _inputs_by_position(single, (h, e, temb), {})
        assert x.requires_grad and torch.equal(x, h) and not h.requires_grad and rest == [e, temb]
        temb.requires_grad_(True)
        assert _inputs_by_position(single, (h, e, temb), {})[0][0] is h
    with torch.no_grad():
        assert _inputs_by_position(single, (h, e, temb.detach()), {})[0][0] is h


def test_the_presets_keep_it_off_and_a_resume_may_change_it():
    import dataclasses

    from grpo.settings import DeepSpeedConfig

    for preset in sorted((ROOT / "recipes/configs").glob("*/*.yaml")):
        if preset.name == "base.yaml" or preset.parent.name == "objectives":  # not runnable: no objective, no model
            continue
        tiny = preset.parent.name.startswith("tiny") or preset.name.startswith("tiny")  # experimental/tiny_* too
        prompts = [] if tiny else ["data.train_prompts=assets/prompts/tiny_train.txt", "data.eval_prompts=null"]
        assert load_config(preset, prompts).deepspeed.fetch_blocks is False, preset
    assert load_config(LORA, ["deepspeed.fetch_blocks=true"]).deepspeed.fetch_blocks is True
    field = next(f for f in dataclasses.fields(DeepSpeedConfig) if f.name == "fetch_blocks")
    assert field.metadata["resume"] == "free"  # the same training up to rounding: not part of a run's identity
