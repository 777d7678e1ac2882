"""The tiny FLUX.3 world: a `Flux3ModularPipeline` folder (diffusers 0.42's modular save: modular_model_index.json
and one subfolder per loaded component), built offline.

    python -m maintainer.tiny_worlds --family flux3 --out assets/tiny-flux3 [--transformer-steps N] [--seed S] ...

FLUX.3 has only a modular pipeline, so this builder does not go through build.py's `build` (which saves and samples
a DiffusionPipeline); it reuses its pieces (`flow_matching`, `latent_pool`, `phase`, `parameter_counts`) and
FLUX.2's tokenizer training (`train_bpe`, `text_arch`):

1. tokenizer: a `Qwen3VLProcessor` (what Flux3TextEncoderStep loads from tokenizer/ with AutoProcessor): the
   byte-level BPE trained on the world prompts inside Qwen3-VL's chat template for one user turn with
   `add_generation_prompt=True` (no think block: Qwen3-VL-Instruct's template has none), Qwen's special tokens and the
   vision ones the processor looks up (<|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>), and an image
   and a video processor the prompt encoding never runs. A world prompt in the template is at most 19 tokens, so the
   pipeline pads every world prompt to 80 (its `pad_multiple`).
2. text encoder: a frozen random `Qwen3VLForConditionalGeneration`: a text model of `flux2.text_arch` (hidden 32)
   with 33 layers, one more than the deepest of the stacked hidden states (4, 8, ..., 32: the step's default
   `text_encoder_out_layers`), M-RoPE sections (2, 3, 3) over the 16-dim heads, and a one-block vision tower. The
   transformer's joint_attention_dim is 8 x 32 = 256.
3. vae: the tiny FLUX.2 VAE, copied from assets/tiny-flux2/vae (`AutoencoderKLFlux2` is FLUX.3's VAE too; 64 px ->
   4 x 16 x 16, patchified 16 x 8 x 8, its batch-norm statistics already set from world latents).
4. transformer: `Flux3Transformer2DModel` (16 in-channels for the image and the reference modes, 1 per-mode block
   per mode, 4 joint single blocks, head 4 x 32, RoPE axes (8, 8, 8, 8)), trained by `flow_matching` on the pipeline's
   own latents (Flux3VaeEncoderStep: posterior mode, patchified, batch-norm normalised), conditioned as
   Flux3LoopDenoiser conditions it, through the trainer's own call (grpo.models.FLUX3): the 80-token embeddings of
   Flux3TextEncoderStep, text ids of Flux3TextRoPEInputsStep, image ids at RoPE scale 0.5, timestep sigma. A
   `cfg_dropout` share of the samples get the empty prompt, the pipeline's CFG negative prompt: a base model, which
   the pipeline samples with CFG (its guider) by default.
5. scheduler and guider: not saved; the pipeline builds them from its blocks' specs (FlowMatchEulerDiscreteScheduler
   with the constant shift 6.93, ClassifierFreeGuidance at 3.5).

The index: `save_pretrained` records each component's source as the absolute save folder; the builder writes null
there instead (no machine path in the repository): `Flux3ModularPipeline.from_pretrained(folder)` loads the components
from the folder's own subfolders either way (`_is_local_component`).

Prompt upsampling: Flux3AutoBlocks starts with a prompt upsampler (a Qwen3.5-9B fine-tune) that this world does not
have; callers remove the step, as diffusers documents (`blocks.sub_blocks.pop("prompt_upsampler")`, `sampling_
pipeline`), and encode the prompt as given.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from grpo.models.flux3 import FLUX3
from grpo.tiny import world
from maintainer.tiny_worlds.build import RESOLUTION, flow_matching, latent_pool, parameter_counts, phase
from maintainer.tiny_worlds.flux2 import IM_END, IM_START, PAD, TEXT_HIDDEN, text_arch, train_bpe

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
VAE_SOURCE = ROOT / "assets" / "tiny-flux2" / "vae"
PAD_MULTIPLE = 80  # Flux3TextEncoderStep's pad_multiple: every world prompt is padded to 80 tokens
PIPELINE_MAX_SEQUENCE_LENGTH = 8192  # Flux3TextEncoderStep's default max_sequence_length
TEXT_ENCODER_OUT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)  # Flux3TextEncoderStep's default text_encoder_out_layers
CFG_GUIDANCE = 4.0
VISION = VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                          "<|video_pad|>")
# Qwen3-VL-Instruct's chat template, reduced to what the pipeline renders: string user turns and the generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_processor(folder: Path):
    """`train_bpe` on the world prompts in CHAT_TEMPLATE as a `Qwen2TokenizerFast`, inside a `Qwen3VLProcessor`."""
    from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    specials = [PAD, IM_START, IM_END, *VISION]
    template = f"{IM_START}user\n{{}}{IM_END}\n{IM_START}assistant\n"
    bpe = train_bpe([template.format(p) for p in world.all_prompts()], specials)
    folder.mkdir(parents=True, exist_ok=True)
    bpe.save(str(folder / "tokenizer.json"))
    trained = json.loads((folder / "tokenizer.json").read_text())["model"]
    tokenizer = Qwen2TokenizerFast(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]],
                                   unk_token=None, eos_token=IM_END, pad_token=PAD,
                                   extra_special_tokens=[IM_START, *VISION],
                                   model_max_length=PIPELINE_MAX_SEQUENCE_LENGTH)
    patch = dict(patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**patch), tokenizer=tokenizer,
                            video_processor=Qwen3VLVideoProcessor(**patch), chat_template=CHAT_TEMPLATE)


def build_text_encoder(processor):
    """Frozen random Qwen3VLForConditionalGeneration (module docstring, 2)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = processor.tokenizer
    text = text_arch(tokenizer, TEXT_ENCODER_OUT_LAYERS)
    text.update(max_position_embeddings=PIPELINE_MAX_SEQUENCE_LENGTH,
                rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0, mrope_section=[2, 3, 3],
                                     mrope_interleaved=True))
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0])
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids(IMAGE_PAD),
                           video_token_id=ids(VIDEO_PAD), vision_start_token_id=ids(VISION_START),
                           vision_end_token_id=ids(VISION_END), tie_word_embeddings=True)
    return Qwen3VLForConditionalGeneration(config).eval().requires_grad_(False)


