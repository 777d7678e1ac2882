"""Recipe configuration: a typed schema, YAML presets, dotted overrides and start-up validation.

Presets state *global* quantities (prompts per step, group size); everything per rank is derived from the world
size by :func:`derive_layout`, so one preset runs on 1, 2, 8 or 64 processes. Every check here runs before any
model is loaded, and every error is one line naming the setting and the fix.

The schema is the single source of truth: each field's help text, whether it may change when a run is resumed,
and whether it names a file (grpo/schema.py's `setting`). Only switches that are off have defaults; every tuning
value is required, so a preset shows everything it uses. `python -m tools.check --help` lists every setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grpo.errors import ConfigError
from grpo.schema import build, describe, fields_along, parse_value, read_yaml, set_dotted, setting

FREE = "free"  # may differ between a run and its resumption: where and how long it runs, logging, checkpoints, faults


@dataclass(kw_only=True)
class ModelConfig:
    path: str = setting(help="hub id (black-forest-labs/FLUX.1-dev) or a local folder in diffusers layout", path=True)
    revision: str | None = setting(None, help="hub revision of model.path; null = the default branch")
    dtype: str = setting(help="frozen parts (VAE) and rollout activations: fp32, bf16 or fp16; the policy follows "
                              "the DeepSpeed precision")
    attention_backend: str = setting(help="diffusers attention backend: native (SDPA), _native_npu, flash, ...")
    gradient_checkpointing: bool | int = setting(
        False, resume=FREE, help="recompute activations in the update: true = every block, k = every k-th, false = none")
    zero_init: bool = setting(
        resume=FREE, help="build the transformer in deepspeed.zero.Init and fill it from the shards (a node holds ~one "
                          "host copy); false = from_pretrained on every process")
    offload_vae: bool = setting(False, resume=FREE, help="keep the VAE on the CPU except while decoding")


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = setting(help="LoRA rank r, e.g. 16 (tiny) or 128 (FLUX.1-dev)")
    alpha: float = setting(help="LoRA scale numerator: updates are scaled by alpha / rank")
    dropout: float = setting(0.0, help="dropout on the LoRA input; 0 = off")
    init: str = setting(help="PEFT init_lora_weights, e.g. gaussian")
    target_modules: list[str] = setting(help="transformer module names that get adapters, e.g. [to_q, to_k, to_v, "
                                             "to_out.0]")


# What `lora.rank=16` on a full fine-tune preset fills in for the LoRA keys it does not give.
LORA_SWITCH_DEFAULTS = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "init": "gaussian",
                        "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


@dataclass(kw_only=True)
class DataConfig:
    train_prompts: str = setting(help="text file, one training prompt per line", path=True)
    eval_prompts: str | None = setting(resume=FREE, path=True, help="held-out prompt file; null = no eval")
    cache_dir: str = setting(resume=FREE, path=True,
                             help="precomputed prompt embeddings (safetensors), keyed by model + prompts")
    max_sequence_length: int = setting(help="T5 tokens per prompt; FLUX.1-dev uses 512")


@dataclass(kw_only=True)
class WindowConfig:
    placement: str = setting(choices=("progressive", "random"),
                             help="progressive: the window slides over the steps as training goes on (MixGRPO); "
                                  "random: a new seeded start every GRPO step (Flow-GRPO-Fast)")
    size: int = setting(help="SDE steps per rollout, all of them trained (MixGRPO: 4; Flow-GRPO-Fast: 3)")
    shift_every: int | None = setting(None, help="progressive: GRPO steps before the window moves (MixGRPO tau: 25)")
    stride: int | None = setting(None, help="progressive: steps the window moves each time (MixGRPO: 1); 0 = fixed "
                                            "at the first steps (MixGRPO-Flash*)")
    high: int | None = setting(None, help="random: starts are drawn from [0, high - size] (Flow-GRPO-Fast: "
                                          "num_steps // 2)")


@dataclass(kw_only=True)
class SamplingConfig:
    resolution: int = setting(help="image side in pixels, a multiple of 16")
    num_steps: int = setting(help="denoising steps per rollout")
    eta: float = setting(help="SDE noise of the rollouts, > 0; eval always uses 0 (deterministic ODE)")
    sde: str = setting(choices=("dance", "flow", "cps"),
                       help="dance: g = eta (DanceGRPO); flow: g = eta*sqrt(sigma/(1-sigma)) (Flow-GRPO); cps: "
                            "coefficients-preserving sampling, eta = noise level in (0, 1] (Flow-GRPO's CPS)")
    shift: float | str = setting(help="static SD3 time shift, or dynamic for diffusers' resolution-dependent shift")
    guidance: float = setting(help="FLUX.1-dev distilled guidance embedding")
    group_size: int = setting(help="images per prompt (G), at least 2")
    init_same_noise: bool = setting(help="a group shares its initial noise (DanceGRPO's init_same_noise)")
    window: WindowConfig | None = setting(
        None, help="SDE window: only its steps are stochastic and trained, the others deterministic ODE steps "
                   "(MixGRPO, Flow-GRPO-Fast); null = every step SDE, grpo.timestep_fraction of them trained")
    tail: str = setting("euler", choices=("euler", "dpm2"),
                        help="steps after the window: euler (the schedule's own steps) or dpm2 (MixGRPO-Flash: "
                             "DPM-Solver++(2M) on a schedule compressed by compress_ratio)")
    compress_ratio: float | None = setting(None, help="dpm2: the tail keeps floor((num_steps - L) * ratio) points, "
                                                      "at least 2 (MixGRPO-Flash: 0.4)")


@dataclass(kw_only=True)
class BatchConfig:
    prompts_per_step: int = setting(help="prompts per GRPO step, global over all processes")
    micro_batch_size: int = setting(help="per process: the update's micro-batch (and the rollout's unless set)")
    rollout_micro_batch_size: int | None = setting(
        None, help="rollout/eval micro-batch per process, a multiple of micro_batch_size; null = micro_batch_size, "
                   "which keeps the first-pass ratio exactly 1 (a larger one only up to rounding)")
    updates_per_step: int = setting(help="optimizer steps per GRPO step; the first one is exactly on-policy")

    @property
    def rollout_micro_batch(self) -> int:
        return self.rollout_micro_batch_size or self.micro_batch_size


@dataclass(kw_only=True)
class GRPOConfig:
    clip_range: float = setting(help="PPO ratio clip epsilon (DanceGRPO: 1e-4)")
    adv_clip: float = setting(help="advantages are clipped to [-adv_clip, adv_clip] (DanceGRPO: 5.0)")
    std_scope: str = setting(help="advantage std over the group, or the whole batch (Flow-GRPO's global_std); both "
                                  "unbiased (ddof=1), where Flow-GRPO's global std is np.std (ddof=0)")
    timestep_fraction: float = setting(help="share of the N-1 trainable transitions drawn per micro-batch, in (0, 1]")
    kl_coef: float = setting(0.0, help="weight of the exact per-step Gaussian KL to the initial policy; 0 = off (no "
                                       "reference model at all). Flow-GRPO's beta weights KL*dt: kl_coef = beta*dt")
    ratio_norm: bool = setting(False, help="GRPO-Guard's RatioNorm and 1/dt gradient reweighting against the ratio "
                                           "bias of low-noise steps (sampling.sde: flow only)")


@dataclass(kw_only=True)
class MatchingConfig:
    timesteps: int = setting(help="noise levels trained per image, drawn from the rollout's schedule (DiffusionNFT: "
                                  "0.99 of its 10; Flow-Factory's FLUX examples: 2 to 4)")
    beta: float | None = setting(None, help="nft: mixing strength of the implicit policies (DiffusionNFT: 1.0; 0.1 "
                                            "for OCR); not a KL weight")
    huber_p: float | None = setting(None, help="awm: exponent of the generalised-Huber weighting (AWM: 0.25)")
    anchor_coef: float | None = setting(None, help="awm: weight of mean (v - v_lagging)^2 (AWM's beta_EMA: 1.0)")
    lag_rate: float = setting(help="the lagging policy: theta_lag <- d*theta_lag + (1 - d)*theta after each step, "
                                   "d = min(lag_rate * (k - lag_start), lag_max), k = optimizer steps (DiffusionNFT "
                                   "type 1: 0.001, 0.5, 0; AWM: 0.001, 0.3, 0)")
    lag_max: float = setting(help="largest decay of the lagging policy (see lag_rate)")
    lag_start: int = setting(0, help="optimizer steps before the lagging policy starts to lag (DiffusionNFT type 2: "
                                     "75)")
    kl_coef: float = setting(0.0, help="weight of mean (v - v_ref)^2 to the initial model (DiffusionNFT: 1e-4); 0 = "
                                       "off, no reference model")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = setting(help="AdamW learning rate, e.g. 1e-5 full fine-tune, 3e-4 LoRA")
    weight_decay: float = setting(help="AdamW weight decay")
    betas: list[float] = setting(help="AdamW betas, two numbers in [0, 1)")
    eps: float = setting(help="AdamW epsilon")
    max_grad_norm: float = setting(help="gradient clipping norm (DanceGRPO: 1.0)")
    warmup_steps: int = setting(0, help="linear LR warm-up in optimizer steps; 0 = off")


@dataclass(kw_only=True)
class DeepSpeedConfig:
    config: str = setting(path=True, help="ds_configs/*.json: sharding, offload and precision; the recipe fills in "
                                          "the batch fields")
    gather_for_rollout: bool = setting(
        resume=FREE, help="gather the full weights once per rollout/eval phase instead of layer by layer at every "
                          "denoising step: much faster, but each device briefly holds one full copy")


@dataclass(kw_only=True)
class LoggingConfig:
    sample_every: int = setting(help="a grid of rollout images every N steps; 0 = never")
    eval_every: int = setting(help="held-out eval (eta 0, fixed noise) every N steps, and before step 0 and after "
                                   "the last")
    eval_seeds: int = setting(help="images per held-out prompt, each from its own fixed noise")
    tensorboard: bool = setting(help="write TensorBoard event files under output_dir")
    wandb: bool = setting(False, help="also log to Weights & Biases (pip install wandb; project from WANDB_PROJECT)")
    progress: bool = setting(help="tqdm bars on rank 0 for the rollout and update phases")


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = setting(help="resumable checkpoint every N steps and after the last")
    keep: int = setting(help="newest complete checkpoints kept; older ones are deleted once a newer one is complete")
    resume: str | None = setting(None, path=True, help="null = a new run (output_dir absent or empty); auto = the "
                                                       "newest valid checkpoint under output_dir; or a checkpoint folder")


@dataclass(kw_only=True)
class EMAConfig:
    decay: float | None = setting(None, help="EMA of the trained weights, e.g. 0.99; null = off. Eval, the final "
                                             "export and tools.export use the EMA weights")


@dataclass(kw_only=True)
class FaultsConfig:
    max_consecutive_skips: int = setting(help="GRPO steps in a row with a skipped update (non-finite reward, loss or "
                                              "gradient) before the run checkpoints and stops with an error")
    comm_timeout_s: float = setting(help="a collective waiting longer (a dead or hung rank) fails the run; must exceed "
                                         "the longest stretch one rank works alone (eval grids, checkpoint hashing)")


@dataclass(kw_only=True)
class ProfileConfig:
    steps: list[int] = setting([], help="GRPO steps traced with torch.profiler into output_dir/<dir>/, e.g. [2, 3] "
                                        "(after the warm-up step); [] = off")
    dir: str = setting("profile", help="folder under output_dir for the traces")
    ranks: list[int] | None = setting([0], help="ranks that trace; null = every rank")
    record_shapes: bool = setting(False, help="record operator input shapes")
    profile_memory: bool = setting(False, help="record tensor allocations")
    with_stack: bool = setting(False, help="record Python call stacks (much larger traces)")


@dataclass(kw_only=True)
class RecipeConfig:
    output_dir: str = setting(resume=FREE, path=True, help="run folder: logs, samples, checkpoints, final weights")
    max_steps: int = setting(resume=FREE, help="GRPO steps to run")
    seed: int = setting(help="every random draw is a function of (seed, step, sample index)")
    model: ModelConfig = setting(help="the FLUX model")
    lora: LoraConfig | None = setting(help="LoRA adapters; null = full fine-tune (lora.rank=N on a full preset "
                                           "switches LoRA on with rank 8, alpha 16, q/k/v/out targets for keys not given)")
    data: DataConfig = setting(help="prompt files and the embedding cache")
    sampling: SamplingConfig = setting(help="rollouts")
    batch: BatchConfig = setting(help="global batch and micro-batches")
    algorithm: str = setting(choices=("grpo", "nft", "awm"),
                             help="the objective: grpo (clipped ratio of SDE transitions), nft (DiffusionNFT) or awm "
                                  "(advantage-weighted matching); everything else is shared")
    grpo: GRPOConfig = setting(help="group advantages (all algorithms) and the GRPO loss")
    matching: MatchingConfig | None = setting(None, help="nft and awm: the forward-process objective; null for grpo")
    rewards: dict[str, Any] = setting(help="{name: weight} or {name: {weight: w, option: value}}; see Reward options")
    normalize_rewards_per_group: bool = setting(
        False, help="normalise each reward within its group before weighting (MixGRPO)")
    optim: OptimConfig = setting(help="AdamW and gradient clipping")
    deepspeed: DeepSpeedConfig = setting(help="DeepSpeed ZeRO-3")
    logging: LoggingConfig = setting(resume=FREE, help="metrics, samples and eval")
    checkpoint: CheckpointConfig = setting(resume=FREE, help="resumable checkpoints")
    ema: EMAConfig = setting(resume=FREE, factory=EMAConfig, help="exponential moving average of the weights")
    faults: FaultsConfig = setting(resume=FREE, help="handling of non-finite steps and hung ranks")
    profile: ProfileConfig = setting(resume=FREE, factory=ProfileConfig, help="torch.profiler traces")


# ----------------------------------------------------------------------------------------------------------------
# Loading: YAML -> dict -> typed dataclasses, unknown, missing and mistyped keys rejected, then validate().


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RecipeConfig:
    """Load a YAML preset, apply `key.sub=value` overrides, check every setting (:func:`validate`) and return it.

    Unknown or missing keys, wrong types, malformed overrides and bad values raise a one-line ConfigError.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config: {path} does not exist; pass a preset such as recipes/configs/tiny/grpo_lora.yaml")
        loaded = read_yaml(path)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config: {path} must be a mapping of settings at the top level")
        raw = loaded
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected key=value, e.g. max_steps=10")
        key, text = item.split("=", 1)
        value = parse_value(text)
        if key == "lora" and value is not None and not isinstance(value, dict):
            raise ConfigError("lora: expected null (full fine-tune) or a mapping of LoRA settings")
        if key.startswith("lora.") and raw.get("lora", "absent") is None:
            raw["lora"] = {**LORA_SWITCH_DEFAULTS}  # lora.rank=16 on a full preset switches LoRA on
        set_dotted(raw, key, value)
    cfg = build(RecipeConfig, raw, source=str(path) if path is not None else None)
    validate(cfg)
    return cfg


