"""Per-device memory planner for the GRPO recipe under DeepSpeed ZeRO-3: does a config fit, and what to change if not.

    python -m tools.plan CONFIG --devices N --device-memory 64GB [key=value ...]
    python -m tools.plan recipes/configs/flux1_dev/grpo_full.yaml data.train_prompts=my_prompts.txt \
        data.eval_prompts=null --devices 8 --device-memory 64GB

Nothing is loaded or downloaded: the transformer and the VAE are built on the meta device from their config.json
(from model.path, the local Hugging Face cache, or flux_configs.json next to this file for FLUX.1-dev/schnell,
FLUX.2 [dev], [klein] 4B/9B, [klein] base 4B/9B and FLUX 3 Image Klein base).
Per device it counts:

  model states   ZeRO-3 partitions: weights (b bytes per parameter / N, b = 2 in bf16, 4 in fp32), gradients
                 (b per trainable / N), fp32 master weights (4 per trainable / N, kept by DeepSpeed in fp32 runs
                 too) and Adam's two moments (8 per trainable / N); parameters of at most
                 stage3_param_persistence_threshold elements stay whole on every device. offload_optimizer moves
                 master, moments and gradients to the host, offload_param the weights.
  activations    one update forward + backward at the micro-batch and resolution, traced through diffusers' own
                 forward and torch's checkpoint code on the meta device (free): the bytes alive after the forward
                 (what autograd keeps, with the model.gradient_checkpointing policy applied) and the backward's
                 extra peak over them. Attention is counted as a fused kernel (q, k, v, out and the log-sum-exp, as
                 SDPA-flash and NPU fusion attention keep), never an S x S matrix.
  rollout        the full gathered weights (deepspeed.gather_for_rollout) or ZeRO-3's in-flight parameters, and the
                 peak of live tensors of one no-grad forward (traced), plus the trajectories kept until the update
                 (with Flow-DPPO's trust region or RatioNorm also each step's float32 SDE mean).
  reference      full fine-tune with kl_coef > 0: a second set of weight partitions; LoRA: nothing (adapters off).
  true CFG       sampling.true_cfg makes every velocity two transformer calls (conditional, then negative). In the
                 update that trains the guided velocity (grpo; nft/awm with train: guided) both calls' graphs are
                 alive until the backward: activations x2 (the backward working set stays one call's); with train:
                 conditional the update is one call. Rollout, eval (also eval_cfg_scale alone) and reference (when
                 the update trains guided) run without grad, the two calls in sequence: one call's peak plus the
                 conditional output [B, S, C] in float32 kept for the combination.
  averages       fp32 shards of the trained weights: the eval EMA (ema.decay), nft/awm's lagging policy.
  VAE, rewards   weights (unless offloaded: they then visit the device for their phase only), the decode's peak;
                 rewards scored by a server (remote, vlm_judge) take no device memory.
  comm buffers   ZeRO-3's reduce bucket (reduce_bucket_size elements, resident), the prefetch bucket and the largest
                 module (deepspeed.fetch_blocks: block) in flight, the fp32 copy of a sub-group's gradients at the
                 optimizer step (b < 4).

The peak is the largest phase (rollout, decode, reward, reference, update, optimizer step) on top of what stays
resident. Predictions were checked against measurements on small models (benchmarks/zero3_memory.py,
tests/recipe/test_plan.py): model states exact to 0.1%, update activations within a few percent (see RESULTS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import re
import sys
import weakref
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from grpo.config import RecipeConfig, load_config
from grpo.layout import derive_layout
from grpo.objectives import objective_of
from grpo.device import resolve_dtype
from grpo.errors import ConfigError, run_command
from grpo.models import ModelFamily, family_of_pipeline, family_of_transformer, index_file
from grpo.models.base import INDEX_FILES
from grpo.models.blocks import enable_checkpointing
from grpo.settings import LoraConfig

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]
SHIPPED = Path(__file__).with_name("flux_configs.json")
OFFLOAD_CONFIG = "ds_configs/zero3_offload.json"

# open_clip / CLIP backbones of the rewards (parameters counted once from open_clip on the meta device).
BACKBONE_PARAMS = {"ViT-H-14": 986_109_441, "ViT-H-14-378": 986_109_441, "ViT-H-14-378-quickgelu": 986_109_441,
                   "ViT-L-14": 427_616_513, "ViT-L-14-quickgelu": 427_616_513}
# ImageReward's BLIP (ViT-L/16 + BERT-base with cross-attention + MLP) and HPSv3's Qwen2-VL-7B without lm_head, with
# its reward head, as grpo/rewards/imagereward.py and hpsv3.py build them (counted on the meta device).
BACKBONE_PARAMS |= {"BLIP-L (ImageReward)": 446_206_689, "Qwen2-VL-7B (HPSv3)": 7_748_610_610}
REWARD_BACKBONE = {"hpsv2": "ViT-H-14", "pickscore": "ViT-H-14", "aesthetic": "ViT-L-14",
                   "imagereward": "BLIP-L (ImageReward)", "hpsv3": "Qwen2-VL-7B (HPSv3)"}
# Rewards scored by a server (python -m tools.rewards serve, a VLM server): their models are on other machines.
SERVED_REWARDS = ("remote", "vlm_judge")
REWARD_SERVER = "http://REWARD_HOST:8000"  # the lever's placeholder: where `python -m tools.rewards serve` listens

# ZeRO-3 defaults (deepspeed/runtime/zero/config.py) for keys the JSON may omit.
_ZERO_DEFAULTS = {"stage3_param_persistence_threshold": 100_000, "reduce_bucket_size": 500_000_000,
                  "stage3_prefetch_bucket_size": 50_000_000, "sub_group_size": 1_000_000_000,
                  "contiguous_gradients": True}


# ------------------------------------------------------------------------------------------------ model configs
def model_configs(path: str, revision: str | None = None) -> tuple[dict, dict | None]:
    """(transformer config, VAE config or None) for a local folder or a hub id, without touching the network."""
    local = Path(path)
    if local.is_dir():
        t = local / "transformer" / "config.json"
        v = local / "vae" / "config.json"
        if not t.is_file():
            raise ConfigError(f"model.path: {path} has no transformer/config.json; point it at a diffusers FLUX folder")
        return json.loads(t.read_text()), json.loads(v.read_text()) if v.is_file() else None
    found = []
    for sub in ("transformer", "vae"):
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(path, f"{sub}/config.json", revision=revision)
        except Exception:  # noqa: BLE001 -- a malformed id or no cache: fall back to the shipped configs
            hit = None
        found.append(json.loads(Path(hit).read_text()) if isinstance(hit, str) else None)
    if found[0] is not None:
        return found[0], found[1]
    shipped = json.loads(SHIPPED.read_text())
    if path in shipped:
        return shipped[path]["transformer"], shipped[path]["vae"]
    raise ConfigError(f"model.path: no transformer/config.json for {path} in a local folder, the Hugging Face cache or "
                      f"{SHIPPED.name} ({', '.join(shipped)}); download the configs or give a local folder")


def model_family(path: str, transformer_config: dict, revision: str | None = None) -> ModelFamily:
    """The family of model.path's pipeline (its model_index.json, or a modular pipeline's modular_model_index.json,
    in a local folder or the Hugging Face cache, or the shipped entry's _pipeline), which knows what a transformer
    config cannot: e.g. that a FluxTransformer2DModel of a FLUX.1-Kontext folder also reads the source image's tokens.
    The transformer's family when no pipeline is known."""
    local = index_file(path)
    name = json.loads(local.read_text()).get("_class_name") if local.is_file() else None
    if name is None and not Path(path).is_dir():
        from huggingface_hub import try_to_load_from_cache

        hit = None
        for index in INDEX_FILES:  # FLUX.3's folders have only the modular pipeline's index
            try:
                hit = try_to_load_from_cache(path, index, revision=revision)
            except Exception:  # noqa: BLE001 -- a malformed id or no cache: fall back to the shipped configs
                hit = None
            if isinstance(hit, str):
                break
        if isinstance(hit, str):
            name = json.loads(Path(hit).read_text()).get("_class_name")
        else:
            name = json.loads(SHIPPED.read_text()).get(path, {}).get("_pipeline")
    return family_of_pipeline(name, path) if name else family_of_transformer(transformer_config)


