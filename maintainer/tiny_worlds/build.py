"""The phases of a tiny-world build, the same for every family, and the helpers they share.

`build(out, builder)` runs them, each logged with its time:

1. tokenizers and frozen random text encoders, the untrained VAE and transformer (`Builder.fresh`);
2. the VAE trained briefly as an autoencoder on rendered world images (`train_vae`); its latent normalisation measured
   on world latents and set (`Builder.set_latent_stats`: FLUX.1's scaling/shift factors, FLUX.2's batch-norm
   statistics); then its decoder alone sharpened (`decoder_steps`, encoder frozen, so the latent space the
   transformer learns is unchanged): after the short joint phase the FLUX.1 decoder rounds a square's corners (form
   0.22 on decoded ground truth), which would put squares out of any policy's reach;
3. the transformer pretrained by rectified-flow matching (`flow_matching`) on VAE latents of rendered images of every
   world prompt (`latent_pool`), conditioned exactly as its pipeline conditions it (`Builder.train_transformer`);
4. `save_pretrained` of the family's pipeline (safetensors);
5. a short evaluation: world score of pipeline samples on the held-out prompts, next to rendered ground truth and to
   ground truth after the VAE's round trip (the most a latent policy can reach).

`UNTRAINED` (the command line's `--untrained`: no VAE, decoder or transformer steps, no evaluation) gives an untrained
but complete folder in seconds (tests use it). `init_from` continues an earlier build: its tokenizers, text encoders
and VAE encoder are kept bit for bit; the transformer trains further and, with `decoder_steps`, the VAE decoder too,
so a longer pretraining does not redo the VAE phase. The decoder phase draws from its own generator, so it never
changes what the transformer phase trains on. `build_info.json` then records the chain of builds (`init_from`),
which is what reproduces the result.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from grpo.models import ModelFamily
from grpo.tiny import world

logger = logging.getLogger(__name__)

RESOLUTION = 64  # every tiny world's image side
# `build` arguments of an untrained but complete folder (--untrained): an untrained VAE's latent statistics need
# no more than a few images.
UNTRAINED = dict(vae_steps=0, decoder_steps=0, transformer_steps=0, eval_seeds=0, latent_stat_images=16)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Logs a build phase's start and its time."""
    start = time.perf_counter()
    logger.info("phase %s ...", name)
    yield
    logger.info("phase %s done in %.1f s", name, time.perf_counter() - start)


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



def parameter_counts(parts: dict) -> dict[str, int]:
    """Parameters per component (logged, and recorded in build_info.json)."""
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in parts.items()}
    logger.info("parameters %s", n_params)
    return n_params


