"""The tiny FLUX.2 [klein] world model: the builder's folder loads unchanged with Flux2KleinPipeline and generates;
its tokenizer, VAE normalisation and `--init-from` chains work; the shipped folder (when built) loads and is small.
The untrained [dev] folder loads unchanged with Flux2Pipeline (its processor with AutoProcessor) and generates."""

import json
import os
from pathlib import Path

import pytest
import torch

from grpo.tiny import world
from maintainer.tiny_worlds import cli, flux1, flux2
from maintainer.tiny_worlds.build import UNTRAINED, build
from tests import TINY_FLUX2

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ASSET = TINY_FLUX2
QUICK = dict(vae_steps=0, decoder_steps=0, transformer_steps=0, eval_seeds=0, latent_stat_images=16)


def _load(folder: Path):
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, prompt: str, **call) -> torch.Tensor:
    # The pipeline's own defaults otherwise: max_sequence_length 512, guidance_scale 4 (CFG: is_distilled is false).
    return pipe(prompt=prompt, height=64, width=64, num_inference_steps=4, generator=torch.Generator().manual_seed(0),
                output_type="pt", **call).images


def _check_contract(pipe):
    t, v, e, s = pipe.transformer.config, pipe.vae.config, pipe.text_encoder.config, pipe.scheduler.config
    assert pipe.config.is_distilled is False and not t.guidance_embeds
    assert t.in_channels == 4 * v.latent_channels == 16 and tuple(v.patch_size) == (2, 2)
    assert pipe.vae.bn.num_features == t.in_channels and pipe.vae_scale_factor == 4
    assert t.joint_attention_dim == len(flux2.TEXT_ENCODER_OUT_LAYERS) * e.hidden_size
    assert sum(t.axes_dims_rope) == t.attention_head_dim and len(t.axes_dims_rope) == 4
    # hidden_states[27] must be a layer's output, not the final norm's (hidden_states[num_hidden_layers]).
    assert e.num_hidden_layers > max(flux2.TEXT_ENCODER_OUT_LAYERS)
    assert s.use_dynamic_shifting and s.time_shift_type == "exponential" and s.num_train_timesteps == 1000


def test_quick_build_loads_unchanged_and_generates(tmp_path):
    out = tmp_path / "tiny-flux2"
    summary = build(out, flux2.klein(), **QUICK)
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline" and index["is_distilled"] is False
    assert summary["family"] == "flux2" and not list(out.rglob("*.bin"))
    pipe = _load(out)
    _check_contract(pipe)
    img = _generate(pipe, world.all_prompts()[0])  # every default: 512 tokens, CFG 4
    assert img.shape == (1, 3, 64, 64) and torch.isfinite(img).all() and img.min() >= 0 and img.max() <= 1
    short = _generate(pipe, [world.all_prompts()[1]] * 2, guidance_scale=flux2.GUIDANCE,
                      max_sequence_length=flux2.MAX_SEQUENCE_LENGTH)
    assert short.shape == (2, 3, 64, 64) and torch.isfinite(short).all()


def test_tokenizer_chat_template_round_trips_world_prompts(tmp_path):
    from transformers import Qwen2TokenizerFast

    built = flux2.build_qwen_tokenizer(tmp_path / "train")
    built.save_pretrained(str(tmp_path / "saved"))
    loaded = Qwen2TokenizerFast.from_pretrained(str(tmp_path / "saved"))  # what the pipeline loads
    assert loaded.pad_token == "<|endoftext|>" and loaded.eos_token == "<|im_end|>" and loaded.padding_side == "right"
    words = {w for p in world.all_prompts() for w in p.split()}
    for tok in (built, loaded):
        for p in world.all_prompts():
            text = flux2.chat_text(tok, p)
            assert text == f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            ids = tok(text).input_ids
            assert tok.decode(ids) == text and p in tok.decode(ids, skip_special_tokens=True)
            assert len(ids) == 12 + len(p.split()) <= flux2.MAX_SEQUENCE_LENGTH  # one token per word
            assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.unk_token_id is None
        assert all(len(tok(" " + w).input_ids) == 1 for w in words)
    # The pipeline pads on the right to max_length, so the first 32 positions of a 512 encoding are the 32 encoding.
    text = flux2.chat_text(loaded, world.all_prompts()[0])
    enc = [loaded(text, padding="max_length", truncation=True, max_length=n, return_tensors="pt") for n in (32, 512)]
    assert enc[1].input_ids.shape == (1, 512) and torch.equal(enc[1].input_ids[:, :32], enc[0].input_ids)
    assert enc[1].attention_mask.sum() == 19 and (enc[1].input_ids[0, 19:] == loaded.pad_token_id).all()
    assert loaded("A Red Square?").input_ids  # any text tokenizes (byte level, no unknown token)


