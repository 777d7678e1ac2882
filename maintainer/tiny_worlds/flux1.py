"""FLUX.1 in the tiny world: a FluxPipeline folder (assets/tiny-flux), built by build.py's phases with these parts:

1. tokenizers from the world's vocabulary: a CLIP BPE (`tokenizers` BPE trainer, "</w>" word ends) and a T5 Unigram;
2. frozen random text encoders: CLIPTextModel (hidden 32 = pooled dim) and T5EncoderModel (d_model 64);
3. AutoencoderKL with 3 blocks (64 px -> 4 x 16 x 16 latents, no quant convs, like Flux's VAE), whose scaling/shift
   factors come from the latent statistics (`set_latent_factors`);
4. FluxTransformer2DModel (16 latent channels packed 2x2, 2 double + 4 single blocks, head 4 x 32), pretrained
   conditioned exactly as inference conditions it (`FluxPipeline.encode_prompt`, T5 max_sequence_length 32, guidance
   3.5) and called as the trainer calls it (grpo.models.FLUX1's conditioning and velocity);
5. FlowMatchEulerDiscreteScheduler with FLUX.1-dev's config.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter
from pathlib import Path

import torch

from grpo.models import FLUX1, Conditioning, ModelFamily
from grpo.tiny import world
from maintainer.tiny_worlds.build import (
    Builder,
    flow_matching,
    latent_pool,
    latent_size,
    parameter_counts,
    phase,
    random_renders,
    score_samples,
    vae_arch,
)

MAX_SEQUENCE_LENGTH = 32
GUIDANCE = 3.5
# FLUX.1-dev's scheduler/scheduler_config.json (diffusers keys).
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"


# --------------------------------------------------------------------------------------------------------------------
# Tokenizers


def build_clip_tokenizer(folder: Path):
    """Train a CLIP-style BPE on the world prompts and load it as a `CLIPTokenizer` (model_max_length 77).

    Args:
        folder: where vocab.json + merges.txt (+ the tokenizer's own files) are written.

    Returns:
        transformers.CLIPTokenizer.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    bpe = Tokenizer(models.BPE(unk_token=CLIP_EOS, end_of_word_suffix="</w>"))
    bpe.normalizer = normalizers.Lowercase()
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=256, special_tokens=[CLIP_BOS, CLIP_EOS], end_of_word_suffix="</w>", show_progress=False
    )
    bpe.train_from_iterator(world.all_prompts(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    vocab_file, merges_file = bpe.model.save(str(folder))  # the two files a CLIP tokenizer is made of
    vocab = json.loads(Path(vocab_file).read_text())
    lines = Path(merges_file).read_text().splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#")]
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def build_t5_tokenizer(folder: Path):
    """A T5 Unigram tokenizer fitted to the world prompts, loaded as `T5TokenizerFast` (model_max_length 512).

    The unigram log-probabilities are the maximum-likelihood estimates of whole words in the world corpus, with every
    lowercase letter as a rare fallback piece. `tokenizers`' UnigramTrainer is not used: it keeps only seed pieces found
    in at least two distinct pre-tokenized words, so on a ten-word vocabulary it returns single characters, and a
    character-level prompt would not fit T5's 32-token budget.

    Args:
        folder: where tokenizer.json is written.

    Returns:
        transformers.T5TokenizerFast with ids <pad> 0, </s> 1, <unk> 2.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    counts = Counter(w for p in world.all_prompts() for w in p.split())
    total = sum(counts.values())
    letters = sorted(set("abcdefghijklmnopqrstuvwxyz"))
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(f"\u2581{w}", math.log(c / total)) for w, c in sorted(counts.items())]
    # Fallback pieces are far less likely than any word, so whole words always win the Viterbi segmentation.
    pieces += [("\u2581", -20.0)] + [(ch, -20.0) for ch in letters]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")]
    )
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return T5TokenizerFast(tokenizer_file=str(path), extra_ids=0, model_max_length=512)


# --------------------------------------------------------------------------------------------------------------------
# Models


def build_text_encoders(clip_tok, t5_tok):
    """Frozen random CLIPTextModel (hidden 32) and T5EncoderModel (d_model 64) sized to the tokenizers."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=32,
            intermediate_size=64,
            projection_dim=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            # The pooled output is read at the first eos token; the id must be the tokenizer's.
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok),
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            dropout_rate=0.0,
            pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id,
            decoder_start_token_id=t5_tok.pad_token_id,
        )
    )
    for m in (clip, t5):
        m.eval().requires_grad_(False)
    return clip, t5


def build_vae(block_out_channels: tuple[int, ...] = (16, 32, 32)):
    """AutoencoderKL of `vae_arch`; its scaling/shift factors are set later from measured latents."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(**vae_arch(block_out_channels), scaling_factor=1.0, shift_factor=0.0)


def build_transformer(layers: int = 2, single_layers: int = 4):
    """FluxTransformer2DModel for 4-channel latents packed 2x2 (16 in-channels), inner dim 4 x 32 = 128."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=layers,
        num_single_layers=single_layers,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(8, 12, 12),
    )


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