def latent_size(pipe) -> int:
    """Side of a RESOLUTION image's VAE latent grid before 2x2 packing (grpo.models.Parts.latent_size)."""
    return 2 * (RESOLUTION // (pipe.vae_scale_factor * 2))


# --------------------------------------------------------------------------------------------------------------------
# The build


@dataclass(frozen=True)
class Builder:
    """What a family adds to the phases `build` runs for every family: the build-time half of a model family, whose
    run-time half (pipeline class, packing, RoPE ids, the transformer call) is `model`, the product's own.

    Attributes:
        name: the `--family` value, recorded in build_info.json (flux1, flux2, flux2-dev).
        model: the grpo.models family of the pipeline the folder is saved as.
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
    model: ModelFamily
    fresh: Callable[[int, int], tuple[Any, dict[str, int]]]
    stats_key: str
    set_latent_stats: Callable[..., dict]
    kept_latent_stats: Callable[[Any], dict]
    train_transformer: Callable[..., None] | None
    sample_scores: Callable[..., torch.Tensor]
    options: dict = field(default_factory=dict)
    eval_extra: Callable[..., dict] | None = None


def build(
    out: Path,
    builder: Builder,
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
) -> dict:
    """Build, train and save the tiny pipeline; returns a summary (also written to out/build_info.json).

    Args:
        out: output folder (diffusers layout of the family's pipeline).
        builder: the family: flux1.BUILDER (FluxPipeline), flux2.klein(...) (Flux2KleinPipeline) or flux2.DEV
            (Flux2Pipeline, untrained only).
        vae_steps, transformer_steps: optimisation steps (0: keep the random initialisation).
        decoder_steps: steps sharpening the VAE decoder with the encoder frozen (batch vae_batch, lr vae_lr);
            None: 2000 for a new build, 0 when continuing one.
        seed: seeds every random choice, so a build is reproducible on the same machine and thread count.
        eval_steps, eval_seeds: sampling steps and seeds of the final held-out evaluation (0 seeds: skip).
        latent_stat_images: rendered images whose latents set the VAE latent normalisation (FLUX.1: scaling/shift
            factors; FLUX.2: the batch-norm running statistics).
        init_from: an earlier build to continue (its VAE encoder and normalisation are kept; vae_steps is ignored).
    """
    if transformer_steps > 0 and builder.train_transformer is None:
        raise ValueError(f"{builder.name}: the transformer is built untrained only (transformer_steps=0)")
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
        with phase("load"):
            earlier = json.loads((init_from / "build_info.json").read_text())
            if earlier.get("family", "flux1") != builder.name:
                raise ValueError(f"{init_from} is a {earlier.get('family', 'flux1')} build, not {builder.name}")
            pipe = builder.model.pipeline_class().from_pretrained(str(init_from))
            pipe.set_progress_bar_config(disable=True)
            vae, transformer = pipe.vae, pipe.transformer
            transformer.requires_grad_(True)
            stats = builder.kept_latent_stats(vae)
            n_params = earlier["parameters"]
        t = mark("load", t)
    else:
        pipe, n_params = builder.fresh(layers, single_layers)
        vae, transformer = pipe.vae, pipe.transformer
        t = mark("models", t)
        with phase("vae"):
            if vae_steps > 0:
                train_vae(vae, vae_steps, vae_batch, vae_lr, kl_weight=1e-3, generator=generator)
            stats = builder.set_latent_stats(vae, generator, latent_stat_images)
            vae.requires_grad_(False)
            logger.info("vae latent %s %s", builder.stats_key, stats)
        t = mark("vae", t)
    if decoder_steps > 0:
        with phase("decoder"):
            train_vae(vae, decoder_steps, vae_batch, vae_lr, 0.0, decoder_generator, decoder_only=True)
        t = mark("decoder", t)
    with phase("transformer"):
        if transformer_steps > 0:
            builder.train_transformer(
                pipe, transformer_steps, transformer_batch, transformer_lr, shift, images_per_prompt, generator,
                **builder.options,
            )
        transformer.requires_grad_(False)
    t = mark("transformer", t)
    with phase("save"):
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
        "family": builder.name,
        "seed": seed,
        "init_from": earlier,
        "vae_steps": vae_steps,
        "decoder_steps": decoder_steps,
        "transformer_steps": transformer_steps,
        "transformer_lr": transformer_lr,
        **({"transformer_options": dict(builder.options)} if builder.options else {}),
        "parameters": n_params,
        builder.stats_key: stats,
        "threads": torch.get_num_threads(),
    }
    if eval_seeds > 0:
        with phase("evaluate"):
            _, heldout = world.split_prompts()
            seeds = list(range(eval_seeds))
            sampled = builder.sample_scores(pipe, heldout, eval_steps, seeds)
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
            if builder.eval_extra is not None:
                summary["eval"].update(builder.eval_extra(pipe, heldout, eval_steps, seeds))
                logger.info("held-out eval %s", summary["eval"])
        t = mark("evaluate", t)
    times["total"] = round(time.perf_counter() - t0, 1)
    summary["seconds"] = times
    (out / "build_info.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("build done: %s", json.dumps(summary))
    return summary

