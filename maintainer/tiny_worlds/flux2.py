"""The FLUX.2 families of the tiny world's builder: a `Flux2KleinPipeline` folder ([klein]) and an untrained
`Flux2Pipeline` one ([dev]), built offline.

    python -m maintainer.tiny_worlds --family flux2 --out assets/tiny-flux2 [--vae-steps N] [--transformer-steps N] ...

build.py runs the phases (tokenizer, models, VAE, decoder, transformer, save, evaluate, `--init-from` chains,
build_info.json); this module holds what FLUX.2 does differently:

1. tokenizer: a byte-level BPE trained on the world prompts inside the chat template, loaded as `Qwen2TokenizerFast`
   with Qwen3's special tokens (<|endoftext|> pad, <|im_start|>, <|im_end|> eos, <think> / </think>) and a chat
   template that renders what Qwen3's does for one user turn with `add_generation_prompt=True, enable_thinking=False`.
   Every world word is one token; a prompt in the template is 19 tokens.
2. text encoder: a frozen random `Qwen3ForCausalLM` of 28 layers, hidden 32: the pipeline stacks hidden_states
   (9, 18, 27) (`text_encoder_out_layers`); hidden_states[0] is the embedding and hidden_states[28] the final-norm
   output, so 28 layers is the fewest that keeps 27 a plain layer output, as in Qwen3-4B (36 layers). The
   transformer's joint_attention_dim is 3 x 32 = 96.
3. vae: `AutoencoderKLFlux2` with the FLUX.1 tiny VAE's blocks (`build.vae_arch`: 64 px -> 4 x 16 x 16), whose
   latents the pipeline patchifies 2x2 (16 x 8 x 8) and normalises with `vae.bn`'s running statistics: those are set
   from the patchified latents of rendered world images (`set_bn_statistics`), as FLUX.1's scaling/shift factors
   are.
4. transformer: `Flux2Transformer2DModel` (16 in-channels, 2 double + 4 single blocks, head 4 x 32, RoPE axes
   (8, 8, 8, 8) over the (T, H, W, L) ids, no guidance embedding: klein has none), trained by build.py's
   `flow_matching` on `pipe._encode_vae_image` latents, conditioned as `Flux2KleinPipeline.__call__` conditions it:
   `encode_prompt` embeddings and text ids, latent ids from `_prepare_latent_ids`, timestep sigma (the pipeline passes
   t / 1000), guidance None.
5. scheduler: FlowMatchEulerDiscreteScheduler with klein's config (dynamic shifting; the pipeline passes
   mu = compute_empirical_mu(image tokens, steps), so shift and the base/max keys are unused);
   model_index.json `is_distilled: false`.

Prompt length. The pipeline pads every prompt to `max_sequence_length` (padding="max_length", default 512) and the
transformer attends to all of it (no mask): at 512, 576 tokens per sample instead of 32 + 64, ~8x the cost of a
training step. The model trains and samples at MAX_SEQUENCE_LENGTH 32 (pass it to the pipeline, as the FLUX.1 tiny
model's callers pass 32); the encoder is causal and pads on the right, so the first 32 positions of a 512 encoding
are the 32-token encoding, and 512 only adds 480 pad tokens. Every `long_text_every`-th step, batch/8 samples train
on the 512 encoding, so that the pipeline's default call keeps working (the eval records it).

Guidance. Klein ships as base (`is_distilled` false: CFG with guidance_scale 4 by default, ~50 steps) and distilled
(4 steps, guidance ignored). This model is a plain flow-matching model, not step-distilled: it is a base model, and
`cfg_dropout` of the training prompts are the empty prompt, which is the pipeline's CFG negative prompt.
guidance_scale 1.0 (one transformer pass a step, as the eval samples) turns CFG off.

FLUX.2 [dev], untrained (`build_dev`, `python -m maintainer.tiny_worlds --family flux2-dev --untrained --out OUT`):
a `Flux2Pipeline` folder from the same VAE, scheduler and BPE training, with [dev]'s own parts: a `PixtralProcessor`
whose tokenizer is the BPE trained on the world prompts as Flux2Pipeline renders them (its system message first, in a
reduced Mistral-Small-3 chat template), a frozen random `Mistral3ForConditionalGeneration` (31 text layers for the
stacked hidden states 10, 20, 30; a one-layer Pixtral vision tower) and the transformer with a guidance embedding.
Nothing trains it: it checks that the trainer runs Flux2Pipeline's own code (prompt encoding, guidance, latents) in
seconds, so tests build it where they need it.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from pathlib import Path

import torch

from grpo.models import FLUX2_DEV, FLUX2_KLEIN, Conditioning, ModelFamily
from grpo.tiny import world
from maintainer.tiny_worlds.build import (
    RESOLUTION,
    UNTRAINED,
    Builder,
    build,
    flow_matching,
    latent_pool,
    latent_size,
    parameter_counts,
    phase,
    random_renders,
    score_samples,
    vae_arch,
)

logger = logging.getLogger(__name__)

MAX_SEQUENCE_LENGTH = 32
PIPELINE_MAX_SEQUENCE_LENGTH = 512  # Flux2KleinPipeline's default
TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's default text_encoder_out_layers
TEXT_HIDDEN = 32
GUIDANCE = 1.0  # no CFG: one transformer pass a step
CFG_GUIDANCE = 4.0  # Flux2KleinPipeline's default guidance_scale
# black-forest-labs/FLUX.2-klein-4B scheduler/scheduler_config.json (diffusers keys): FLUX.1-dev's keys with
# exponential time shifting. With use_dynamic_shifting the klein pipeline passes its own mu, so `shift` and the
# base/max keys (FluxPipeline's calculate_shift inputs) do not act.
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    time_shift_type="exponential",
)

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
# Qwen3's chat template, reduced to what the pipeline renders: user turns, the assistant generation prompt and the
# empty think block of enable_thinking=False.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


# --------------------------------------------------------------------------------------------------------------------
# Components


def chat_text(tokenizer, prompt: str) -> str:
    """The text the pipeline tokenizes for `prompt` (Flux2KleinPipeline._get_qwen3_prompt_embeds)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def train_bpe(texts: list[str], specials: list[str]):
    """A byte-level BPE trained on `texts` with Qwen2's normalizer and pre-tokenizer (NFC, Qwen's split regex, byte
    level) and all 256 bytes as its alphabet, so any text tokenizes (no unknown token).

    It trains on the text between the `specials`, which the tokenizer never splits; its vocabulary is larger than the
    merges the corpus has, so every word of `texts` ends up one token.

    Returns:
        tokenizers.Tokenizer with `specials` as its first ids, in order.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    split = re.compile("|".join(re.escape(t) for t in specials))
    bpe.train_from_iterator([piece for t in texts for piece in split.split(t) if piece], trainer)
    return bpe


def build_qwen_tokenizer(folder: Path):
    """`train_bpe` on the world prompts in the chat template, loaded as `Qwen2TokenizerFast` (which rebuilds Qwen2's
    normalizer and pre-tokenizer from a vocab and merges).

    Args:
        folder: where the trained tokenizer.json is written.

    Returns:
        transformers.Qwen2TokenizerFast (model_max_length 512, right padding with <|endoftext|>, eos <|im_end|>).
    """
    from transformers import Qwen2TokenizerFast

    specials = [PAD, IM_START, IM_END]
    added = [THINK, END_THINK]  # Qwen3 has them as added, non-special tokens
    template = f"{IM_START}user\n{{}}{IM_END}\n{IM_START}assistant\n{THINK}\n\n{END_THINK}\n\n"
    bpe = train_bpe([template.format(p) for p in world.all_prompts()], specials + added)
    folder.mkdir(parents=True, exist_ok=True)
    bpe.save(str(folder / "tokenizer.json"))
    trained = json.loads((folder / "tokenizer.json").read_text())["model"]
    tok = Qwen2TokenizerFast(
        vocab=trained["vocab"],
        merges=[tuple(m) for m in trained["merges"]],
        unk_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        extra_special_tokens=[IM_START],
        model_max_length=PIPELINE_MAX_SEQUENCE_LENGTH,
        chat_template=CHAT_TEMPLATE,
    )
    tok.add_tokens(added)
    return tok


def text_arch(tokenizer, out_layers: tuple[int, ...]) -> dict:
    """The tiny decoder-only text model of both FLUX.2 encoders (Qwen3, Mistral): hidden 32, 2 heads of 16, 1 KV
    head, and one layer more than the deepest of `out_layers`, the hidden states the pipeline stacks: hidden_states[0]
    is the embedding and hidden_states[num_hidden_layers] the final norm's output, so that keeps every one of them a
    plain layer output, as in the real encoders (36 and 40 layers)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_HIDDEN,
        intermediate_size=2 * TEXT_HIDDEN,
        num_hidden_layers=max(out_layers) + 1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=TEXT_HIDDEN // 2,
        max_position_embeddings=PIPELINE_MAX_SEQUENCE_LENGTH,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def build_text_encoder(tokenizer):
    """Frozen random Qwen3ForCausalLM of `text_arch`: 28 layers (see the module docstring)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    encoder = Qwen3ForCausalLM(Qwen3Config(**text_arch(tokenizer, TEXT_ENCODER_OUT_LAYERS), tie_word_embeddings=True))
    return encoder.eval().requires_grad_(False)


def build_vae(block_out_channels: tuple[int, ...] = (16, 32, 32)):
    """AutoencoderKLFlux2 of `build.vae_arch`, patch 2x2 (bn over 16 channels); bn statistics set later."""
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(**vae_arch(block_out_channels), patch_size=(2, 2))


def build_transformer(layers: int = 2, single_layers: int = 4, guidance_embeds: bool = False):
    """Flux2Transformer2DModel for 4-channel latents patchified 2x2 (16 in-channels), inner dim 4 x 32 = 128; a
    guidance embedding for [dev] (`guidance_embeds`), none for klein."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=layers,
        num_single_layers=single_layers,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=len(TEXT_ENCODER_OUT_LAYERS) * TEXT_HIDDEN,
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=(8, 8, 8, 8),
        rope_theta=2000,
        guidance_embeds=guidance_embeds,
    )


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def _fresh(model: ModelFamily, tokenizer_fn, encoder_fn, layers: int, single_layers: int, guidance_embeds: bool,
           **pipeline_config):
    """`tokenizer_fn(tmp folder)` and `encoder_fn(tokenizer)`, the VAE and the untrained transformer assembled into
    `model`'s pipeline; returns (pipe, parameter counts)."""
    with phase("tokenizers"), tempfile.TemporaryDirectory() as tmp:
        tokenizer = tokenizer_fn(Path(tmp))
    with phase("models"):
        text_encoder = encoder_fn(tokenizer)
        vae = build_vae()
        transformer = build_transformer(layers, single_layers, guidance_embeds)
        pipe = model.pipeline_class()(
            scheduler=build_scheduler(),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=transformer,
            **pipeline_config,
        )
        pipe.set_progress_bar_config(disable=True)
        n_params = parameter_counts(dict(transformer=transformer, vae=vae, text_encoder=text_encoder))
    return pipe, n_params