def reference_images(cfg: RecipeConfig, family: ModelFamily) -> int:
    """Reference images a training row gives (every row gives as many): the dataset's first row's, or the family's
    fewest when the dataset cannot be read here (none given, a hub id offline)."""
    from grpo.prompt_sets import read_prompt_set, row_images

    if family.references == (0, 0) or not cfg.data.train_prompts:
        return family.references[0]
    try:
        return len(row_images(read_prompt_set(cfg.data.train_prompts, "data.train_prompts").metadata[0]))
    except ConfigError:
        return family.references[0]


def meta_transformer(config: dict, dtype: torch.dtype, lora=None) -> nn.Module:
    """The transformer on the meta device (no memory), with LoRA adapters added as the recipe adds them."""
    cls = family_of_transformer(config).transformer_class()
    with torch.device("meta"):
        model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
        _cast(model, dtype)
        if lora is None:
            model.requires_grad_(True)
        else:
            from peft import LoraConfig as PeftLoraConfig

            model.requires_grad_(False)
            model.add_adapter(PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                             init_lora_weights=lora.init, target_modules=lora.target_modules))
            _cast(model, dtype)
    return model


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    for p in model.parameters():  # on meta: free; diffusers' .to(dtype) would warn about fp32 modules
        p.data = p.data.to(dtype)