def build_transformer(layers: int = 1, single_layers: int = 4):
    """Flux3Transformer2DModel for the tiny VAE's patchified latents (module docstring, 4)."""
    from diffusers import Flux3Transformer2DModel

    return Flux3Transformer2DModel(in_channels=16, cond_in_channels=16, num_layers=layers,
                                   num_single_layers=single_layers, attention_head_dim=32, num_attention_heads=4,
                                   joint_attention_dim=len(TEXT_ENCODER_OUT_LAYERS) * TEXT_HIDDEN,
                                   mlp_ratio=3.0, axes_dims_rope=(8, 8, 8, 8))


def sampling_pipeline(folder: Path | str, guidance: float = CFG_GUIDANCE):
    """`folder` loaded with Flux3ModularPipeline, every component loaded in float32, the prompt upsampler step
    removed (the world has none) and the guider at `guidance` (1: no CFG, one transformer pass a step)."""
    from diffusers import ClassifierFreeGuidance, Flux3ModularPipeline

    pipe = Flux3ModularPipeline.from_pretrained(str(folder))
    blocks = pipe.blocks
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline(str(folder))
    pipe.load_components(dtype=torch.float32)
    pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def encode_latents(vae, images: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] -> the tokens the transformer sees: Flux3VaeEncoderStep (posterior mode,
    patchified, batch-norm normalised), then Flux3PrepareLatentsStep's packing (FLUX3.pack)."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep

    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    z = torch.cat([Flux3VaeEncoderStep._patchify_latents(vae.encode(c * 2 - 1).latent_dist.mode())
                   for c in images.split(128)])
    return FLUX3.pack((z - mean) / std)