def resume_free(dotted: str) -> bool:
    """Whether a setting (a flattened key such as `logging.eval_every`) may differ when a checkpoint is resumed."""
    return any(f.metadata.get("resume") == FREE for f in fields_along(RecipeConfig, dotted))


def is_path(dotted: str) -> bool:
    """Whether a setting names a file or folder (compared by the place it names, not its spelling)."""
    along = fields_along(RecipeConfig, dotted)
    return len(along) == len(dotted.split(".")) and bool(along[-1].metadata.get("path"))


def describe_settings() -> str:
    """Every recipe setting with its type, default (or "required") and help, for --help."""
    return "\n".join(["Settings (YAML keys; override with key.sub=value):", *describe(RecipeConfig)])


def to_dict(cfg: RecipeConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: RecipeConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# ----------------------------------------------------------------------------------------------------------------
# Cross-field checks.


def _positive(value: float, key: str, fix: str) -> None:
    if not value > 0:
        raise ConfigError(f"{key}: must be > 0, got {value}; {fix}")


def validate(cfg: RecipeConfig) -> None:
    """Single-field and cross-field checks that need no files and no world size."""
    _positive(cfg.max_steps, "max_steps", "set max_steps to the number of GRPO steps to run")
    s, b, g = cfg.sampling, cfg.batch, cfg.grpo
    if s.group_size < 2:
        raise ConfigError(f"sampling.group_size: {s.group_size} gives no group statistics; use at least 2")
    if s.num_steps < 2:
        raise ConfigError(f"sampling.num_steps: {s.num_steps} leaves no trainable transition; use at least 2")
    if s.eta < 0:
        raise ConfigError(f"sampling.eta: {s.eta} is negative; use eta >= 0 (0 = ODE)")
    if s.sde == "cps" and s.eta > 1:
        raise ConfigError(f"sampling.eta: {s.eta} is above 1, the largest CPS noise level; Flow-GRPO uses 0.8")
    _validate_strategy(cfg)
    if isinstance(s.shift, str) and s.shift != "dynamic":
        raise ConfigError(f"sampling.shift: {s.shift!r}; use a number (e.g. 3.0) or dynamic")
    if not isinstance(s.shift, str):
        _positive(s.shift, "sampling.shift", "use a positive time shift such as 3.0")
    if s.resolution % 16:
        raise ConfigError(f"sampling.resolution: {s.resolution} must be a multiple of 16 (VAE x 2x2 packing)")
    for key, value in (
        ("batch.prompts_per_step", b.prompts_per_step),
        ("batch.micro_batch_size", b.micro_batch_size),
        ("batch.updates_per_step", b.updates_per_step),
    ):
        _positive(value, key, "use a positive integer")
    if b.rollout_micro_batch_size is not None:
        _positive(b.rollout_micro_batch_size, "batch.rollout_micro_batch_size",
                  "use a multiple of micro_batch_size, or null")
    if not 0 < g.timestep_fraction <= 1:
        raise ConfigError(f"grpo.timestep_fraction: {g.timestep_fraction} must be in (0, 1]")
    _positive(g.clip_range, "grpo.clip_range", "DanceGRPO uses 1e-4")
    _positive(g.adv_clip, "grpo.adv_clip", "DanceGRPO uses 5.0")
    if g.std_scope not in ("group", "batch"):
        raise ConfigError(f"grpo.std_scope: {g.std_scope!r} is unknown; use group or batch")
    if g.kl_coef < 0:
        raise ConfigError(f"grpo.kl_coef: {g.kl_coef} is negative; use 0 (no reference) or a positive weight")
    _validate_algorithm(cfg)
    _positive(cfg.optim.lr, "optim.lr", "e.g. 1e-5 full fine-tune, 3e-4 LoRA")
    _positive(cfg.optim.max_grad_norm, "optim.max_grad_norm", "DanceGRPO uses 1.0")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas: expected two numbers in [0, 1), got {cfg.optim.betas}; e.g. [0.9, 0.999]")
    if cfg.lora is not None:
        _positive(cfg.lora.rank, "lora.rank", "e.g. 8 (tiny) or 128 (FLUX.1-dev)")
        if not cfg.lora.target_modules:
            raise ConfigError("lora.target_modules: empty; list module names such as to_q, to_k, to_v, to_out.0")
    if not cfg.rewards:
        raise ConfigError("rewards: empty; give at least one {name: weight}, e.g. {tiny_world: 1.0}")
    if cfg.data.max_sequence_length < 1:
        raise ConfigError("data.max_sequence_length: must be >= 1 (FLUX.1-dev uses 512)")
    gc = cfg.model.gradient_checkpointing
    if not isinstance(gc, bool) and gc < 0:
        raise ConfigError(f"model.gradient_checkpointing: {gc}; use true (all blocks), false, or k >= 1 (every k-th)")
    if cfg.model.dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"model.dtype: {cfg.model.dtype!r}; use fp32, bf16 or fp16")
    _validate_run_control(cfg)
    _validate_profile(cfg)


