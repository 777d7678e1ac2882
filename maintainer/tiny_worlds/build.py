"""Build the embedded tiny FLUX model for the synthetic world, fully offline.

    python -m tools.build_tiny --out assets/tiny-flux [--vae-steps N] [--transformer-steps N] [--seed S]
    python -m tools.build_tiny --out NEW --init-from OLD [--decoder-steps N] [--transformer-steps N] [--transformer-lr LR]
    python -m tools.build_tiny --family flux2 --out assets/tiny-flux2 [same flags]
    python -m tools.build_tiny --family flux2-dev --untrained --out OUT
    python -m tools.build_tiny --family flux1-kontext --out assets/tiny-flux-kontext [--init-from assets/tiny-flux]
        [--transformer-steps N]

`--family flux1` (the default) builds a FluxPipeline (FLUX.1 layout), described below; `--family flux2` builds a
Flux2KleinPipeline (FLUX.2 [klein] layout) through the same phases, with the parts in `tools/build_tiny_flux2.py`;
`--family flux2-dev` an untrained Flux2Pipeline (FLUX.2 [dev] layout: Mistral3 text encoder, guidance embedding),
from the same file. `--family flux1-kontext` lays an existing FLUX.1 build (`--init-from`, default assets/tiny-flux)
out as a FluxKontextPipeline folder, its transformer trained to edit with `--transformer-steps`
(tools/build_tiny_kontext.py; `--copy` for copies, not links).

Phases (each logged with its time):

1. tokenizers from the world's vocabulary: a CLIP BPE (`tokenizers` BPE trainer, "</w>" word ends) and a T5 Unigram;
2. frozen random text encoders: CLIPTextModel (hidden 32 = pooled dim) and T5EncoderModel (d_model 64);
3. AutoencoderKL with 3 blocks (64 px -> 4 x 16 x 16 latents, no quant convs, like Flux's VAE), trained briefly as an
   autoencoder on rendered world images; its scaling/shift factors come from the latent statistics; then its decoder
   alone is sharpened (`--decoder-steps`, encoder frozen, so the latent space the transformer learns is unchanged):
   after the short joint phase it rounds a square's corners (form 0.22 on decoded ground truth), which would put
   squares out of any policy's reach;
4. FluxTransformer2DModel (16 latent channels packed 2x2, 2 double + 4 single blocks, head 4 x 32), pretrained by
   rectified-flow matching on VAE latents of rendered images of every world prompt, conditioned exactly as inference
   conditions it (`FluxPipeline.encode_prompt`, T5 max_sequence_length 32, guidance 3.5);
5. FlowMatchEulerDiscreteScheduler with FLUX.1-dev's config; `FluxPipeline.save_pretrained` (safetensors);
6. a short evaluation: world score of pipeline samples on the held-out prompts, next to rendered ground truth and
   to ground truth after the VAE's round trip (the most a latent policy can reach).

`--untrained` (`--vae-steps 0 --decoder-steps 0 --transformer-steps 0 --eval-seeds 0 --latent-stat-images 16`)
gives an untrained but complete model in seconds (tests use it).
`--init-from OLD` continues an earlier build: its tokenizers, text encoders and VAE encoder are kept bit for bit; the
transformer trains further and, with `--decoder-steps`, the VAE decoder too, so a longer pretraining does not redo the
VAE phase. The decoder phase draws from its own generator, so it never changes what the transformer phase trains on.
`build_info.json` then records the chain of builds (`init_from`), which is what reproduces the result.

What differs between the families (components, latent normalisation, conditioning, sampling) is a `Family`; `build`
runs the phases, and the helpers below it (world renders, the latent pool, the flow-matching loop, the VAE training,
the scoring of samples) serve both.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from grpo.tiny import world

logger = logging.getLogger(__name__)

RESOLUTION = 64
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
# `build` arguments of an untrained but complete folder (--untrained): an untrained VAE's latent statistics need
# no more than a few images.
UNTRAINED = dict(vae_steps=0, decoder_steps=0, transformer_steps=0, eval_seeds=0, latent_stat_images=16)


@contextmanager
def _phase(name: str) -> Iterator[None]:
    start = time.perf_counter()
    logger.info("phase %s ...", name)
    yield
    logger.info("phase %s done in %.1f s", name, time.perf_counter() - start)


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


def vae_arch(block_out_channels: tuple[int, ...] = (16, 32, 32)) -> dict:
    """Encoder/decoder arguments of the tiny VAE, the same for FLUX.1's AutoencoderKL and FLUX.2's
    AutoencoderKLFlux2: 3 blocks (scale factor 4), 4 latent channels, no quant convs, no mid-block attention."""
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=tuple(block_out_channels),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=RESOLUTION,
        use_quant_conv=False,
        use_post_quant_conv=False,
        # Flux's VAE has mid-block attention; at this size it only costs time (10x per step on CPU) and flat
        # shapes do not need it.
        mid_block_add_attention=False,
    )


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
# Training


def _log_every(steps: int) -> int:
    return max(1, steps // 10)


def train_vae(
    vae, steps: int, batch: int, lr: float, kl_weight: float, generator: torch.Generator, decoder_only: bool = False
) -> None:
    """Train the VAE as an autoencoder on rendered world images (inputs in [-1, 1]).

    Loss: L1 + MSE reconstruction of a posterior sample, plus a small KL so the posterior stays a smooth, bounded
    distribution the flow model can target. `decoder_only` freezes the encoder (the KL then has no gradient: pass
    kl_weight 0): the latent space, its scaling/shift factors and every latent the transformer was or will be trained
    on stay as they are, while the decoder sharpens.
    """
    prompts = world.all_prompts()
    params = list((vae.decoder if decoder_only else vae).parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    vae.requires_grad_(False)
    for q in params:
        q.requires_grad_(True)
    vae.train()
    name = "decoder" if decoder_only else "vae"
    start = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(len(prompts), (batch,), generator=generator)
        x = world.render([prompts[i] for i in idx], RESOLUTION, generator) * 2 - 1
        with torch.set_grad_enabled(not decoder_only):
            posterior = vae.encode(x).latent_dist
            z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = vae.decode(z).sample
        rec = (recon - x).abs().mean() + (recon - x).square().mean()
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        loss = rec + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % _log_every(steps) == 0 or step == steps - 1:
            logger.info(
                "%s step %d/%d rec %.4f kl %.3f (%.1f s)",
                name, step + 1, steps, rec.item(), kl.item(), time.perf_counter() - start,
            )
    vae.requires_grad_(False)
    vae.eval()


@torch.no_grad()
def reconstruction_scores(vae, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """World scores [B] of images [B, 3, H, W] in [0, 1] after a VAE round trip (posterior mode): the ceiling any
    policy can reach."""
    recon = vae.decode(vae.encode(images * 2 - 1).latent_dist.mode()).sample
    return world.score((recon / 2 + 0.5).clamp(0, 1), prompts)


def random_renders(n: int, generator: torch.Generator) -> torch.Tensor:
    """n rendered images of randomly drawn world prompts, in [-1, 1] (what the latent statistics are measured on)."""
    prompts = world.all_prompts()
    idx = torch.randint(len(prompts), (n,), generator=generator)
    return world.render([prompts[i] for i in idx], RESOLUTION, generator) * 2 - 1


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
    b, c, h, w = z.shape
    return pipe._pack_latents(z, b, c, h, w)


def latent_pool(
    prompts: list[str],
    images_per_prompt: int,
    encode: Callable[[torch.Tensor], torch.Tensor],
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed pool of renders per prompt, encoded once (the VAE encoder would otherwise cost as much as a step).

    Args:
        encode: images [B, 3, H, W] in [0, 1] -> packed latents [B, tokens, channels], as the family's transformer
            sees them.

    Returns:
        (latents [len(prompts) * images_per_prompt, tokens, channels], prompt index of each latent).
    """
    pool_prompts = [p for p in prompts for _ in range(images_per_prompt)]
    pool_index = torch.arange(len(prompts)).repeat_interleave(images_per_prompt)
    latents = encode(world.render(pool_prompts, RESOLUTION, generator))
    logger.info(
        "latent pool %s, std %.3f, mean %.3f", tuple(latents.shape), latents.std().item(), latents.mean().item()
    )
    return latents, pool_index