# ------------------------------------------------------------------------------------------------- model states
def zero_settings(ds: dict) -> dict:
    z = {**_ZERO_DEFAULTS, **ds.get("zero_optimization", {})}
    z["offload_optimizer"] = (z.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    z["offload_param"] = (z.get("offload_param") or {}).get("device", "none") not in ("none", None)
    return z


def precision_bytes(ds: dict) -> int:
    return 2 if ds.get("bf16", {}).get("enabled") or ds.get("fp16", {}).get("enabled") else 4


def model_states(params: list[tuple[int, bool]], devices: int, b: int, zero: dict, optimizer: bool = True,
                 ) -> dict[str, int]:
    """ZeRO-3 model-state bytes of one rank, before offload is applied.

    Args:
        params: (numel, trainable) per parameter.
        devices: data-parallel world size N (each parameter is padded to a multiple of N).
        b: bytes per element of the DeepSpeed precision.
        zero: zero_settings() of the DeepSpeed config.
        optimizer: False for an inference engine (the reference): weights only.

    Returns:
        weights (partitions + whole persistent parameters), gradients, master (fp32 copy), optimizer.
    """
    part = lambda n: math.ceil(n / devices)  # noqa: E731
    thr = zero["stage3_param_persistence_threshold"]
    weights = sum(part(n) * b for n, _ in params) + sum(n * b for n, _ in params if n <= thr)
    trainable = sum(part(n) for n, t in params if t) if optimizer else 0
    # The fp32 master copy exists in fp32 too: DeepSpeed would share it with fp32 weights only when
    # `tensor.device == self.device` holds, and it compares a torch.device with a device-name string (False).
    # Measured on the CPU (benchmarks/zero3_memory.py): 20 bytes per trainable parameter in fp32, 16 in bf16.
    return {"weights": weights, "gradients": trainable * b, "master": trainable * 4, "optimizer": trainable * 8}


# -------------------------------------------------------------------------------------------------- activations
class _FusedAttention(torch.autograd.Function):
    """Stand-in for SDPA in traces: what a fused kernel returns and keeps for its backward (no S x S matrix)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, *_ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def fused_attention() -> contextlib.AbstractContextManager:
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return _FusedAttention.apply(query, key, value)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


def transformer_inputs(config: dict, batch: int, image_tokens: int, text_tokens: int, dtype: torch.dtype,
                       device: torch.device | str = "meta") -> dict:
    """Keyword arguments of one call of the transformer of `config`, as its family's velocity builds them."""
    return family_of_transformer(config).example_inputs(config, batch, image_tokens, text_tokens, dtype, device)


def _tensors(kwargs: dict) -> list[torch.Tensor]:
    return [v for v in kwargs.values() if isinstance(v, torch.Tensor)]


class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of the tensor storages created inside the mode and still alive: `now`, and their maximum,
    `peak`. What an allocator without caching or fragmentation would hold. Tensors autograd keeps for the backward
    stay alive (their Python objects are preserved while C++ holds them), so a forward + backward on the meta
    device gives the update's activation memory for free; on small models it matched CPU measurements to <1%."""

    def __init__(self, ignore: set[int] = frozenset()):
        super().__init__()
        self.ignore = ignore  # storages that exist already (parameters: their views come back through the mode)
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.size.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key, nbytes = _storage(t)
                if key in self.ignore:
                    continue
                if key not in self.refs:
                    self.refs[key], self.size[key] = 0, nbytes
                    self.now += nbytes
                    self.peak = max(self.peak, self.now)
                self.refs[key] += 1
                weakref.finalize(t, self._drop, key)
        return out


def live_peak(fn: Callable[[], object], existing: list[torch.Tensor]) -> int:
    """Peak bytes of tensors created and alive while `fn` runs without grad; `existing` (parameters, inputs) are
    not counted, nor their views."""
    mode = LiveBytes({_storage(t)[0] for t in existing})
    with torch.no_grad(), fused_attention(), mode:
        fn()
    return mode.peak


@dataclass
class TransformerTrace:
    model: nn.Module  # on meta; trainable parameters drop their .grad at once (ZeRO-3 moves it to its buckets)
    inputs: dict
    params: list[tuple[int, bool]]  # (numel, trainable)
    no_grad_peak: int
    largest_module: int  # elements of the largest module's own parameters (ZeRO-3 gathers module by module)
    largest_block: int  # elements of the largest FLUX block (deepspeed.fetch_blocks gathers a block at once)
    _update: dict = field(default_factory=dict)

    def update_bytes(self, checkpointing: bool | int) -> tuple[int, int]:
        """(bytes alive after one update forward: the activations; the backward's extra peak over them) with the
        checkpointing policy of model.gradient_checkpointing, traced through the real checkpoint code."""
        if checkpointing not in self._update:
            enable_checkpointing(self.model, checkpointing)
            mode = LiveBytes({_storage(t)[0] for t in [*self.model.parameters(), *_tensors(self.inputs)]})
            try:
                with torch.enable_grad(), fused_attention(), mode:
                    out = self.model(**self.inputs)[0]
                    after_forward = mode.now
                    out.float().square().mean().backward()
                    del out
            finally:
                if checkpointing:
                    self.model.disable_gradient_checkpointing()
            self._update[checkpointing] = (after_forward, mode.peak - after_forward)
        return self._update[checkpointing]


def transformer_trace(config: dict, dtype: torch.dtype, lora, batch: int, image_tokens: int,
                      text_tokens: int) -> TransformerTrace:
    """Meta-device traces of the transformer (grpo.settings.LoraConfig or None) at one micro-batch geometry."""
    key = None if lora is None else (lora.rank, lora.alpha, lora.dropout, lora.init, tuple(lora.target_modules))
    return _transformer_trace(json.dumps(config, sort_keys=True), dtype, key, batch, image_tokens, text_tokens)


@functools.lru_cache(maxsize=8)
def _transformer_trace(config_json: str, dtype: torch.dtype, lora: tuple | None, batch: int, image_tokens: int,
                       text_tokens: int) -> TransformerTrace:
    """Traces that depend only on the model and the micro-batch geometry (cached: advise() re-plans often)."""
    config = json.loads(config_json)
    lora_cfg = None if lora is None else LoraConfig(rank=lora[0], alpha=lora[1], dropout=lora[2], init=lora[3],
                                                     target_modules=list(lora[4]))
    model = meta_transformer(config, dtype, lora_cfg)
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    inputs = transformer_inputs(config, batch, image_tokens, text_tokens, dtype)
    return TransformerTrace(
        model=model,
        inputs=inputs,
        params=[(p.numel(), p.requires_grad) for p in model.parameters()],
        no_grad_peak=live_peak(lambda: model(**inputs), [*model.parameters(), *_tensors(inputs)]),
        largest_module=max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in model.modules()),
        largest_block=max(sum(p.numel() for p in block.parameters())
                          for block in ModelFamily.blocks(model)),
    )