def _validate_algorithm(cfg: RecipeConfig) -> None:
    """nft and awm train on noised clean samples: they need the matching section and no SDE window."""
    m = cfg.matching
    if cfg.algorithm == "grpo":
        if m is not None:
            raise ConfigError("matching: only for algorithm nft or awm; set it to null for grpo")
        if cfg.sampling.eta == 0:
            raise ConfigError("sampling.eta: 0 makes rollouts deterministic and log-probs undefined; GRPO trains "
                              "with eta > 0")
        return
    if m is None:
        raise ConfigError(f"matching: required with algorithm {cfg.algorithm} (see --help)")
    if cfg.grpo.kl_coef != 0 or cfg.grpo.ratio_norm:
        raise ConfigError(f"grpo.kl_coef / grpo.ratio_norm: GRPO's; set 0 / false for {cfg.algorithm} (its KL weight "
                          "is matching.kl_coef)")
    if cfg.sampling.window is not None:
        raise ConfigError(f"sampling.window: selects GRPO's trained transitions; set null for {cfg.algorithm}")
    if cfg.sampling.eta == 0 and cfg.sampling.init_same_noise:
        raise ConfigError("sampling.init_same_noise: true with eta 0 makes each group one image repeated (no "
                          "advantage); set false, so each image has its own starting noise")
    if not 1 <= m.timesteps <= cfg.sampling.num_steps:
        raise ConfigError(f"matching.timesteps: {m.timesteps}; use 1 .. num_steps = {cfg.sampling.num_steps}")
    need, other = ("beta",), ("huber_p", "anchor_coef")
    if cfg.algorithm == "awm":
        need, other = other, need
    for key in need:
        if getattr(m, key) is None or not getattr(m, key) > 0:
            raise ConfigError(f"matching.{key}: {getattr(m, key)}; a positive number is required with algorithm "
                              f"{cfg.algorithm} (see --help)")
    for key in other:
        if getattr(m, key) is not None:
            raise ConfigError(f"matching.{key}: not used by algorithm {cfg.algorithm}; remove it")
    if not 0 <= m.lag_max < 1 or m.lag_rate < 0 or m.lag_start < 0:
        raise ConfigError(f"matching.lag_*: rate {m.lag_rate} >= 0, max {m.lag_max} in [0, 1), start {m.lag_start} "
                          ">= 0 (DiffusionNFT: 0.001, 0.5, 0)")
    if m.kl_coef < 0:
        raise ConfigError(f"matching.kl_coef: {m.kl_coef} is negative; use 0 (no reference) or e.g. 1e-4")


