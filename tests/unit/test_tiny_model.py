"""The embedded tiny FLUX model: the shipped folder loads offline and generates; the builder and tokenizers work."""

import json
import os
from pathlib import Path

import pytest
import torch

from grpo.tiny import world
from maintainer.tiny_worlds import flux1
from maintainer.tiny_worlds.build import build

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny-flux"


@pytest.fixture(scope="module")
def pipe():
    from diffusers import FluxPipeline

    assert (ASSET / "model_index.json").is_file(), f"{ASSET} missing; build it with python -m maintainer.tiny_worlds"
    p = FluxPipeline.from_pretrained(str(ASSET), local_files_only=True)
    p.set_progress_bar_config(disable=True)
    return p


def test_shipped_folder_layout_and_size():
    for sub in ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler"):
        assert (ASSET / sub).is_dir(), sub
    assert not list(ASSET.rglob("*.bin")), "weights must be safetensors"
    size = sum(f.stat().st_size for f in ASSET.rglob("*") if f.is_file())
    assert size < 12 * 2**20


def test_shipped_configs_match_the_contract(pipe):
    t, v, s = pipe.transformer.config, pipe.vae.config, pipe.scheduler.config
    assert t.in_channels == 4 * v.latent_channels == 16 and t.guidance_embeds
    assert sum(t.axes_dims_rope) == t.attention_head_dim
    assert t.joint_attention_dim == pipe.text_encoder_2.config.d_model
    assert t.pooled_projection_dim == pipe.text_encoder.config.hidden_size
    assert pipe.vae_scale_factor == 4 and not v.use_quant_conv and not v.use_post_quant_conv
    assert s.use_dynamic_shifting and s.shift == 3.0 and s.base_image_seq_len == 256 and s.max_image_seq_len == 4096
    # The latent factors were measured, not left at the constructor defaults.
    assert v.scaling_factor != 1.0 and v.shift_factor != 0.0