@functools.lru_cache(maxsize=8)
def _vae_trace(vae_class: type, config_json: str, dtype: torch.dtype, batch: int, latent: int) -> tuple[int, int]:
    """(VAE weight bytes, peak live bytes of decoding one micro-batch)."""
    config = json.loads(config_json)
    with torch.device("meta"):
        vae = vae_class.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    _cast(vae, dtype)
    z = torch.empty(batch, config["latent_channels"], latent, latent, device="meta", dtype=dtype)
    return sum(p.numel() for p in vae.parameters()) * dtype.itemsize, live_peak(lambda: vae.decode(z),
                                                                                 [*vae.parameters(), z])


# ---------------------------------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    """Bytes per device: `resident` is held throughout a step; each phase adds its own items on top."""

    devices: int
    resident: dict[str, int]
    phases: dict[str, dict[str, int]]
    host: dict[str, int]
    notes: list[str]
    params: int
    trainable: int
    image_tokens: int = 0  # the transformer's image sequence: the noisy tokens and any reference tokens

    def phase_total(self, phase: str) -> int:
        return sum(self.resident.values()) + sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def peak(self) -> int:
        return self.phase_total(self.peak_phase)


def _default(reward: str, option: str) -> Any:
    """A registered reward's default for `option` (hpsv3 scores in bfloat16, the others in float32)."""
    from grpo.rewards import reward_class

    return next(f.default for f in dataclasses.fields(reward_class(reward).OPTIONS) if f.name == option)