def flow_matching(
    transformer,
    latents: torch.Tensor,
    pool_index: torch.Tensor,
    predict: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
    steps: int,
    batch: int,
    lr: float,
    shift: float,
    generator: torch.Generator,
) -> None:
    """Rectified-flow training of `transformer` on a latent pool.

    x_sigma = (1 - sigma) x0 + sigma noise, target velocity noise - x0, sigma = s u / (1 + (s - 1) u) with u uniform
    (the time-shifted schedule GRPO samples on). `predict(x_sigma, sigma, prompt_index, step)` is the family's
    transformer call, conditioned as its pipeline conditions it.
    """
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    warmup = max(1, min(100, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    )
    transformer.train()
    start = time.perf_counter()
    running = None
    for step in range(steps):
        pick = torch.randint(len(pool_index), (batch,), generator=generator)
        x0 = latents[pick]
        cond = pool_index[pick]
        noise = torch.randn(x0.shape, generator=generator)
        u = torch.rand(batch, generator=generator)
        sigma = shift * u / (1 + (shift - 1) * u)
        s = sigma.view(-1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        pred = predict(xt, sigma, cond, step)
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % _log_every(steps) == 0 or step == steps - 1:
            logger.info(
                "transformer step %d/%d loss %.4f (%.1f s)", step + 1, steps, running, time.perf_counter() - start
            )
    transformer.eval()


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

    The guidance embedding is fixed at 3.5. The conditioning comes from `pipe.encode_prompt`, so it is bit-for-bit
    what the pipeline feeds at inference.
    """
    transformer = pipe.transformer
    prompts = world.all_prompts()
    with torch.no_grad():
        prompt_embeds, pooled, text_ids = pipe.encode_prompt(
            prompts, prompt_2=None, device=torch.device("cpu"), max_sequence_length=MAX_SEQUENCE_LENGTH
        )
    latents, pool_index = latent_pool(prompts, images_per_prompt, lambda x: encode_latents(pipe, x), generator)
    h = w = RESOLUTION // pipe.vae_scale_factor
    img_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, torch.device("cpu"), torch.float32)

    def predict(xt, sigma, cond, step):
        return flux1_velocity(transformer, xt, sigma, pooled[cond], prompt_embeds[cond], text_ids, img_ids)

    flow_matching(transformer, latents, pool_index, predict, steps, batch, lr, shift, generator)


def flux1_velocity(transformer, hidden, sigma, pooled, prompt_embeds, text_ids, img_ids) -> torch.Tensor:
    """The FLUX.1 transformer's output for a batch, called as FluxPipeline calls it (timestep = sigma, guidance 3.5)."""
    return transformer(
        hidden_states=hidden,
        timestep=sigma,
        guidance=torch.full((hidden.shape[0],), GUIDANCE),
        pooled_projections=pooled,
        encoder_hidden_states=prompt_embeds,
        txt_ids=text_ids,
        img_ids=img_ids,
        return_dict=False,
    )[0]


# --------------------------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def score_samples(pipe, prompts: list[str], steps: int, seeds: list[int], **call: Any) -> torch.Tensor:
    """World scores of `pipe(prompt=prompts, **call)` samples at 64 px, one per (seed, prompt):
    [len(seeds) * len(prompts)]."""
    scores = []
    for seed in seeds:
        images = pipe(
            prompt=prompts,
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(seed),
            output_type="pt",
            **call,
        ).images
        scores.append(world.score(images, prompts))
    return torch.cat(scores)


def sample_scores(pipe, prompts: list[str], steps: int, seeds: list[int]) -> torch.Tensor:
    """World scores of FLUX.1 `pipe` samples (guidance 3.5, T5 length 32): [len(seeds) * len(prompts)]."""
    return score_samples(
        pipe, prompts, steps, seeds, guidance_scale=GUIDANCE, max_sequence_length=MAX_SEQUENCE_LENGTH
    )


# --------------------------------------------------------------------------------------------------------------------
# Entry point


def _fresh_pipeline(layers: int, single_layers: int):
    """Tokenizers and untrained models assembled into a FluxPipeline; returns (pipe, parameter counts)."""
    from diffusers import FluxPipeline

    with _phase("tokenizers"), tempfile.TemporaryDirectory() as tmp:
        clip_tok = build_clip_tokenizer(Path(tmp) / "clip")
        t5_tok = build_t5_tokenizer(Path(tmp) / "t5")
    with _phase("models"):
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


def parameter_counts(parts: dict) -> dict[str, int]:
    """Parameters per component (logged, and recorded in build_info.json)."""
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in parts.items()}
    logger.info("parameters %s", n_params)
    return n_params


@dataclass(frozen=True)
class Family:
    """What differs between the FLUX.1 and FLUX.2 [klein] builds; `build` runs the same phases for every family.

    Attributes:
        name: the `--family` value, recorded in build_info.json.
        pipeline: the diffusers pipeline class name the folder loads with.
        fresh: (layers, single_layers) -> (pipe, parameter counts): tokenizers and untrained models.
        stats_key: the build_info.json key of the VAE latent normalisation.
        set_latent_stats: (vae, generator, n images) -> that normalisation, measured on world latents and set.
        kept_latent_stats: vae -> the normalisation of a loaded build.
        train_transformer: (pipe, steps, batch, lr, shift, images_per_prompt, generator, **options); None: the
            family's transformer is built untrained only.
        sample_scores: (pipe, prompts, steps, seeds) -> world scores of samples, the eval's sample_score_mean.
        options: the family's own training options, passed to train_transformer and recorded.
        eval_extra: (pipe, prompts, steps, seeds) -> more eval fields (other sampling settings), or None.
    """

    name: str
    pipeline: str
    fresh: Callable[[int, int], tuple[Any, dict[str, int]]]
    stats_key: str
    set_latent_stats: Callable[..., dict]
    kept_latent_stats: Callable[[Any], dict]
    train_transformer: Callable[..., None] | None
    sample_scores: Callable[..., torch.Tensor]
    options: dict = field(default_factory=dict)
    eval_extra: Callable[..., dict] | None = None


FLUX1 = Family(
    name="flux1",
    pipeline="FluxPipeline",
    fresh=_fresh_pipeline,
    stats_key="vae_factors",
    set_latent_stats=set_latent_factors,
    kept_latent_stats=lambda vae: {k: vae.config[k] for k in ("shift_factor", "scaling_factor")},
    train_transformer=train_transformer,
    sample_scores=sample_scores,
)


def _pipeline_class(family: Family):
    import diffusers

    return getattr(diffusers, family.pipeline)


def build(
    out: Path,
    vae_steps: int = 300,
    transformer_steps: int = 400,
    seed: int = 0,
    vae_batch: int = 16,
    transformer_batch: int = 32,
    vae_lr: float = 2e-3,
    decoder_steps: int | None = None,
    transformer_lr: float = 1e-3,
    shift: float = 3.0,
    images_per_prompt: int = 32,
    layers: int = 2,
    single_layers: int = 4,
    eval_steps: int = 12,
    eval_seeds: int = 2,
    latent_stat_images: int = 512,
    init_from: Path | None = None,
    family: Family = FLUX1,
) -> dict:
    """Build, train and save the tiny pipeline; returns a summary (also written to out/build_info.json).

    Args:
        out: output folder (diffusers layout of the family's pipeline).
        vae_steps, transformer_steps: optimisation steps (0: keep the random initialisation).
        decoder_steps: steps sharpening the VAE decoder with the encoder frozen (batch vae_batch, lr vae_lr);
            None: 2000 for a new build, 0 when continuing one.
        seed: seeds every random choice, so a build is reproducible on the same machine and thread count.
        eval_steps, eval_seeds: sampling steps and seeds of the final held-out evaluation (0 seeds: skip).
        latent_stat_images: rendered images whose latents set the VAE latent normalisation (FLUX.1: scaling/shift
            factors; FLUX.2: the batch-norm running statistics).
        init_from: an earlier build to continue (its VAE encoder and normalisation are kept; vae_steps is ignored).
        family: FLUX1 (FluxPipeline), `tools.build_tiny_flux2.family(...)` (Flux2KleinPipeline) or
            `tools.build_tiny_flux2.dev_family()` (Flux2Pipeline, untrained only).
    """
    if transformer_steps > 0 and family.train_transformer is None:
        raise ValueError(f"{family.name}: the transformer is built untrained only (transformer_steps=0)")
    t0 = time.perf_counter()
    times: dict[str, float] = {}

    def mark(name: str, since: float) -> float:
        times[name] = round(time.perf_counter() - since, 1)
        return time.perf_counter()

    if decoder_steps is None:
        decoder_steps = 0 if init_from is not None else 2000
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    # Its own stream: the decoder phase must not shift the draws of the transformer phase (same pool, same batches).
    decoder_generator = torch.Generator().manual_seed(10_000 + seed)
    t = time.perf_counter()
    earlier = None
    if init_from is not None:
        vae_steps = 0  # the VAE is the earlier build's, bit for bit
        with _phase("load"):
            earlier = json.loads((init_from / "build_info.json").read_text())
            if earlier.get("family", "flux1") != family.name:
                raise ValueError(f"{init_from} is a {earlier.get('family', 'flux1')} build, not {family.name}")
            pipe = _pipeline_class(family).from_pretrained(str(init_from))
            pipe.set_progress_bar_config(disable=True)
            vae, transformer = pipe.vae, pipe.transformer
            transformer.requires_grad_(True)
            stats = family.kept_latent_stats(vae)
            n_params = earlier["parameters"]
        t = mark("load", t)
    else:
        pipe, n_params = family.fresh(layers, single_layers)
        vae, transformer = pipe.vae, pipe.transformer
        t = mark("models", t)
        with _phase("vae"):
            if vae_steps > 0:
                train_vae(vae, vae_steps, vae_batch, vae_lr, kl_weight=1e-3, generator=generator)
            stats = family.set_latent_stats(vae, generator, latent_stat_images)
            vae.requires_grad_(False)
            logger.info("vae latent %s %s", family.stats_key, stats)
        t = mark("vae", t)
    if decoder_steps > 0:
        with _phase("decoder"):
            train_vae(vae, decoder_steps, vae_batch, vae_lr, 0.0, decoder_generator, decoder_only=True)
        t = mark("decoder", t)
    with _phase("transformer"):
        if transformer_steps > 0:
            family.train_transformer(
                pipe, transformer_steps, transformer_batch, transformer_lr, shift, images_per_prompt, generator,
                **family.options,
            )
        transformer.requires_grad_(False)
    t = mark("transformer", t)
    with _phase("save"):
        out.mkdir(parents=True, exist_ok=True)
        if init_from is None:
            pipe.save_pretrained(str(out), safe_serialization=True)
        else:
            # Copy the kept parts verbatim: a tokenizer round trip through save_pretrained drops the T5 tokenizer's
            # Lowercase normalizer (transformers 5), which would change how an upper-case prompt tokenizes.
            if out.resolve() != init_from.resolve():
                shutil.copytree(init_from, out, dirs_exist_ok=True)
            transformer.save_pretrained(str(out / "transformer"), safe_serialization=True)
            if decoder_steps > 0:
                vae.save_pretrained(str(out / "vae"), safe_serialization=True)
    t = mark("save", t)

    summary: dict = {
        "family": family.name,
        "seed": seed,
        "init_from": earlier,
        "vae_steps": vae_steps,
        "decoder_steps": decoder_steps,
        "transformer_steps": transformer_steps,
        "transformer_lr": transformer_lr,
        **({"transformer_options": dict(family.options)} if family.options else {}),
        "parameters": n_params,
        family.stats_key: stats,
        "threads": torch.get_num_threads(),
    }
    if eval_seeds > 0:
        with _phase("evaluate"):
            _, heldout = world.split_prompts()
            seeds = list(range(eval_seeds))
            sampled = family.sample_scores(pipe, heldout, eval_steps, seeds)
            rendered = world.render(heldout, RESOLUTION, torch.Generator().manual_seed(seed))
            truth = world.score(rendered, heldout)
            decoded = reconstruction_scores(vae, rendered, heldout)
            summary["eval"] = {
                "prompts": "heldout",
                "num_inference_steps": eval_steps,
                "seeds": eval_seeds,
                "sample_score_mean": round(sampled.mean().item(), 4),
                "ground_truth_score_mean": round(truth.mean().item(), 4),
                "decoded_ground_truth_score_mean": round(decoded.mean().item(), 4),
            }
            logger.info(
                "held-out score: samples %.3f, ground truth %.3f, after a VAE round trip %.3f",
                sampled.mean(), truth.mean(), decoded.mean(),
            )
            if family.eval_extra is not None:
                summary["eval"].update(family.eval_extra(pipe, heldout, eval_steps, seeds))
                logger.info("held-out eval %s", summary["eval"])
        t = mark("evaluate", t)
    times["total"] = round(time.perf_counter() - t0, 1)
    summary["seconds"] = times
    (out / "build_info.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("build done: %s", json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.build_tiny", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (diffusers layout of the family's pipeline)")
    p.add_argument("--family", choices=("flux1", "flux2", "flux2-dev", "flux1-kontext"), default="flux1",
                   help="flux1: FluxPipeline (default); flux2: Flux2KleinPipeline; flux2-dev: Flux2Pipeline, untrained "
                        "only (tools/build_tiny_flux2.py); flux1-kontext: the --init-from FLUX.1 build as a "
                        "FluxKontextPipeline folder, its transformer trained to edit with --transformer-steps "
                        "(tools/build_tiny_kontext.py)")
    p.add_argument("--copy", action="store_true", help="flux1-kontext: copy the components instead of linking them")
    p.add_argument("--untrained", action="store_true",
                   help="no training and no evaluation, in seconds (build_tiny.UNTRAINED)")
    p.add_argument("--vae-steps", type=int, default=300)
    p.add_argument("--transformer-steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-batch", type=int, default=16)
    p.add_argument("--transformer-batch", type=int, default=32)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--decoder-steps", type=int, default=None,
                   help="sharpen the VAE decoder, encoder frozen (default 2000 for a new build, 0 with --init-from)")
    p.add_argument("--transformer-lr", type=float, default=1e-3)
    p.add_argument("--shift", type=float, default=3.0, help="time shift of the training sigma distribution")
    p.add_argument("--images-per-prompt", type=int, default=32, help="rendered latents per prompt in the training pool")
    p.add_argument("--layers", type=int, default=2, help="double-stream blocks")
    p.add_argument("--single-layers", type=int, default=4, help="single-stream blocks")
    p.add_argument("--eval-steps", type=int, default=12)
    p.add_argument("--eval-seeds", type=int, default=2, help="0 skips the held-out evaluation")
    p.add_argument("--latent-stat-images", type=int, default=512,
                   help="rendered images whose latents set the VAE's latent normalisation")
    p.add_argument("--init-from", type=Path, default=None,
                   help="an earlier build to continue (transformer, and the decoder with --decoder-steps)")
    # One thread by default: on a shared 2-core machine two OpenMP threads per process ran ~8x slower per step.
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (results depend on it bit-wise)")
    flux2 = p.add_argument_group("flux2 only")
    flux2.add_argument("--cfg-dropout", type=float, default=None,
                       help="share of training prompts replaced by the empty prompt, which CFG's negative prompt is "
                            "(default 0.1)")
    flux2.add_argument("--long-text-every", type=int, default=None,
                       help="every N-th step, batch/8 samples see the pipeline's default 512-token padding instead "
                            "of 32 (default 8; 0: never)")
    args = p.parse_args(argv)
    if args.family == "flux1-kontext":
        from tools.build_tiny_kontext import SOURCE, build_kontext

        given = {a for a in vars(args) if getattr(args, a) != p.get_default(a)}
        other = sorted(given - {"family", "out", "init_from", "copy", "threads", "transformer_steps",
                                "transformer_batch", "transformer_lr", "shift", "images_per_prompt", "seed",
                                "eval_steps", "eval_seeds"})
        if other:
            raise SystemExit(f"--{other[0].replace('_', '-')}: --family flux1-kontext trains the transformer only "
                             "(--transformer-steps); drop it")
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        torch.set_num_threads(args.threads)
        # Without --transformer-steps the folder is a layout of the source only (its transformer never edits).
        steps = args.transformer_steps if "transformer_steps" in given else 0
        print(build_kontext(args.out, args.init_from or SOURCE, copy=args.copy, transformer_steps=steps,
                            transformer_batch=args.transformer_batch, transformer_lr=args.transformer_lr,
                            shift=args.shift, images_per_prompt=args.images_per_prompt, seed=args.seed,
                            eval_steps=args.eval_steps, eval_seeds=args.eval_seeds))
        return
    if args.copy:
        raise SystemExit("--copy: a flux1-kontext option (--family flux1-kontext)")
    for name, value in (UNTRAINED if args.untrained else {}).items():
        flag = f"--{name.replace('_', '-')}"
        if getattr(args, name) != p.get_default(name):
            raise SystemExit(f"--untrained sets {flag} {value}: drop {flag}")
        setattr(args, name, value)
    for name in ("vae_steps", "decoder_steps", "transformer_steps", "eval_seeds", "eval_steps", "long_text_every",
                 "latent_stat_images"):
        if (getattr(args, name) or 0) < 0:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(args, name)}")
    if args.init_from is not None and not (args.init_from / "build_info.json").is_file():
        raise SystemExit(f"--init-from: {args.init_from} is not a build of this tool (no build_info.json)")
    flux2_options = {k: v for k, v in (("cfg_dropout", args.cfg_dropout), ("long_text_every", args.long_text_every))
                     if v is not None}
    if args.family != "flux2" and flux2_options:
        raise SystemExit(f"--{next(iter(flux2_options)).replace('_', '-')}: a flux2 option (--family flux2)")
    if args.family == "flux1":
        family = FLUX1
    else:
        from tools import build_tiny_flux2

        family = build_tiny_flux2.family(**flux2_options) if args.family == "flux2" else build_tiny_flux2.dev_family()
    if family.train_transformer is None and args.transformer_steps > 0:
        raise SystemExit(f"--family {family.name}: builds an untrained transformer only; add --untrained (or "
                         "--transformer-steps 0)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    build(
        args.out,
        vae_steps=args.vae_steps,
        transformer_steps=args.transformer_steps,
        seed=args.seed,
        vae_batch=args.vae_batch,
        transformer_batch=args.transformer_batch,
        vae_lr=args.vae_lr,
        decoder_steps=args.decoder_steps,
        transformer_lr=args.transformer_lr,
        shift=args.shift,
        images_per_prompt=args.images_per_prompt,
        layers=args.layers,
        single_layers=args.single_layers,
        eval_steps=args.eval_steps,
        eval_seeds=args.eval_seeds,
        init_from=args.init_from,
        family=family,
        latent_stat_images=args.latent_stat_images,
    )


if __name__ == "__main__":
    # Run the importable module's main, so that tools.build_tiny_flux2 and this entry point share one module (and one
    # Family class, one logger) rather than `__main__` and a second `tools.build_tiny`.
    from tools.build_tiny import main as _main

    _main()