def test_shipped_pipeline_generates_from_a_prompt(pipe):
    prompt = world.split_prompts()[1][0]
    out = pipe(
        [prompt],
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=3.5,
        max_sequence_length=flux1.MAX_SEQUENCE_LENGTH,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images
    assert out.shape == (1, 3, 64, 64) and out.min() >= 0 and out.max() <= 1 and torch.isfinite(out).all()
    s = world.score(out, [prompt])
    assert 0 <= s.item() <= 1


def test_shipped_model_loosely_follows_heldout_prompts(pipe):
    # The pretrained model must sit between a blank background (~1/3) and ground truth (~1): GRPO needs room.
    heldout = world.split_prompts()[1]
    s = flux1.sample_scores(pipe, heldout, steps=8, seeds=[0])
    assert 0.45 < s.mean().item() < 0.9


def test_text_encoders_tell_prompts_apart(pipe):
    prompts = world.all_prompts()
    with torch.no_grad():
        embeds, pooled, text_ids = pipe.encode_prompt(
            prompts, device=torch.device("cpu"), max_sequence_length=flux1.MAX_SEQUENCE_LENGTH
        )
    assert embeds.shape == (len(prompts), flux1.MAX_SEQUENCE_LENGTH, 64) and pooled.shape == (len(prompts), 32)
    assert text_ids.shape == (flux1.MAX_SEQUENCE_LENGTH, 3)
    # Every pair of prompts differs in both the sequence and the pooled embedding.
    for x in (embeds.flatten(1), pooled):
        d = torch.cdist(x, x) + torch.eye(len(prompts)) * 1e9
        assert d.min() > 1e-3


@pytest.mark.parametrize("which", ["tokenizer", "tokenizer_2"])
def test_tokenizers_round_trip_whole_words(pipe, which):
    tok = getattr(pipe, which)
    unk = tok.unk_token_id
    for p in world.all_prompts():
        ids = tok(p).input_ids
        assert unk not in ids or which == "tokenizer" and ids.count(unk) == 1  # CLIP's unk is its eos
        assert tok.decode(ids, skip_special_tokens=True) == p
        # One token per word (+ CLIP's bos/eos, T5's eos): prompts fit T5's 32-token budget with room to spare.
        assert len(ids) == len(p.split()) + (2 if which == "tokenizer" else 1)
    assert tok.model_max_length == (77 if which == "tokenizer" else 512)


def test_clip_pooled_output_reads_the_eos_token(pipe):
    tok, enc = pipe.tokenizer, pipe.text_encoder
    assert enc.config.eos_token_id == tok.eos_token_id


def test_builder_makes_a_loadable_random_model(tmp_path):
    from diffusers import FluxPipeline

    out = tmp_path / "tiny"
    summary = build(out, flux1.BUILDER, vae_steps=0, transformer_steps=0, seed=0, eval_seeds=0,
                    latent_stat_images=16, decoder_steps=0)
    info = json.loads((out / "build_info.json").read_text())
    assert info["transformer_steps"] == 0 and summary["vae_factors"] == info["vae_factors"]
    p = FluxPipeline.from_pretrained(str(out), local_files_only=True)
    p.set_progress_bar_config(disable=True)
    img = p("a red circle on a blue background", height=64, width=64, num_inference_steps=1,
            max_sequence_length=flux1.MAX_SEQUENCE_LENGTH, output_type="pt").images
    assert img.shape == (1, 3, 64, 64)
    # Deterministic given the seed: a second build gives the same transformer weights.
    from safetensors.torch import load_file

    build(tmp_path / "again", flux1.BUILDER, vae_steps=0, transformer_steps=0, seed=0, eval_seeds=0,
          latent_stat_images=16, decoder_steps=0)
    a = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    b = load_file(tmp_path / "again" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # Continuing that build (--init-from) trains only the transformer and keeps every other file byte for byte,
    # the tokenizers included (a save_pretrained round trip would drop the T5 tokenizer's Lowercase normalizer).
    more = tmp_path / "more"
    build(more, flux1.BUILDER, transformer_steps=1, transformer_batch=2, images_per_prompt=1, seed=1, eval_seeds=0,
          init_from=out)
    kept = [f.relative_to(out) for f in out.rglob("*") if f.is_file() and f.parent.name != "transformer"]
    assert len(kept) > 8 and all((more / f).read_bytes() == (out / f).read_bytes() for f in kept
                                 if f.name != "build_info.json")
    c = load_file(more / "transformer" / "diffusion_pytorch_model.safetensors")
    assert c.keys() == a.keys() and not all(torch.equal(a[k], c[k]) for k in a)
    chain = json.loads((more / "build_info.json").read_text())
    assert chain["init_from"] == info and chain["transformer_steps"] == 1 and chain["vae_steps"] == 0
    assert chain["decoder_steps"] == 0

    # --decoder-steps sharpens the decoder only: the encoder (so every latent) stays bit for bit, and the phase draws
    # from its own generator, so the transformer trains exactly as it did without it.
    sharp = tmp_path / "sharp"
    build(sharp, flux1.BUILDER, transformer_steps=1, transformer_batch=2, images_per_prompt=1, seed=1, eval_seeds=0,
          init_from=out, decoder_steps=1, vae_batch=2)
    v0 = load_file(out / "vae" / "diffusion_pytorch_model.safetensors")
    v1 = load_file(sharp / "vae" / "diffusion_pytorch_model.safetensors")
    assert v0.keys() == v1.keys()
    assert all(torch.equal(v0[k], v1[k]) for k in v0 if not k.startswith("decoder."))
    assert not all(torch.equal(v0[k], v1[k]) for k in v0 if k.startswith("decoder."))
    d = load_file(sharp / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(c[k], d[k]) for k in c)
    assert json.loads((sharp / "vae" / "config.json").read_text())["scaling_factor"] == info["vae_factors"][
        "scaling_factor"]