def train_transformer(transformer, embeds: torch.Tensor, vae, steps: int, batch: int, lr: float, shift: float,
                      images_per_prompt: int, generator: torch.Generator, cfg_dropout: float) -> None:
    """Rectified flow on every world prompt (`embeds` [P + 1, 80, 256]: the prompts, then ""), a `cfg_dropout` share
    of the samples conditioned on the empty prompt (drawn after the batch's own draws, from the same generator)."""
    prompts = world.all_prompts()
    empty = len(prompts)
    vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    latent_size = 2 * (RESOLUTION // (vae_scale_factor * 2))  # Parts.latent_size
    cond = FLUX3.conditioning({"prompt_embeds": embeds}, latent_size, 1.0, False, torch.device("cpu"), torch.float32)
    latents, pool_index = latent_pool(prompts, images_per_prompt, lambda x: encode_latents(vae, x), generator)

    def predict(xt, sigma, rows, step):
        drop = torch.rand(len(rows), generator=generator) < cfg_dropout
        rows = torch.where(drop, torch.full_like(rows, empty), rows)
        return FLUX3.velocity(transformer, xt, sigma, cond.select(rows))

    flow_matching(transformer, latents, pool_index, predict, steps, batch, lr, shift, generator)


@torch.no_grad()
def evaluate(folder: Path, steps: int, seeds: list[int]) -> dict:
    """World scores of Flux3ModularPipeline samples of the held-out prompts (one prompt a call, as the pipeline
    takes them), with CFG 4 and without (guidance 1)."""
    _, heldout = world.split_prompts()
    out = {"prompts": "heldout", "num_inference_steps": steps, "seeds": len(seeds)}
    for guidance in (1.0, CFG_GUIDANCE):
        pipe = sampling_pipeline(folder, guidance)
        scores = []
        for seed in seeds:
            generator = torch.Generator().manual_seed(seed)
            images = torch.cat([pipe(prompt=p, height=RESOLUTION, width=RESOLUTION, num_inference_steps=steps,
                                     generator=generator, output_type="pt", output="images") for p in heldout])
            scores.append(world.score(images, heldout))
        out[f"sample_score_mean_guidance_{guidance:g}"] = round(torch.cat(scores).mean().item(), 4)
    rendered = world.render(heldout, RESOLUTION, torch.Generator().manual_seed(0))
    out["ground_truth_score_mean"] = round(world.score(rendered, heldout).mean().item(), 4)
    return out


def build_flux3(out: Path, transformer_steps: int = 600, transformer_batch: int = 32, transformer_lr: float = 1e-3,
                shift: float = 3.0, images_per_prompt: int = 16, layers: int = 1, single_layers: int = 4,
                cfg_dropout: float = 0.1, seed: int = 0, eval_steps: int = 12, eval_seeds: int = 2) -> dict:
    """Build, train and save the tiny FLUX.3 folder `out`; returns the summary written to out/build_info.json."""
    from diffusers import AutoencoderKLFlux2
    from diffusers.modular_pipelines import Flux3AutoBlocks

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    with phase("models"), tempfile.TemporaryDirectory() as tmp:
        processor = build_processor(Path(tmp))
        text_encoder = build_text_encoder(processor)
        vae = AutoencoderKLFlux2.from_pretrained(VAE_SOURCE).requires_grad_(False).eval()
        transformer = build_transformer(layers, single_layers)
        n_params = parameter_counts(dict(transformer=transformer, vae=vae, text_encoder=text_encoder))
    with phase("prompts"):
        encode = FLUX3.encode_chunk
        holder = type("Components", (), dict(text_encoder=text_encoder, tokenizer=processor))
        embeds = encode(holder, world.all_prompts() + [""], PAD_MULTIPLE, torch.device("cpu"))["prompt_embeds"]
    seconds["models"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    with phase("transformer"):
        if transformer_steps > 0:
            train_transformer(transformer, embeds, vae, transformer_steps, transformer_batch, transformer_lr, shift,
                              images_per_prompt, generator, cfg_dropout)
        transformer.requires_grad_(False)
    seconds["transformer"] = round(time.perf_counter() - t, 1)
    with phase("save"):
        if out.exists():
            shutil.rmtree(out)
        pipe = Flux3AutoBlocks().init_pipeline()
        pipe.update_components(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=processor)
        pipe.save_pretrained(str(out), overwrite_modular_index=True)
        index_path = out / "modular_model_index.json"
        index = json.loads(index_path.read_text())
        for spec in index.values():
            if isinstance(spec, list) and len(spec) == 3 and spec[2].get("pretrained_model_name_or_path"):
                spec[2]["pretrained_model_name_or_path"] = None
        index_path.write_text(json.dumps(index, indent=2) + "\n")
        vae_config = out / "vae" / "config.json"  # the VAE's source as a repository path, not this machine's
        vae_config.write_text(json.dumps({**json.loads(vae_config.read_text()),
                                          "_name_or_path": str(VAE_SOURCE.relative_to(ROOT))}, indent=2) + "\n")
    summary = {"family": "flux3", "seed": seed, "vae": "assets/tiny-flux2/vae (copied)",
               "transformer_steps": transformer_steps, "transformer_batch": transformer_batch,
               "transformer_lr": transformer_lr, "shift": shift, "images_per_prompt": images_per_prompt,
               "cfg_dropout": cfg_dropout, "parameters": n_params, "threads": torch.get_num_threads()}
    if eval_seeds > 0:
        t = time.perf_counter()
        with phase("evaluate"):
            summary["eval"] = evaluate(out, eval_steps, list(range(eval_seeds)))
            logger.info("held-out eval %s", summary["eval"])
        seconds["evaluate"] = round(time.perf_counter() - t, 1)
    summary["seconds"] = seconds
    (out / "build_info.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