def _reward_bytes(rewards: dict) -> tuple[int, int, list[str]]:
    """(bytes resident on the device, bytes that visit it for the reward phase only, notes)."""
    from grpo.rewards import normalize_spec
    from grpo.rewards.options import parse_dtype

    resident = visiting = 0
    notes = []
    for name, options in normalize_spec(rewards).items():
        base = name.split("@", 1)[0]
        if base in SERVED_REWARDS:
            notes.append(f"reward {name}: scored by the server at {options.get('url')}, no device memory here")
            continue
        arch = options.get("model", "ViT-H-14") if base == "clip_score" else REWARD_BACKBONE.get(base)
        if arch is None:  # programmatic rewards, or a custom one we cannot see into
            continue
        n = BACKBONE_PARAMS.get(arch)
        if n is None:
            notes.append(f"reward {name}: unknown backbone {arch!r}, not counted")
            continue
        nbytes = n * parse_dtype(options.get("dtype", _default(base, "dtype"))).itemsize
        if options.get("device") == "cpu":
            continue
        if options.get("offload"):
            visiting += nbytes
        else:
            resident += nbytes
    return resident, visiting, notes


def update_calls(cfg: RecipeConfig) -> int:
    """Transformer calls whose graphs the update keeps alive per velocity: 2 when it trains true CFG's guided
    velocity (grpo always: its log-probs are the guided transition's; nft and awm with train: guided), else 1."""
    return cfg.sampling.trained_calls


