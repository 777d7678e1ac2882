"""Recipe configuration: a typed schema, YAML presets, dotted overrides and start-up validation.

Presets state *global* quantities (prompts per step, group size); everything per rank is derived from the world
size by :func:`derive_layout`, so one preset runs on 1, 2, 8 or 64 processes. Every check here runs before any
model is loaded, and every error is one line naming the setting and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpo.errors import ConfigError


@dataclass
class ModelConfig:
    path: str = "assets/tiny-flux"  # hub id (black-forest-labs/FLUX.1-dev) or a local folder in diffusers layout
    revision: str | None = None
    dtype: str = "fp32"  # frozen parts (VAE) and rollout activations; the policy follows the DeepSpeed precision
    attention_backend: str = "native"  # diffusers attention backend: native (SDPA), _native_npu, flash, ...
    # Recompute activations in the update: true = every transformer block, k (int) = every k-th block, false = none.
    gradient_checkpointing: bool | int = False
    # Build the transformer inside deepspeed.zero.Init and fill it from the safetensors shards (grpo/loading.py): a
    # node holds ~one host copy instead of one per process. false = from_pretrained on every process.
    zero_init: bool = True
    offload_vae: bool = False  # keep the VAE on the CPU except while decoding (saves its weights on the device)


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    init: str = "gaussian"  # PEFT init_lora_weights
    target_modules: list[str] = field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"]
    )


@dataclass
class DataConfig:
    train_prompts: str = "assets/prompts/tiny_train.txt"
    eval_prompts: str | None = "assets/prompts/tiny_heldout.txt"
    cache_dir: str = "cache/embeddings"  # precomputed prompt embeddings (safetensors), keyed by model + prompts
    max_sequence_length: int = 32  # T5 tokens; FLUX.1-dev uses 512


@dataclass
class SamplingConfig:
    resolution: int = 64
    num_steps: int = 8
    eta: float = 0.3  # SDE noise; 0 = deterministic ODE (eval)
    sde: str = "dance"  # dance: g = eta (DanceGRPO); flow: g = eta*sqrt(sigma/(1-sigma)) (Flow-GRPO)
    shift: float | str = 3.0  # static SD3 time shift, or "dynamic" for diffusers' resolution-dependent shift
    guidance: float = 3.5  # FLUX.1-dev distilled guidance embedding
    group_size: int = 8  # images per prompt (G)
    init_same_noise: bool = True  # a group shares its initial noise (DanceGRPO's init_same_noise)


@dataclass
class BatchConfig:
    prompts_per_step: int = 8  # global, over all processes
    micro_batch_size: int = 4  # per process: the update's micro-batch (and the rollout's unless set below)
    # Rollout (and eval) micro-batch per process, a multiple of micro_batch_size: no gradients, so it can be larger.
    # null = micro_batch_size, which keeps the first-pass ratio exactly 1; a larger one runs other matmul shapes than
    # the update, so the ratio is 1 only up to rounding (ratio_max_dev shows by how much).
    rollout_micro_batch_size: int | None = None

    @property
    def rollout_micro_batch(self) -> int:
        return self.rollout_micro_batch_size or self.micro_batch_size
    updates_per_step: int = 1  # optimizer steps per GRPO step; the first one is exactly on-policy


@dataclass
class GRPOConfig:
    clip_range: float = 1e-4
    adv_clip: float = 5.0
    std_scope: str = "group"  # group | batch (Flow-GRPO's global_std)
    timestep_fraction: float = 0.6  # share of the N-1 trainable transitions drawn per micro-batch
    kl_coef: float = 0.0  # 0 = no reference model at all


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0


@dataclass
class DeepSpeedConfig:
    config: str = "ds_configs/zero3.json"  # sharding, offload and precision; batch fields are filled by the recipe
    # Gather the full weights once per rollout/eval phase instead of layer by layer at every denoising step: much
    # faster, but each device then briefly holds one full copy (FLUX.1-dev: ~24 GB in bf16).
    gather_for_rollout: bool = True


@dataclass
class LoggingConfig:
    sample_every: int = 10  # write a grid of rollout images every N steps (0 = never)
    eval_every: int = 10  # held-out eval (eta = 0, fixed noise) every N steps; always before step 0 and after the last
    # images per held-out prompt, each from its own fixed noise: one image a prompt is too few to see a small gain
    eval_seeds: int = 1
    tensorboard: bool = True
    wandb: bool = False  # also log to Weights & Biases (needs `pip install wandb`; project from WANDB_PROJECT)
    progress: bool = True  # tqdm bars on rank 0 for the rollout and update phases


@dataclass
class CheckpointConfig:
    every: int = 10  # resumable checkpoint (model, optimizer, scheduler, RNG, EMA) every N steps and after the last
    keep: int = 2  # newest complete checkpoints kept; older ones are deleted once a newer one is complete
    # null: a new run (output_dir must be absent or empty); auto: continue from the newest valid checkpoint under
    # output_dir/checkpoints (a fresh start when there is none); or the path of one checkpoint folder (or run folder)
    resume: str | None = None


@dataclass
class EMAConfig:
    decay: float | None = None  # e.g. 0.99; null = no EMA. Eval, the final export and grpo.export use the EMA weights


@dataclass
class FaultsConfig:
    # GRPO steps in a row whose update was skipped (non-finite reward, loss or gradient) before the run saves a
    # checkpoint and stops with an error
    max_consecutive_skips: int = 3
    # A collective that waits longer than this (a dead or hung rank) fails the run instead of hanging; must exceed
    # the longest stretch one rank works alone (eval grids, checkpoint hashing)
    comm_timeout_s: float = 1800.0


@dataclass
class ProfileConfig:
    # GRPO steps traced with torch.profiler (torch_npu.profiler on NPU) into output_dir/<dir>/; [] = off.
    # Pick steps after the first (warm-up), e.g. [2, 3]. See grpo/profiling.py for the files written.
    steps: list[int] = field(default_factory=list)
    dir: str = "profile"
    ranks: list[int] | None = field(default_factory=lambda: [0])  # ranks that trace; null = every rank
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False  # Python call stacks: much larger traces


@dataclass
class RecipeConfig:
    output_dir: str = "runs/tiny"
    max_steps: int = 30
    seed: int = 42
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig | None = field(default_factory=LoraConfig)  # null = full fine-tune
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rewards: dict[str, Any] = field(default_factory=lambda: {"tiny_world": {"weight": 1.0}})
    normalize_rewards_per_group: bool = False  # normalise each reward within its group before weighting (MixGRPO)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


# ----------------------------------------------------------------------------------------------------------------
# Loading: YAML -> dict -> typed dataclasses, unknown keys and wrong types rejected.


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _optional_inner(tp: Any) -> tuple[Any, bool]:
    """Return (inner type, is_optional) for `X | None`."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), type(None) in typing.get_args(tp)
    return tp, False


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    inner, optional = _optional_inner(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: may not be null; give a {_type_name(inner)}")
    if _is_dataclass_type(inner):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of settings, got {value!r}")
        return _build(inner, value, key)
    if isinstance(inner, types.UnionType) or typing.get_origin(inner) is typing.Union:
        for option in typing.get_args(inner):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                pass
        names = " or ".join(_type_name(a) for a in typing.get_args(inner))
        raise ConfigError(f"{key}: expected {names}, got {value!r}")
    origin = typing.get_origin(inner)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(inner)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if inner is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if inner is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _build(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in raw if k not in names]
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"{where}{unknown[0]}: unknown setting; valid keys{' under ' + prefix if prefix else ''}: {', '.join(names)}"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.name in raw:
            kwargs[f.name] = _coerce(raw[f.name], hints[f.name], key)
    return cls(**kwargs)


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = {}
            node[part] = child
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{part}' is not a section, so it has no sub-keys")
        node = child
    node[parts[-1]] = value


def _default_dict(cls: type) -> dict[str, Any]:
    return dataclasses.asdict(cls())


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RecipeConfig:
    """Load a YAML preset, apply `key.sub=value` overrides, and return the typed config.

    Missing keys take the schema's defaults; unknown keys, wrong types and malformed overrides raise ConfigError.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config: {path} does not exist; pass a preset such as recipes/configs/tiny/grpo_lora.yaml")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError(f"config: {path} is not valid YAML{where}; fix the syntax") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config: {path} must be a mapping of settings at the top level")
        raw = loaded
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected key=value, e.g. max_steps=10")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text != "" else None
        except yaml.YAMLError:
            value = text
        if key == "lora" and value is not None and not isinstance(value, dict):
            raise ConfigError("lora: expected null (full fine-tune) or a mapping of LoRA settings")
        if key.startswith("lora.") and raw.get("lora", "absent") is None:
            raw["lora"] = _default_dict(LoraConfig)  # lora.rank=16 on a full preset switches LoRA on
        _set_dotted(raw, key, value)
    return _build(RecipeConfig, raw)


def to_dict(cfg: RecipeConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: RecipeConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# ----------------------------------------------------------------------------------------------------------------
# Derived quantities and cross-field checks.


@dataclass(frozen=True)
class Layout:
    """Per-rank sizes derived from the global batch and the world size.

    Samples of a step are numbered 0..N-1, prompt-major (sample s belongs to prompt slot s // G). They are cut into
    `updates_per_step` contiguous update blocks; each block is split evenly and contiguously over the ranks. So the
    samples trained by optimizer step u are the same on any world size, which makes a step world-size invariant.
    """

    world_size: int
    samples_per_step: int  # N = prompts_per_step * group_size
    samples_per_rank: int
    samples_per_rank_per_update: int
    micro_batch_size: int
    rollout_micro_batch_size: int  # a multiple of micro_batch_size
    micro_batches_per_update: int
    trained_transitions: int  # K per trajectory
    grad_accum_steps: int  # backward passes per optimizer step per rank (micro-batches x K)

    def rank_sample_ids(self, rank: int) -> list[int]:
        """Global sample indices held by `rank`, in rollout order."""
        per_update_global = self.samples_per_step // self.updates_per_step
        n = self.samples_per_rank_per_update
        return [
            u * per_update_global + rank * n + i for u in range(self.updates_per_step) for i in range(n)
        ]

    @property
    def updates_per_step(self) -> int:
        return self.samples_per_rank // self.samples_per_rank_per_update

    @property
    def ds_train_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size


def trained_transitions(num_steps: int, timestep_fraction: float) -> int:
    """K: transitions trained per trajectory, out of the N-1 that can change the decoded image.

    The last transition x_{N-1} -> x_N is never trained: the image is decoded from x0 predicted at x_{N-1}.
    """
    return max(1, math.floor((num_steps - 1) * timestep_fraction))


def derive_layout(cfg: RecipeConfig, world_size: int) -> Layout:
    """Check the batch arithmetic for `world_size` processes and return the per-rank layout."""
    validate(cfg)
    b, s = cfg.batch, cfg.sampling
    n = b.prompts_per_step * s.group_size
    if n % world_size:
        raise ConfigError(
            f"batch.prompts_per_step: {b.prompts_per_step} prompts x group_size {s.group_size} = {n} images do not "
            f"split over {world_size} processes; make prompts_per_step*group_size a multiple of {world_size}"
        )
    per_rank = n // world_size
    unit = b.micro_batch_size * b.updates_per_step
    if per_rank % unit:
        raise ConfigError(
            f"batch.micro_batch_size: {per_rank} images per process do not split into {b.updates_per_step} update(s) "
            f"of micro-batches of {b.micro_batch_size}; choose micro_batch_size*updates_per_step dividing {per_rank}"
        )
    rollout = b.rollout_micro_batch
    if rollout % b.micro_batch_size or per_rank % rollout:
        raise ConfigError(
            f"batch.rollout_micro_batch_size: {rollout} must be a multiple of micro_batch_size {b.micro_batch_size} "
            f"that divides the {per_rank} images per process; e.g. {b.micro_batch_size} or null"
        )
    k = trained_transitions(s.num_steps, cfg.grpo.timestep_fraction)
    per_update = per_rank // b.updates_per_step
    micro_per_update = per_update // b.micro_batch_size
    return Layout(
        world_size=world_size,
        samples_per_step=n,
        samples_per_rank=per_rank,
        samples_per_rank_per_update=per_update,
        micro_batch_size=b.micro_batch_size,
        rollout_micro_batch_size=rollout,
        micro_batches_per_update=micro_per_update,
        trained_transitions=k,
        grad_accum_steps=micro_per_update * k,
    )


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
    if s.sde not in ("dance", "flow"):
        raise ConfigError(f"sampling.sde: {s.sde!r} is unknown; use dance or flow")
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
    if s.eta == 0:
        raise ConfigError("sampling.eta: 0 makes rollouts deterministic and log-probs undefined; train with eta > 0")
    _positive(cfg.optim.lr, "optim.lr", "e.g. 1e-5 full fine-tune, 3e-4 LoRA")
    _positive(cfg.optim.max_grad_norm, "optim.max_grad_norm", "DanceGRPO uses 1.0")
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"optim.betas: expected two numbers, got {cfg.optim.betas}")
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