def _validate_strategy(cfg: RecipeConfig) -> None:
    """The SDE window, the solver after it and RatioNorm must fit the schedule and each other."""
    s, w = cfg.sampling, cfg.sampling.window
    if w is not None:
        bound = s.num_steps - 2  # the last two transitions are never trained (MixGRPO's max_timesteps)
        if not 1 <= w.size <= bound:
            raise ConfigError(f"sampling.window.size: {w.size}; use 1 .. num_steps - 2 = {bound}")
        if cfg.grpo.timestep_fraction != 1.0:
            raise ConfigError(f"grpo.timestep_fraction: {cfg.grpo.timestep_fraction} with sampling.window: every "
                              "window step is trained; set 1.0")
        need = {"progressive": ("shift_every", "stride"), "random": ("high",)}[w.placement]
        unused = {"progressive": ("high",), "random": ("shift_every", "stride")}[w.placement]
        for key in need:
            if getattr(w, key) is None:
                raise ConfigError(f"sampling.window.{key}: required with placement {w.placement} (see --help)")
        for key in unused:
            if getattr(w, key) is not None:
                raise ConfigError(f"sampling.window.{key}: only for the other placement; remove it")
        if w.placement == "progressive" and (w.shift_every < 1 or w.stride < 0):
            raise ConfigError(f"sampling.window: shift_every {w.shift_every} must be >= 1 and stride {w.stride} "
                              ">= 0 (MixGRPO: 25 and 1)")
        if w.placement == "random" and not w.size <= w.high <= s.num_steps - 1:
            raise ConfigError(f"sampling.window.high: {w.high}; use size .. num_steps - 1 = {s.num_steps - 1} "
                              f"(Flow-GRPO-Fast: num_steps // 2)")
    if s.tail == "dpm2":
        if w is None:
            raise ConfigError("sampling.tail: dpm2 replaces the steps after an SDE window; set sampling.window")
        if isinstance(s.shift, str):
            raise ConfigError("sampling.tail: dpm2 compresses a static schedule; set a numeric sampling.shift (e.g. 3)")
        if s.compress_ratio is None or not 0 < s.compress_ratio <= 1:
            raise ConfigError(f"sampling.compress_ratio: {s.compress_ratio}; dpm2 needs a ratio in (0, 1] "
                              "(MixGRPO-Flash: 0.4)")
    elif s.compress_ratio is not None:
        raise ConfigError("sampling.compress_ratio: only for sampling.tail: dpm2; remove it or set tail: dpm2")
    if cfg.grpo.ratio_norm and s.sde != "flow":
        raise ConfigError(f"grpo.ratio_norm: true needs sampling.sde: flow (GRPO-Guard normalises Flow-SDE "
                          f"log-ratios), got {s.sde}")


