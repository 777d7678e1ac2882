"""data.text_encoder_device_map: the text encoders spread by transformers' big-model loading (accelerators, then host
RAM, then disk) encode the prompts exactly as the whole encoder on one device does, so the cache key leaves the
placement out. On this CPU-only host a small host-RAM cap sends most layers to disk."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from grpo.config import load_config
from grpo.models import family_of
from grpo.models.base import ModelFamily, Placement
from grpo.prompts import cache_file, load_cache, max_memory
from grpo.settings import MemoryCaps
from tests import ROOT, TINY, TINY_FLUX2

PROMPTS = ["a red circle on a blue background", "a green square on a yellow background",
           "a cyan triangle on the left on a magenta background"]
CPU = torch.device("cpu")


@pytest.fixture
def loaded(monkeypatch):
    """The device maps of the encoders load_text_encoder placed, by folder."""
    maps = {}
    load = ModelFamily.load_text_encoder

    def spy(self, model_path, folder, dtype, placement):
        encoder = load(self, model_path, folder, dtype, placement)
        maps[folder] = getattr(encoder, "hf_device_map", {"": str(next(encoder.parameters()).device)})
        return encoder

    monkeypatch.setattr(ModelFamily, "load_text_encoder", spy)
    return maps


# Host-RAM caps that hold a few layers of the tiny models' largest encoder (Qwen3, 1.1 MB in fp32; T5, 0.28 MB) and
# send the rest to disk; the test checks that they still do.
CASES = [(TINY_FLUX2, torch.float32, "300KB", "text_encoder"), (TINY_FLUX2, torch.bfloat16, "300KB", "text_encoder"),
         (TINY, torch.float32, "150KB", "text_encoder_2")]


@pytest.mark.parametrize("path, dtype, cap, split", CASES, ids=["flux2-fp32", "flux2-bf16", "flux1-fp32"])
def test_layers_on_disk_give_the_embeddings_of_the_whole_encoder(path, dtype, cap, split, loaded, tmp_path, caplog):
    family = family_of(path)
    plain = family.encode_prompts(str(path), PROMPTS, 32, CPU, dtype=dtype)
    assert not loaded  # null placement: the pipeline's own loading, as before the setting
    caplog.set_level(logging.INFO, logger="grpo.models.base")
    placed = family.encode_prompts(str(path), PROMPTS, 32, CPU, dtype=dtype,
                                   placement=Placement("auto", {"cpu": cap}, str(tmp_path)))
    assert set(loaded) == set(family.text_folders)
    assert {"cpu", "disk"} <= set(loaded[split].values()), loaded[split]
    # the pipeline encoded with the placed encoder, not one it loaded itself
    assert any(r.getMessage().startswith(f"{split} (") and ", disk " in r.getMessage() for r in caplog.records)
    assert plain.keys() == placed.keys() == set(family.embed_keys)
    for key in family.embed_keys:
        assert torch.equal(placed[key], plain[key]), key


def test_the_caps_reach_every_accelerator_and_leave_the_rest_free(monkeypatch):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "get_max_memory", lambda: {0: 64 << 30, 1: 64 << 30, "cpu": 512 << 30})
    assert max_memory(MemoryCaps(device="16GiB")) == {0: "16GiB", 1: "16GiB", "cpu": 512 << 30}
    assert max_memory(MemoryCaps(cpu="100GiB")) == {0: 64 << 30, 1: 64 << 30, "cpu": "100GiB"}
    assert max_memory(None) is None  # accelerate's own defaults (10% of a lone device kept free)


def test_tools_prompts_logs_the_placement_and_keeps_the_cache_name(tmp_path, caplog, capsys):
    from tools import prompts as tool

    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("\n".join(PROMPTS) + "\n")
    cache = tmp_path / "cache"
    caplog.set_level(logging.INFO)
    argv = [str(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml"), f"model.path={TINY_FLUX2}",
            f"data.train_prompts={prompt_file}",
            "data.eval_prompts=null", f"data.cache_dir={cache}", "data.text_encoder_device_map=auto",
            "data.text_encoder_max_memory.cpu=300KB", "sampling.eval_cfg_scale=1.0"]  # no negative prompt to encode
    assert tool.main(argv) == 0
    written = Path(capsys.readouterr().out.strip())
    assert written == cache_file(cache, str(TINY_FLUX2), PROMPTS, 32, "p")  # the key of the one-device encoding
    assert load_cache(written).embeds["prompt_embeds"].shape[0] == len(PROMPTS)
    assert sorted(p.name for p in cache.iterdir()) == [written.name]  # the offload folder is gone
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("text_encoder (Qwen3ForCausalLM): 271,232 parameters, torch.float32, modules per "
                               "device: cpu ") and ", disk " in line for line in lines), lines
    assert any(line.startswith("prompts: ") and " s, peak host RSS " in line for line in lines), lines


@pytest.mark.parametrize("override, message", [
    (["data.text_encoder_device_map=everywhere"],
     "data.text_encoder_device_map: 'everywhere' is not one of 'auto', 'balanced', 'sequential'; "),
    (["data.text_encoder_device_map=auto", "data.text_encoder_max_memory.device=lots"],
     "data.text_encoder_max_memory.device: 'lots' is not a size; write it like 16GiB"),
    (["data.text_encoder_max_memory.cpu=100GiB"],
     "data.text_encoder_max_memory: caps only what data.text_encoder_device_map places; set "
     "data.text_encoder_device_map=auto"),
    (["data.text_encoder_device_map=auto", "data.text_encoder_max_memory.gpu=16GiB"],
     "data.text_encoder_max_memory.gpu: unknown setting; valid keys under data.text_encoder_max_memory: device, cpu"),
])
def test_bad_placement_settings_are_one_line_before_any_model_loads(override, message, monkeypatch, capsys):
    from tools import prompts as tool

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(ModelFamily, "encode_prompts", no_loading)
    assert tool.main([str(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml"), *override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_only_flux2_dev_spreads_its_encoder():
    presets = sorted((ROOT / "recipes/configs").rglob("*.yaml"))  # the runnable ones: no base, shared or objective
    runnable = [p for p in presets if p.name not in ("base.yaml", "shared.yaml") and p.parent.name != "objectives"]
    given = ["data.train_prompts=assets/prompts/tiny_train.txt", "data.eval_prompts=null"]
    spread = {str(p.relative_to(ROOT)) for p in runnable if load_config(p, given).data.text_encoder_device_map}
    assert spread == {f"recipes/configs/flux2_dev/{n}.yaml" for n in ("grpo_full", "grpo_lora", "nft_lora", "awm_lora")}