def fresh_pipeline(layers: int, single_layers: int):
    """Tokenizer and untrained models assembled into a Flux2KleinPipeline; returns (pipe, parameter counts)."""
    return _fresh(FLUX2_KLEIN, lambda tmp: build_qwen_tokenizer(tmp / "qwen"), build_text_encoder, layers,
                  single_layers, guidance_embeds=False, is_distilled=False)


# --------------------------------------------------------------------------------------------------------------------
# Latents and training


def _patchify(z: torch.Tensor) -> torch.Tensor:
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline._patchify_latents(z)


@torch.no_grad()
def set_bn_statistics(vae, generator: torch.Generator, n: int = 512) -> dict[str, list[float]]:
    """Set `vae.bn`'s running mean / variance to those of patchified posterior means of n world renders.

    The pipeline normalises latents as (z - running_mean) / sqrt(running_var + eps) (per patchified channel) and
    undoes it before decoding, so normalised latents then have mean 0 and variance ~1 per channel.
    """
    x = random_renders(n, generator)
    z = _patchify(torch.cat([vae.encode(c).latent_dist.mean for c in x.split(128)]))
    vae.bn.running_mean.copy_(z.mean((0, 2, 3)))
    vae.bn.running_var.copy_(z.var((0, 2, 3)))
    vae.bn.num_batches_tracked.fill_(1)
    return kept_bn_statistics(vae)