def _validate_profile(cfg: RecipeConfig) -> None:
    """Profiled steps must be steps the run reaches."""
    bad = [s for s in cfg.profile.steps if not 0 <= s < cfg.max_steps]
    if bad:
        raise ConfigError(f"profile.steps: {bad[0]} is not a step of this run (0..{cfg.max_steps - 1}); "
                          "choose steps after the first, e.g. [2, 3]")
    if not cfg.profile.dir.strip():
        raise ConfigError("profile.dir: empty; give a folder name under output_dir, e.g. profile")


def _validate_run_control(cfg: RecipeConfig) -> None:
    """Logging, checkpoint, EMA and fault settings."""
    for key, value in (("logging.sample_every", cfg.logging.sample_every),
                       ("logging.eval_every", cfg.logging.eval_every), ("checkpoint.every", cfg.checkpoint.every)):
        if value < 0:
            raise ConfigError(f"{key}: {value} is negative; use a number of steps (0 = never)")
    if cfg.logging.eval_seeds < 1:
        raise ConfigError(f"logging.eval_seeds: {cfg.logging.eval_seeds}; use at least 1 image per held-out prompt")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep: {cfg.checkpoint.keep}; keep at least 1 checkpoint")
    if cfg.checkpoint.resume is not None and not cfg.checkpoint.resume.strip():
        raise ConfigError("checkpoint.resume: empty; use null (new run), auto, or a checkpoint folder")
    if cfg.ema.decay is not None and not 0 < cfg.ema.decay < 1:
        raise ConfigError(f"ema.decay: {cfg.ema.decay} must be in (0, 1), e.g. 0.99; or null for no EMA")
    if cfg.faults.max_consecutive_skips < 1:
        raise ConfigError(f"faults.max_consecutive_skips: {cfg.faults.max_consecutive_skips}; use at least 1")
    _positive(cfg.faults.comm_timeout_s, "faults.comm_timeout_s", "e.g. 1800 (seconds)")