def plan(cfg: RecipeConfig, devices: int, ds: dict | None = None, transformer_config: dict | None = None,
         vae_config: dict | None = None, family: ModelFamily | None = None) -> Plan:
    """Per-device memory of one GRPO step of `cfg` on `devices` processes (see the module docstring). `family`:
    model.path's (model_family) when None."""
    layout = derive_layout(cfg, devices)
    if ds is None:
        path = Path(cfg.deepspeed.config)
        path = path if path.is_file() else ROOT / path
        if not path.is_file():
            raise ConfigError(f"deepspeed.config: {cfg.deepspeed.config} does not exist; use one of ds_configs/*.json")
        ds = json.loads(path.read_text())
    if transformer_config is None:
        transformer_config, vae_config = model_configs(cfg.model.path, cfg.model.revision)
    if family is None:
        family = model_family(cfg.model.path, transformer_config, cfg.model.revision)
    zero, b = zero_settings(ds), precision_bytes(ds)
    dtype = {2: torch.bfloat16, 4: torch.float32}[b]
    vsf = 2 ** (len(vae_config["block_out_channels"]) - 1) if vae_config else 8
    latent = 2 * (cfg.sampling.resolution // (vsf * 2))
    image_tokens, text_tokens, m = (latent // 2) ** 2, cfg.data.max_sequence_length, layout.micro_batch_size
    # The transformer sees the reference tokens too (FLUX.1-Kontext: one source image, as many tokens again); the
    # trajectories keep the noisy tokens only.
    ref_tokens = family.reference_tokens(image_tokens, reference_images(cfg, family))
    seq_tokens = image_tokens + ref_tokens
    t = transformer_trace(transformer_config, dtype, cfg.lora, m, seq_tokens, text_tokens)
    params = t.params
    n_params, n_train = sum(n for n, _ in params), sum(n for n, tr in params if tr)
    notes: list[str] = []

    # Model states, and where offload puts them.
    states = model_states(params, devices, b, zero)
    host: dict[str, int] = {}
    resident: dict[str, int] = {}
    for k in ("weights", "gradients", "master", "optimizer"):
        to_host = zero["offload_param"] if k == "weights" else zero["offload_optimizer"]
        (host if to_host else resident)[k] = states[k]
    objective = objective_of(cfg)
    terms, kl_coef = objective.plan_terms(), objective.kl_coef
    if kl_coef > 0 and cfg.lora is None:
        ref = model_states([(n, False) for n, _ in params], devices, b, zero, optimizer=False)["weights"]
        (host if zero["offload_param"] else resident)["reference"] = ref

    # Sharded fp32 averages of the trained weights (grpo/ema.py): the eval EMA, and nft/awm's lagging policy.
    average = 4 * math.ceil(n_train / devices)
    if cfg.ema.decay:
        resident["EMA"] = average
    if terms.lagging_average:
        resident["lagging policy"] = average

    activations, backward = t.update_bytes(cfg.model.gradient_checkpointing)
    activations *= update_calls(cfg)
    r = layout.rollout_micro_batch_size  # rollouts, reference and eval run without gradients at this micro-batch
    rollout_peak = (t if r == m else transformer_trace(transformer_config, dtype, cfg.lora, r, seq_tokens,
                                                       text_tokens)).no_grad_peak
    fetch_unit = t.largest_block if cfg.deepspeed.fetch_blocks else t.largest_module

    # VAE and rewards.
    vae_weights = vae_decode = 0
    if vae_config is not None:
        vdtype = resolve_dtype(cfg.model.dtype)
        vae_weights, vae_decode = _vae_trace(family_of_transformer(transformer_config).vae_class(),  # eval: r
                                             json.dumps(vae_config, sort_keys=True), vdtype, r, latent)
    if not cfg.model.offload_vae:
        resident["VAE"] = vae_weights
    reward_resident, reward_visiting, reward_notes = _reward_bytes(cfg.rewards)
    notes += reward_notes
    if reward_resident:
        resident["rewards"] = reward_resident

    # Communication buffers and what is in flight.
    in_flight = (min(zero["stage3_prefetch_bucket_size"], n_params) + fetch_unit) * b
    resident["reduce bucket"] = zero["reduce_bucket_size"] * b if zero["contiguous_gradients"] else 0
    # What the rollout keeps until the update, per sample: float32 latents of every step, the conditioning (text
    # embeddings and the reference latents in the model dtype), the decoded float32 image.
    latent_bytes = image_tokens * transformer_config["in_channels"] * 4
    per_sample = ((cfg.sampling.num_steps + 1) * latent_bytes
                  + text_tokens * transformer_config["joint_attention_dim"] * b + 3 * cfg.sampling.resolution**2 * 4
                  + ref_tokens * transformer_config["in_channels"] * b)
    per_sample += layout.trained_transitions * terms.latents_per_point * latent_bytes  # the objective's, per point
    # GRPO-Guard's RatioNorm and Flow-DPPO's KL: each step's float32 SDE mean, recorded by the rollout (grpo/rollout.py)
    per_sample += cfg.sampling.num_steps * latent_bytes * objective.rollout_records().get("keep_means", False)
    trajectories = layout.samples_per_rank * per_sample
    gathered = n_params * b if cfg.deepspeed.gather_for_rollout else in_flight
    # True CFG without grad (the rollouts', or the evals' alone: eval_cfg_scale): the conditional velocity [r, S, C] in
    # float32 waits while the negative call runs.
    guided_no_grad = cfg.sampling.negative_prompt is not None  # some phase guides: the negative prompt is encoded
    kept_cond = r * image_tokens * transformer_config["in_channels"] * 4 if guided_no_grad else 0
    cfg_item = {"CFG conditional output": kept_cond} if kept_cond else {}
    opt_step = min(zero["sub_group_size"], math.ceil(n_train / devices)) * 4 if b < 4 else 0
    phases = {
        "rollout": {"gathered weights" if cfg.deepspeed.gather_for_rollout else "params in flight": gathered,
                    "rollout activations": rollout_peak, **cfg_item, "rollout batch": trajectories},
        "decode": {"rollout batch": trajectories, "VAE decode": vae_decode,
                   **({"VAE (visiting)": vae_weights} if cfg.model.offload_vae else {})},
        "reward": {"rollout batch": trajectories,
                   **({"rewards (visiting)": reward_visiting} if reward_visiting else {})},
        "update": {"rollout batch": trajectories, "activations": activations, "backward working set": backward,
                   "params in flight": in_flight},
        "optimizer step": ({"fp32 gradient copy": opt_step} if opt_step and not zero["offload_optimizer"] else {}),
    }
    if terms.kept_trajectories:  # OP-GRPO's buffer (grpo/replay.py): float32 latents x_0 .. x_L, L log-probs an entry
        entry = (terms.kept_transitions + 1) * latent_bytes + terms.kept_transitions * 4
        host["replay buffer (every rank)"] = terms.kept_trajectories * entry
        phases["update"]["replay batch"] = layout.samples_per_rank_per_update * entry
    if terms.reference_phase:
        lora_gather = cfg.lora is not None and cfg.deepspeed.gather_for_rollout
        # The reference and lagging velocities are what the update compares against: guided when it trains guided.
        phases["reference"] = {"rollout batch": trajectories, "reference activations": rollout_peak,
                               **(cfg_item if update_calls(cfg) == 2 else {}),
                               "gathered weights" if lora_gather else "params in flight":
                                   n_params * b if lora_gather else in_flight}
    if zero["offload_optimizer"]:
        notes.append("offload_optimizer: master, moments and gradients live in host memory (see 'host')")
    if ref_tokens:
        notes.append(f"{family.name}: the transformer's sequence is {image_tokens} noisy + {ref_tokens} reference "
                     f"(source image) tokens + {text_tokens} text tokens")
    if cfg.sampling.true_cfg:
        trained = "guided velocity, both calls' activations" if update_calls(cfg) == 2 else "conditional velocity"
        notes.append(f"true CFG {cfg.sampling.true_cfg.scale}: two transformer calls a velocity; the update trains "
                     f"the {trained}")
    notes.append("allocator fragmentation and the runtime's own context are not counted: keep ~10% headroom")
    return Plan(devices, resident, phases, host, notes, n_params, n_train, seq_tokens)


def flops_line(cfg: RecipeConfig, p: Plan) -> str:
    """The step's model FLOPs per phase (grpo/perf.py, as the recipe logs them): what perf/tflops/* divide by the
    phases' seconds and the devices. The command's alone: counting a real model's forward on the meta device takes
    seconds, which plan()'s many callers (the advice, the tests) need not pay."""
    from grpo.perf import forward_flops
    from grpo.rollout_plan import RolloutPlan

    config, _ = model_configs(cfg.model.path, cfg.model.revision)
    family = model_family(cfg.model.path, config, cfg.model.revision)
    forward = forward_flops(family, meta_transformer(config, torch.float32), p.image_tokens,
                            cfg.data.max_sequence_length)
    images = derive_layout(cfg, p.devices).samples_per_step
    per_step = ", ".join(f"{k} {v * forward * images / 1e15:.4g} PFLOP"
                         for k, v in RolloutPlan.of(cfg).phase_forwards(0).items())
    return (f"model FLOPs: {forward / 1e12:.4g} TFLOP per transformer forward and image; step 0's {images} images: "
            f"{per_step} (perf/tflops/* in the run's metrics: these / the phase's seconds / devices)")


# ------------------------------------------------------------------------------------------------------ output
def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--device-memory: {text!r} is not a size; write e.g. 64GB or 80GiB")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def _gb(n: int) -> str:
    return f"{n / GiB:8.2f} GiB"


def report(p: Plan, memory: int, headroom: float) -> list[str]:
    lines = [f"transformer: {p.params / 1e9:.3f} B parameters, {p.trainable / 1e6:.1f} M trainable; "
             f"{p.devices} device(s) of {memory / GiB:.1f} GiB", "", "resident through the step (per device):"]
    lines += [f"  {k:<28}{_gb(v)}" for k, v in p.resident.items()]
    lines.append(f"  {'total resident':<28}{_gb(sum(p.resident.values()))}")
    for phase, items in p.phases.items():
        lines.append(f"{phase} phase adds:")
        lines += [f"  {k:<28}{_gb(v)}" for k, v in items.items()]
        lines.append(f"  {'= ' + phase + ' total':<28}{_gb(p.phase_total(phase))}")
    if p.host:
        lines.append("host memory per process (offloaded, and the replay buffer):")
        lines += [f"  {k:<28}{_gb(v)}" for k, v in p.host.items()]
    lines += [f"note: {n}" for n in p.notes]
    budget = memory * (1 - headroom)
    verdict = "fits" if p.peak <= budget else "does NOT fit"
    lines.append(f"peak: {p.peak / GiB:.2f} GiB in the {p.peak_phase} phase; budget {budget / GiB:.2f} GiB "
                 f"({memory / GiB:.1f} GiB less {headroom:.0%} headroom): {verdict}")
    return lines


def _reward_levers(rewards: dict) -> list[tuple[str, list[str]]]:
    """Per model reward on the device: offload it between scorings, or serve it from another machine (`remote`)."""
    from grpo.rewards import normalize_spec

    spec = normalize_spec(rewards)
    out = []
    for name, options in spec.items():
        if name.split("@", 1)[0] not in REWARD_BACKBONE or options.get("device") == "cpu":
            continue
        if isinstance(rewards[name], dict) and not options.get("offload"):  # a bare weight has no options to set
            out.append((f"reward {name} offloaded between scorings", [f"rewards.{name}.offload=true"]))
        served = {"url": REWARD_SERVER, "reward": name, "weight": options.get("weight", 1.0)}
        remote = {(f"remote@{name}" if k == name else k): (served if k == name else v) for k, v in spec.items()}
        out.append((f"reward {name} served by `python -m tools.rewards serve` on another machine",
                    ["rewards=" + json.dumps(remote, separators=(",", ":"))]))
    return out


def candidate_changes(cfg: RecipeConfig) -> list[tuple[str, list[str]]]:
    """Changes that lower the peak, as recipe overrides, cheapest first: those that keep the algorithm and cost
    nothing or little time, then CPU offload (host memory and transfer time), then LoRA (changes what is trained)."""
    out: list[tuple[str, list[str]]] = []
    if cfg.model.gradient_checkpointing is not True and cfg.model.gradient_checkpointing != 1:
        out.append(("checkpoint every block", ["model.gradient_checkpointing=true"]))
    if not cfg.model.offload_vae:
        out.append(("VAE offloaded between decodes", ["model.offload_vae=true"]))
    out += _reward_levers(cfg.rewards)
    if cfg.deepspeed.gather_for_rollout:
        out.append(("layer-wise rollouts (no full gather)", ["deepspeed.gather_for_rollout=false"]))
    if cfg.batch.rollout_micro_batch > cfg.batch.micro_batch_size:
        out.append(("rollouts at the update's micro-batch", ["batch.rollout_micro_batch_size=null"]))
    mb = cfg.batch.micro_batch_size
    while mb > 1:
        mb //= 2
        out.append((f"micro-batch {mb}", [f"batch.micro_batch_size={mb}"]))
    if Path(cfg.deepspeed.config).name != Path(OFFLOAD_CONFIG).name:
        out.append(("ZeRO-3 CPU offload of optimizer and params", [f"deepspeed.config={OFFLOAD_CONFIG}"]))
    if cfg.lora is None:
        out.append(("LoRA instead of a full fine-tune", ["lora.rank=128"]))
    return out


def advise(config: str | None, overrides: list[str], devices: int, memory: int, headroom: float) -> list[str]:
    """Each candidate change alone; those that fit alone; else the candidates accumulated in order until it fits."""
    budget = memory * (1 - headroom)
    lines = ["", "what each change gives alone (peak per device):"]
    alone_fits: list[str] = []
    applied: list[str] = []
    together = None
    for label, change in candidate_changes(load_config(config, overrides)):
        try:
            peak = plan(load_config(config, [*overrides, *change]), devices).peak
            if together is None or together > budget:
                together = plan(load_config(config, [*overrides, *applied, *change]), devices).peak
                applied += change
        except ConfigError as e:  # e.g. a micro-batch that no longer divides the per-rank batch
            lines.append(f"  {' '.join(change):<52} not valid here: {e}")
            continue
        lines.append(f"  {' '.join(change):<52} {peak / GiB:8.2f} GiB  ({label})")
        if peak <= budget:
            alone_fits.append(" ".join(change))
    if alone_fits:
        lines.append("fits with any one of: " + " | ".join(alone_fits))
    elif together is not None and together <= budget:
        lines.append(f"fits with all of: {' '.join(applied)}  -> peak {together / GiB:.2f} GiB")
    else:
        lines.append("no combination of these changes fits: add devices or device memory")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="recipe YAML, e.g. recipes/configs/flux1_dev/grpo_full.yaml (with "
                                       "data.train_prompts=PATH data.eval_prompts=PATH or null: the presets of real "
                                       "models name no prompt file)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, as for the recipe")
    parser.add_argument("--devices", type=int, required=True, help="number of processes (devices), N")
    parser.add_argument("--device-memory", required=True, help="memory of one device, e.g. 64GB")
    parser.add_argument("--headroom", type=float, default=0.1, help="share kept free for fragmentation/runtime")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options

    def body() -> str:
        memory = parse_bytes(args.device_memory)
        if args.devices < 1:
            raise ConfigError("--devices: must be >= 1")
        cfg = load_config(args.config, args.overrides)
        p = plan(cfg, args.devices)
        lines = report(p, memory, args.headroom) + [flops_line(cfg, p)]
        if p.peak > memory * (1 - args.headroom):
            lines += advise(args.config, args.overrides, args.devices, memory, args.headroom)
        return "\n".join(lines)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