def kept_bn_statistics(vae) -> dict[str, list[float]]:
    return {
        "running_mean": [round(v, 4) for v in vae.bn.running_mean.tolist()],
        "running_var": [round(v, 4) for v in vae.bn.running_var.tolist()],
    }


@torch.no_grad()
def encode_latents(pipe, images: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] -> packed, normalised latents [B, (H/8)(W/8), 16] (`_encode_vae_image`: the
    posterior mode, patchified, bn-normalised; then the trainer's packing), what the transformer sees."""
    z = torch.cat([pipe._encode_vae_image(c * 2 - 1, generator=None) for c in images.split(128)])
    return FLUX2_KLEIN.pack(z)


@torch.no_grad()
def prompt_conditioning(pipe, prompts: list[str], max_sequence_length: int) -> Conditioning:
    """The trainer's Conditioning of `prompts` (one row each) for a RESOLUTION image: `pipe.encode_prompt` in chunks
    of 16 (the text encoder runs over max_sequence_length tokens each), no guidance (klein has no embedding)."""
    cpu = torch.device("cpu")
    chunks = [FLUX2_KLEIN.encode_chunk(pipe, prompts[i : i + 16], max_sequence_length, cpu)["prompt_embeds"]
              for i in range(0, len(prompts), 16)]
    return FLUX2_KLEIN.conditioning({"prompt_embeds": torch.cat(chunks)}, latent_size(pipe), GUIDANCE,
                                    guidance_embeds=False, device=cpu, dtype=torch.float32)


def train_transformer(
    pipe,
    steps: int,
    batch: int,
    lr: float,
    shift: float,
    images_per_prompt: int,
    generator: torch.Generator,
    cfg_dropout: float = 0.1,
    long_text_every: int = 8,
) -> None:
    """Rectified-flow pretraining (build.py's `flow_matching`) of `pipe.transformer` on every world prompt.

    Conditioned as `Flux2KleinPipeline.__call__` conditions the transformer (see the module docstring), through the
    trainer's own call (grpo.models.FLUX2_KLEIN.velocity). A `cfg_dropout` share of the samples get the empty prompt
    (CFG's negative prompt); every `long_text_every`-th step (0: never) the first batch/8 samples get the 512-token
    encoding of their prompt (the pipeline's default length), the others the 32-token one. Both draws come after the
    batch's own, from the same generator.
    """
    transformer = pipe.transformer
    prompts = world.all_prompts()
    empty = len(prompts)  # index of "" in the embeddings
    short = prompt_conditioning(pipe, prompts + [""], MAX_SEQUENCE_LENGTH)
    long = prompt_conditioning(pipe, prompts + [""], PIPELINE_MAX_SEQUENCE_LENGTH) if long_text_every else None
    latents, pool_index = latent_pool(prompts, images_per_prompt, lambda x: encode_latents(pipe, x), generator)
    n_long = max(1, batch // 8)

    def call(xt, sigma, cond: Conditioning, rows):
        return FLUX2_KLEIN.velocity(transformer, xt, sigma, cond.select(rows))

    def predict(xt, sigma, rows, step):
        drop = torch.rand(len(rows), generator=generator) < cfg_dropout
        rows = torch.where(drop, torch.full_like(rows, empty), rows)
        if long_text_every and step % long_text_every == long_text_every - 1:
            k = min(n_long, len(rows))
            head = call(xt[:k], sigma[:k], long, rows[:k])
            if k == len(rows):
                return head
            return torch.cat([head, call(xt[k:], sigma[k:], short, rows[k:])])
        return call(xt, sigma, short, rows)

    flow_matching(transformer, latents, pool_index, predict, steps, batch, lr, shift, generator)


# --------------------------------------------------------------------------------------------------------------------
# Evaluation


def sample_scores(pipe, prompts: list[str], steps: int, seeds: list[int], **call) -> torch.Tensor:
    """World scores of samples as the project samples the model: guidance 1 (no CFG), length 32."""
    kwargs = dict(guidance_scale=GUIDANCE, max_sequence_length=MAX_SEQUENCE_LENGTH)
    return score_samples(pipe, prompts, steps, seeds, **{**kwargs, **call})


def eval_extra(pipe, prompts: list[str], steps: int, seeds: list[int]) -> dict:
    """The eval's samples under other settings: the pipeline's default length (512) and guidance (CFG 4), 4 steps
    (klein distilled's count)."""
    settings = {
        "max_sequence_length_512": dict(max_sequence_length=PIPELINE_MAX_SEQUENCE_LENGTH),
        "cfg_guidance_4": dict(guidance_scale=CFG_GUIDANCE),
        "num_inference_steps_4": dict(steps=4),
    }
    out = {"guidance_scale": GUIDANCE, "max_sequence_length": MAX_SEQUENCE_LENGTH}
    for name, s in settings.items():
        s = dict(s)
        n = s.pop("steps", steps)
        out[f"sample_score_mean_{name}"] = round(sample_scores(pipe, prompts, n, seeds, **s).mean().item(), 4)
    return out


def klein(cfg_dropout: float = 0.1, long_text_every: int = 8) -> Builder:
    """The FLUX.2 [klein] `Builder`, with its training options."""
    return Builder(
        name="flux2",
        model=FLUX2_KLEIN,
        fresh=fresh_pipeline,
        stats_key="vae_bn",
        set_latent_stats=set_bn_statistics,
        kept_latent_stats=kept_bn_statistics,
        train_transformer=train_transformer,
        sample_scores=sample_scores,
        options={"cfg_dropout": cfg_dropout, "long_text_every": long_text_every},
        eval_extra=eval_extra,
    )


# --------------------------------------------------------------------------------------------------------------------
# FLUX.2 [dev]: the Flux2Pipeline layout, untrained

DEV_TEXT_ENCODER_OUT_LAYERS = (10, 20, 30)  # Flux2Pipeline's default text_encoder_out_layers
DEV_GUIDANCE = 4.0  # Flux2Pipeline's default guidance_scale, the guidance embedding's input (one pass a step)
# Flux2Pipeline puts its system message before every prompt: 31 of this tokenizer's tokens with the template's
# special tokens, and a world prompt adds at most 8. At the klein length (32) the prompt would be cut to one token.
DEV_MAX_SEQUENCE_LENGTH = 64
BOS, EOS, UNK, MISTRAL_PAD = "<s>", "</s>", "<unk>", "<pad>"
INST, END_INST, SYSTEM, END_SYSTEM = "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"
IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"  # PixtralProcessor looks their ids up
# Mistral-Small-3's chat template, reduced to what Flux2Pipeline renders (format_input): a system turn and a user
# turn whose content is a list of parts. Only text parts are rendered: images come with caption upsampling alone,
# which the tiny model does not do.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def dev_chat_text(prompt: str) -> str:
    """What MISTRAL_CHAT_TEMPLATE renders for `prompt` in Flux2Pipeline (its system message, then the prompt)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return f"{BOS}{SYSTEM}{SYSTEM_MESSAGE}{END_SYSTEM}{INST}{prompt}{END_INST}"


def build_pixtral_processor():
    """`train_bpe` on the world prompts as Flux2Pipeline renders them, as the tokenizer of a `PixtralProcessor` (what
    Flux2Pipeline loads from tokenizer/ with AutoProcessor), with Mistral's special tokens and MISTRAL_CHAT_TEMPLATE.

    The tokenizer is the BPE itself (`PreTrainedTokenizerFast`; Mistral's tekken is a byte-level BPE too): right
    padding with <pad>, no unknown token in practice (byte level). The image processor fits the vision tower of
    `build_mistral_encoder` (64 px, patch 16).
    """
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    specials = [UNK, BOS, EOS, INST, END_INST, IMG, MISTRAL_PAD, IMG_BREAK, IMG_END, SYSTEM, END_SYSTEM]
    bpe = train_bpe([dev_chat_text(p) for p in world.all_prompts()], specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                                        pad_token=MISTRAL_PAD, model_max_length=PIPELINE_MAX_SEQUENCE_LENGTH)
    image_processor = PixtralImageProcessor(size={"longest_edge": RESOLUTION}, patch_size=16)
    return PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=16, spatial_merge_size=2,
                            chat_template=MISTRAL_CHAT_TEMPLATE)


def build_mistral_encoder(processor):
    """Frozen random Mistral3ForConditionalGeneration: a Mistral text model of `text_arch` (31 layers, for
    hidden_states[30]) and a one-layer Pixtral vision tower, which Flux2Pipeline's prompt encoding never runs."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text = MistralConfig(**text_arch(processor.tokenizer, DEV_TEXT_ENCODER_OUT_LAYERS), sliding_window=None)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=RESOLUTION, patch_size=16)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=processor.image_token_id,
                            spatial_merge_size=2)
    return Mistral3ForConditionalGeneration(config).eval().requires_grad_(False)


def fresh_dev_pipeline(layers: int, single_layers: int):
    """Processor and untrained models (a guidance embedding in the transformer) assembled into a Flux2Pipeline;
    returns (pipe, parameter counts)."""
    return _fresh(FLUX2_DEV, lambda tmp: build_pixtral_processor(), build_mistral_encoder, layers,
                  single_layers, guidance_embeds=True)


def dev_sample_scores(pipe, prompts: list[str], steps: int, seeds: list[int], **call) -> torch.Tensor:
    """World scores of [dev] samples: guidance 4 into the embedding, length 64."""
    kwargs = dict(guidance_scale=DEV_GUIDANCE, max_sequence_length=DEV_MAX_SEQUENCE_LENGTH)
    return score_samples(pipe, prompts, steps, seeds, **{**kwargs, **call})


# The FLUX.2 [dev] `Builder`: no transformer training (its folders are built UNTRAINED).
DEV = Builder(
    name="flux2-dev",
    model=FLUX2_DEV,
    fresh=fresh_dev_pipeline,
    stats_key="vae_bn",
    set_latent_stats=set_bn_statistics,
    kept_latent_stats=kept_bn_statistics,
    train_transformer=None,
    sample_scores=dev_sample_scores,
)


def build_dev(out: Path, seed: int = 0) -> dict:
    """An untrained tiny Flux2Pipeline ([dev] layout) folder at `out`, in seconds; returns `build`'s summary. Tests
    build it into their tmp folders, so none is shipped."""
    return build(out, DEV, seed=seed, **UNTRAINED)
