"""LoRA files in ComfyUI's native format (grpo/lora_files.py), read back through diffusers' own converters, and the
checks of lora.init_from.

* Round trip at FLUX.1-dev's and FLUX.2 [klein]'s real sizes (meta-device models, small-rank random adapters): our
  PEFT state dict -> ComfyUI keys -> diffusers 0.42's kohya readers -> the same keys and tensors.
* The same image: each tiny family's pipeline with our diffusers-format LoRA and with its ComfyUI-format export
  (load_lora_weights goes through those converters) gives the same image within 1e-5 in fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from grpo.errors import ConfigError
from grpo.export import lora_metadata
from grpo.lora_files import (COMFYUI_FILE, check_formats, expected_adapter, init_lora_state, read_lora,
                             to_comfyui, write_comfyui)
from grpo.models import family_of, family_of_transformer
from grpo.settings import LoraConfig
from tests import TINY, TINY_FLUX2, TINY_FLUX3, TINY_KONTEXT

ALL = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
# diffusers' FLUX.1 reader sizes a single block's linear1 as FLUX.1-dev's; at the tiny width the tiny test adapts the
# double blocks' attention (fused q/k/v included), the single blocks' output and the MLPs
TINY_FLUX1 = ["to_out.0", "to_add_out", "add_q_proj", "add_k_proj", "add_v_proj", "norm.linear", "ff.net.2"]
FLUX2 = [*ALL, "to_qkv_mlp_proj", "linear_in"]


def _lora(rank=4, alpha=8.0, targets=ALL) -> LoraConfig:
    return LoraConfig(rank=rank, alpha=alpha, init="gaussian", target_modules=list(targets))


def _with_adapter(transformer, lora: LoraConfig):
    transformer.add_adapter(PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, init_lora_weights=lora.init,
                                           target_modules=lora.target_modules))
    return transformer


def _random_state(transformer, seed: int = 0) -> dict[str, torch.Tensor]:
    """Non-trivial adapter weights (lora_B is zero at PEFT's init) of the adapter's shapes."""
    g = torch.Generator().manual_seed(seed)
    return {k: 0.1 * torch.randn(shape, generator=g) for k, shape in expected_adapter(transformer).items()}


@pytest.mark.parametrize("cls_name,config,targets", [
    # FLUX.1-dev's and FLUX.2 [klein]'s widths (3072), fewer blocks
    ("FluxTransformer2DModel", {"num_layers": 2, "num_single_layers": 3}, ALL),
    ("Flux2Transformer2DModel", {"num_layers": 2, "num_single_layers": 3}, FLUX2),
])
def test_round_trip_through_diffusers_converters_is_exact(cls_name, config, targets, tmp_path):
    import diffusers

    cls = getattr(diffusers, cls_name)
    with torch.device("meta"):
        model = _with_adapter(cls(**config), _lora(targets=targets))
    state = _random_state(model)
    comfy = to_comfyui(state, model, 8.0, family_of_transformer({"_class_name": cls_name}))
    assert all(k.startswith("lora_unet_") for k in comfy)
    fused = "lora_unet_double_blocks_0_img_attn_qkv"
    assert comfy[f"{fused}.lora_down.weight"].shape[0] == 12 and comfy[f"{fused}.alpha"].item() == 24.0
    pipeline = diffusers.FluxPipeline if cls_name == "FluxTransformer2DModel" else diffusers.Flux2KleinPipeline
    path = tmp_path / "lora.safetensors"
    save_file(comfy, str(path))
    # diffusers' reader as is (alpha folded into lora_A: alpha / rank = 2)
    back = pipeline.lora_state_dict(str(tmp_path), weight_name=path.name)
    back = {k.removeprefix("transformer."): v for k, v in back.items()}
    extra = {k for k in back if "proj_mlp" in k}  # FLUX.1's linear1: the untrained MLP part, zero
    assert all(not back[k].any() for k in extra if "lora_B" in k)
    assert set(back) - extra == set(state)
    for k, v in state.items():
        torch.testing.assert_close(back[k], v * (2.0 if "lora_A" in k else 1.0), rtol=0, atol=0)
    # read_lora: the alphas left out of the reader, the tensors bit for bit
    family = family_of(TINY if cls_name == "FluxTransformer2DModel" else TINY_FLUX2)
    got, scales = read_lora(path, family)
    assert scales == {2.0} and set(got) == set(state)
    assert all(torch.equal(got[k], v) for k, v in state.items())


FAMILIES = {"flux1": (TINY, TINY_FLUX1), "kontext": (TINY_KONTEXT, TINY_FLUX1), "flux2": (TINY_FLUX2, FLUX2)}


def _pipe(path):
    return family_of(path).pipeline_class().from_pretrained(str(path), dtype=torch.float32)


def _image(pipe, name):
    kwargs = {}
    if name == "kontext":  # a 64x64 source kept at its size (not resized to Kontext's preferred ~1 megapixel)
        kwargs = {"image": torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3)),
                  "max_area": 64 * 64, "_auto_resize": False}
    with torch.no_grad():
        return pipe(prompt="a red circle on a blue background", height=64, width=64, num_inference_steps=2,
                    max_sequence_length=32, output_type="pt", generator=torch.Generator().manual_seed(0),
                    **kwargs).images.float()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_comfyui_export_gives_the_diffusers_loras_image(name, tmp_path):
    path, targets = FAMILIES[name]
    family = family_of(path)
    lora = _lora(targets=targets)
    pipe = _pipe(path)
    state = _random_state(_with_adapter(family.meta_transformer(str(path)), lora))
    family.save_lora(tmp_path / "diffusers", state, lora_metadata(dataclasses.asdict(lora)))
    written = write_comfyui(state, family.meta_transformer(str(path)), dataclasses.asdict(lora), tmp_path / "comfy",
                            family)
    assert written.name == COMFYUI_FILE
    with safe_open(str(written), framework="pt") as f:
        assert f.metadata()["ss_network_alpha"] == "8.0" and f.metadata()["ss_network_dim"] == "4"
    base = _image(pipe, name)
    pipe.load_lora_weights(str(tmp_path / "diffusers"), adapter_name="diffusers")
    ours = _image(pipe, name)
    pipe.delete_adapters("diffusers")
    pipe.load_lora_weights(str(written), adapter_name="comfy")
    comfy = _image(pipe, name)
    assert (ours - base).abs().max() > 1e-3  # the LoRA changes the image
    torch.testing.assert_close(comfy, ours, rtol=0, atol=1e-5)


def test_init_lora_mismatches_are_one_line(tmp_path):
    family = family_of(TINY_FLUX2)
    lora = _lora(targets=FLUX2)
    meta = _with_adapter(family.meta_transformer(str(TINY_FLUX2)), lora)
    state = _random_state(meta)
    path = write_comfyui(state, meta, dataclasses.asdict(lora), tmp_path, family)
    got = init_lora_state(str(path), family, meta, lora)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    cases = {"alpha/rank [2.0], but lora.alpha/lora.rank is 4.0": _lora(alpha=16.0, targets=FLUX2),
             "has rank 4 at": _lora(rank=8, alpha=16.0, targets=FLUX2),
             "has no adapter for": _lora(targets=[*FLUX2, "linear_out"]),
             "adapts a module lora.target_modules leaves out": _lora(targets=ALL)}
    for message, other in cases.items():
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            init_lora_state(str(path), family,
                            _with_adapter(family.meta_transformer(str(TINY_FLUX2)), other), other)
    with pytest.raises(ConfigError, match="not a LoRA .safetensors file"):
        read_lora(tmp_path / "missing.safetensors", family)


def test_export_formats_are_checked():
    check_formats(["diffusers", "comfyui"], _lora(), family_of(TINY_FLUX2))
    with pytest.raises(ConfigError, match="export.formats"):
        check_formats(["kohya"], _lora(), family_of(TINY_FLUX2))
    with pytest.raises(ConfigError, match="full fine-tune"):
        check_formats(["comfyui"], None, family_of(TINY_FLUX2))
    with pytest.raises(ConfigError, match="not written for flux3"):  # no ComfyUI names for FLUX.3's modules yet
        check_formats(["comfyui"], _lora(), family_of(TINY_FLUX3))


def test_init_lora_reads_diffusers_files_and_is_checked_before_the_model_loads(tmp_path):
    from grpo.config import load_config
    from grpo.inputs import check_inputs
    from tests import ROOT

    config = ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml"
    lora = load_config(config).lora
    family = family_of(TINY_FLUX2)
    meta = _with_adapter(family.meta_transformer(str(TINY_FLUX2)), lora)
    state = _random_state(meta)
    family.save_lora(tmp_path / "sft", state, lora_metadata(dataclasses.asdict(lora)))
    got, scales = read_lora(tmp_path / "sft", family)  # a folder: its pytorch_lora_weights.safetensors
    assert scales == {lora.alpha / lora.rank} and all(torch.equal(got[k], v) for k, v in state.items())
    args = [f"model.path={TINY_FLUX2}", f"output_dir={tmp_path / 'run'}", f"lora.init_from={tmp_path / 'sft'}"]
    check_inputs(load_config(config, args), 2)
    with pytest.raises(ConfigError, match=f"has rank {lora.rank} at .*, but lora.rank is {2 * lora.rank}"):
        check_inputs(load_config(config, [*args, f"lora.rank={2 * lora.rank}", f"lora.alpha={2 * lora.alpha}"]), 2)