def test_vae_bn_statistics_are_measured_and_init_from_keeps_them(tmp_path):
    from safetensors.torch import load_file

    first = tmp_path / "first"
    info = build(first, flux2.klein(), **{**QUICK, "vae_steps": 1}, vae_batch=2)
    vae = _load(first).vae
    mean, var = vae.bn.running_mean, vae.bn.running_var
    assert not torch.allclose(mean, torch.zeros_like(mean)) and not torch.allclose(var, torch.ones_like(var))
    assert info["vae_bn"] == flux2.kept_bn_statistics(vae) and info["vae_steps"] == 1
    # The pipeline's normalised latents of world renders then have about mean 0 and variance 1 per channel.
    pipe = _load(first)
    z = flux2.encode_latents(pipe, world.render(world.all_prompts(), 64, torch.Generator().manual_seed(5)))
    assert z.mean((0, 1)).abs().max() < 0.5 and ((z.var((0, 1)) - 1).abs() < 0.5).all()

    # Continuing it trains the transformer only (here with every step's first sample at the pipeline's 512 length)
    # and keeps every other file byte for byte.
    more = tmp_path / "more"
    chain = build(more, flux2.klein(long_text_every=1), transformer_steps=1, transformer_batch=2, images_per_prompt=1,
                  seed=1, eval_seeds=0, init_from=first)
    kept = [f.relative_to(first) for f in first.rglob("*") if f.is_file() and f.parent.name != "transformer"]
    assert len(kept) > 6 and all((more / f).read_bytes() == (first / f).read_bytes() for f in kept
                                 if f.name != "build_info.json")
    a = load_file(first / "transformer" / "diffusion_pytorch_model.safetensors")
    b = load_file(more / "transformer" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys() and not all(torch.equal(a[k], b[k]) for k in a)
    assert chain["init_from"] == info and chain["vae_bn"] == info["vae_bn"]
    assert chain["transformer_options"] == {"cfg_dropout": 0.1, "long_text_every": 1}
    with pytest.raises(ValueError, match="flux2 build"):
        build(tmp_path / "wrong", flux1.BUILDER, transformer_steps=0, eval_seeds=0, init_from=first)


@pytest.fixture(scope="module")
def shipped():
    if not (ASSET / "model_index.json").is_file():
        pytest.skip(f"{ASSET} not built (python -m maintainer.tiny_worlds --family flux2 --out {ASSET})")
    return _load(ASSET)


def test_shipped_folder_is_small_and_safetensors(shipped):
    size = sum(f.stat().st_size for f in ASSET.rglob("*") if f.is_file())
    assert size < 40 * 2**20 and not list(ASSET.rglob("*.bin"))
    info = json.loads((ASSET / "build_info.json").read_text())
    assert info["family"] == "flux2" and {"sample_score_mean", "ground_truth_score_mean"} <= set(info["eval"])


def test_shipped_folder_loads_and_generates(shipped):
    _check_contract(shipped)
    prompt = world.split_prompts()[1][0]
    img = _generate(shipped, prompt)
    assert img.shape == (1, 3, 64, 64) and torch.isfinite(img).all()
    assert 0 <= world.score(img, [prompt]).item() <= 1


def test_shipped_model_loosely_follows_heldout_prompts(shipped):
    # Between a blank background (~1/3) and ground truth (~1): GRPO needs room.
    s = flux2.sample_scores(shipped, world.split_prompts()[1], steps=8, seeds=[0])
    assert 0.45 < s.mean().item() < 0.9


def test_flags_given_at_the_parsers_default_reach_the_flux3_builder(tmp_path, monkeypatch):
    """`--images-per-prompt 32` is also the parser's default; the FLUX.3 builder's own is 16, so a flag the command
    line gives must reach it whatever its value (it was dropped once, and a world built with 16)."""
    from maintainer.tiny_worlds import flux3

    seen = {}
    monkeypatch.setattr(flux3, "build_flux3", lambda out, **kw: seen.update(kw) or {})
    monkeypatch.setattr(cli.torch, "set_num_threads", lambda n: None)
    cli.main(["--family", "flux3", "--out", str(tmp_path / "x"), "--images-per-prompt", "32",
              "--transformer-steps", "5"])
    assert seen == {"images_per_prompt": 32, "transformer_steps": 5}


def test_flux2_options_are_refused_for_flux1(tmp_path):
    with pytest.raises(SystemExit, match="flux2 option"):
        cli.main(["--out", str(tmp_path / "x"), "--cfg-dropout", "0.2"])
    assert not (tmp_path / "x").exists()


# FLUX.2 [dev]: the untrained Flux2Pipeline folder (maintainer.tiny_worlds.flux2.build_dev, the `tiny_flux2_dev`
# fixture)


def test_dev_build_loads_unchanged_and_generates(tiny_flux2_dev):
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from transformers import AutoProcessor, Mistral3ForConditionalGeneration, PixtralProcessor

    folder = tiny_flux2_dev
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "Flux2Pipeline"
    assert not list(folder.rglob("*.bin")) and sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) < 2**24
    processor = AutoProcessor.from_pretrained(str(folder / "tokenizer"))
    assert isinstance(processor, PixtralProcessor)
    prompts = world.all_prompts()
    assert processor.apply_chat_template(format_input(prompts[:2]), tokenize=False) == [
        flux2.dev_chat_text(p) for p in prompts[:2]]
    # Every world prompt fits the [dev] length after the system message, and the tokens after it are padding.
    enc = processor.apply_chat_template(format_input(prompts), tokenize=True, return_dict=True, return_tensors="pt",
                                        padding="max_length", truncation=True,
                                        max_length=flux2.DEV_MAX_SEQUENCE_LENGTH)
    lengths = enc["attention_mask"].sum(1)
    assert lengths.max() < flux2.DEV_MAX_SEQUENCE_LENGTH and lengths.min() > 31
    last = enc["input_ids"].gather(1, (lengths - 1)[:, None])
    assert (last == processor.tokenizer.convert_tokens_to_ids(flux2.END_INST)).all()

    pipe = Flux2Pipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    t, e = pipe.transformer.config, pipe.text_encoder.config.text_config
    assert isinstance(pipe.text_encoder, Mistral3ForConditionalGeneration) and t.guidance_embeds
    assert e.num_hidden_layers > max(flux2.DEV_TEXT_ENCODER_OUT_LAYERS)  # hidden_states[30] is a layer's output
    assert t.joint_attention_dim == len(flux2.DEV_TEXT_ENCODER_OUT_LAYERS) * e.hidden_size
    img = _generate(pipe, prompts[0], max_sequence_length=flux2.DEV_MAX_SEQUENCE_LENGTH)  # guidance_scale 4 default
    assert img.shape == (1, 3, 64, 64) and torch.isfinite(img).all() and img.min() >= 0 and img.max() <= 1


def test_dev_builds_untrained_only(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "build", lambda out, builder, **kw: seen.update(kw, builder=builder))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # main sets the builder's; the session keeps its own
    cli.main(["--family", "flux2-dev", "--untrained", "--out", str(tmp_path / "x")])
    assert seen["builder"] is flux2.DEV and {k: seen[k] for k in UNTRAINED} == UNTRAINED
    for argv, words in ((["--family", "flux2-dev"], "add --untrained"),
                        (["--untrained", "--vae-steps", "3"], "drop --vae-steps"),
                        (["--family", "flux2-dev", "--untrained", "--cfg-dropout", "0.2"], "flux2 option")):
        with pytest.raises(SystemExit, match=words):
            cli.main([*argv, "--out", str(tmp_path / "y")])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="untrained only"):
        build(tmp_path / "z", flux2.DEV, transformer_steps=1)
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()