# --------------------------------------------------------------------------------------------------------------------
# Latents and training


@torch.no_grad()
def set_latent_factors(vae, generator: torch.Generator, n: int = 512) -> dict[str, float]:
    """Set the VAE config's shift_factor / scaling_factor so scaled latents have mean 0 and std 1 (as Flux's were)."""
    x = random_renders(n, generator)
    z = torch.cat([vae.encode(c).latent_dist.mean for c in x.split(128)])
    shift = z.mean().item()
    scale = 1.0 / z.std().item()
    vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
    return {"shift_factor": vae.config.shift_factor, "scaling_factor": vae.config.scaling_factor}


@torch.no_grad()
def encode_latents(pipe, images: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] -> packed, scaled Flux latents [B, (H/8)(W/8), 16] (what the transformer sees)."""
    vae = pipe.vae
    z = torch.cat([vae.encode(c * 2 - 1).latent_dist.mean for c in images.split(128)])
    z = (z - vae.config.shift_factor) * vae.config.scaling_factor
    return FLUX1.pack(z)


@torch.no_grad()
def prompt_conditioning(pipe, prompts: list[str], model: ModelFamily = FLUX1) -> Conditioning:
    """The trainer's Conditioning of `prompts` (one row each) for a RESOLUTION image, from the pipeline's own prompt
    encoding (T5 length 32, CLIP's pooled embedding) and guidance 3.5: what FluxPipeline feeds its transformer."""
    embeds = model.encode_chunk(pipe, prompts, MAX_SEQUENCE_LENGTH, torch.device("cpu"))
    return model.conditioning(embeds, latent_size(pipe), GUIDANCE, guidance_embeds=True, device=torch.device("cpu"),
                              dtype=torch.float32)


def train_transformer(
    pipe,
    steps: int,
    batch: int,
    lr: float,
    shift: float,
    images_per_prompt: int,
    generator: torch.Generator,
) -> None:
    """Rectified-flow pretraining (`flow_matching`) of the FLUX.1 `pipe.transformer` on every world prompt.

    The guidance embedding is fixed at 3.5. The conditioning comes from `pipe.encode_prompt` (`prompt_conditioning`),
    so it is bit-for-bit what the pipeline feeds at inference.
    """
    transformer = pipe.transformer
    prompts = world.all_prompts()
    cond = prompt_conditioning(pipe, prompts)
    latents, pool_index = latent_pool(prompts, images_per_prompt, lambda x: encode_latents(pipe, x), generator)

    def predict(xt, sigma, rows, step):
        return FLUX1.velocity(transformer, xt, sigma, cond.select(rows))

    flow_matching(transformer, latents, pool_index, predict, steps, batch, lr, shift, generator)


# --------------------------------------------------------------------------------------------------------------------
# Evaluation and the builder


def sample_scores(pipe, prompts: list[str], steps: int, seeds: list[int]) -> torch.Tensor:
    """World scores of FLUX.1 `pipe` samples (guidance 3.5, T5 length 32): [len(seeds) * len(prompts)]."""
    return score_samples(
        pipe, prompts, steps, seeds, guidance_scale=GUIDANCE, max_sequence_length=MAX_SEQUENCE_LENGTH
    )


def _fresh_pipeline(layers: int, single_layers: int):
    """Tokenizers and untrained models assembled into a FluxPipeline; returns (pipe, parameter counts)."""
    from diffusers import FluxPipeline

    with phase("tokenizers"), tempfile.TemporaryDirectory() as tmp:
        clip_tok = build_clip_tokenizer(Path(tmp) / "clip")
        t5_tok = build_t5_tokenizer(Path(tmp) / "t5")
    with phase("models"):
        text_encoder, text_encoder_2 = build_text_encoders(clip_tok, t5_tok)
        vae = build_vae()
        transformer = build_transformer(layers, single_layers)
        pipe = FluxPipeline(
            scheduler=build_scheduler(),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=clip_tok,
            text_encoder_2=text_encoder_2,
            tokenizer_2=t5_tok,
            transformer=transformer,
        )
        pipe.set_progress_bar_config(disable=True)
        parts = dict(transformer=transformer, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2)
        n_params = parameter_counts(parts)
    return pipe, n_params


BUILDER = Builder(
    name="flux1",
    model=FLUX1,
    fresh=_fresh_pipeline,
    stats_key="vae_factors",
    set_latent_stats=set_latent_factors,
    kept_latent_stats=lambda vae: {k: vae.config[k] for k in ("shift_factor", "scaling_factor")},
    train_transformer=train_transformer,
    sample_scores=sample_scores,
)

