"""The reward registry: preset spec -> start-up checks -> loaded rewards scored together.

Spec (the preset's `rewards:` map, YAML -> dict): `{name: {weight: w, **options}}`, a bare number being shorthand
for `{weight: number}`. A name is a registered reward, optionally with an "@label" suffix to use one reward twice
(`clip_score@dfn: {pretrained: dfn5b, model: ViT-H-14-378}`), or "pkg.module:factory" for a reward defined
elsewhere: `factory(**options)` (options other than weight and batch_size) must return a callable
`(images [B, 3, H, W] in [0, 1], prompts) -> [B]` (given `metadata=`, one dict per image, when it has a parameter of
that name), or a `grpo.rewards.base.Reward`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from grpo.errors import ConfigError
from grpo.rewards.base import Reward
from grpo.rewards.hub import locate
from grpo.rewards.options import CommonOptions, validate_options
from grpo.schema import describe

__all__ = ["REGISTRY", "Rewards", "check_rewards", "check_reward_metadata", "build_rewards", "reward_class",
           "normalize_spec", "describe_rewards"]

logger = logging.getLogger(__name__)

# name -> "module:class"; imported on first use so that e.g. jpeg rewards never import open_clip or transformers.
REGISTRY: dict[str, str] = {
    "hpsv2": "grpo.rewards.hps:HPSReward",
    "pickscore": "grpo.rewards.pickscore:PickScoreReward",
    "clip_score": "grpo.rewards.clip_score:ClipScoreReward",
    "aesthetic": "grpo.rewards.aesthetic:AestheticReward",
    "imagereward": "grpo.rewards.imagereward:ImageRewardReward",
    "hpsv3": "grpo.rewards.hpsv3:HPSv3Reward",
    "tiny_world": "grpo.rewards.programmatic:TinyWorldReward",
    "tiny_world_meta": "grpo.rewards.programmatic:TinyWorldMetaReward",
    "tiny_edit": "grpo.rewards.programmatic:TinyEditReward",
    "jpeg_compressibility": "grpo.rewards.programmatic:JpegCompressibility",
    "jpeg_incompressibility": "grpo.rewards.programmatic:JpegIncompressibility",
    "remote": "grpo.rewards.remote:RemoteReward",
    "vlm_judge": "grpo.rewards.vlm_judge:VLMJudgeReward",
}


def _import(target: str, setting: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{setting}: cannot import {module_name} ({err}); give an importable pkg.module:factory")
    if not hasattr(module, attr):
        raise ConfigError(f"{setting}: {module_name} has no attribute {attr!r}")
    return getattr(module, attr)


def reward_class(name: str) -> type[Reward]:
    """The Reward class registered under `name` (no "@label")."""
    return _import(REGISTRY[name], f"rewards.{name}")


def _base_name(key: str) -> str:
    return key.split("@", 1)[0]


def normalize_spec(spec: Any) -> dict[str, dict[str, Any]]:
    """Expands shorthands: {name: 0.5} -> {name: {weight: 0.5}}; checks the spec's shape (not the options)."""
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"rewards: expected a non-empty map {{name: weight or {{weight: ..., options}}}}, "
                          f"got {spec!r}; e.g. {{hpsv2: 1.0}}")
    out: dict[str, dict[str, Any]] = {}
    for key, value in spec.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"rewards: reward names must be strings, got {key!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = {"weight": float(value)}
        elif isinstance(value, dict):
            out[key] = dict(value)
        elif value is None:
            out[key] = {}
        else:
            raise ConfigError(f"rewards.{key}: expected a weight or a map of options, got {value!r}")
    return out


class _CustomReward(Reward):
    """Adapter for "pkg.module:factory" rewards: batching and device handling around the factory's callable."""

    def __init__(self, name: str, fn: Callable[[Tensor, list[str]], Tensor], batch_size: int | None) -> None:
        super().__init__(name, batch_size)
        self.fn = fn
        # A callable written before metadata existed takes (images, prompts) only
        self._with_metadata = fn if _takes_metadata(fn) else lambda images, prompts, metadata: fn(images, prompts)
        self._images_device = torch.device("cpu")

    @property
    def device(self) -> torch.device:
        # Unknown to us: score where the images are.
        return self._images_device

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        self._images_device = images.device
        return super().__call__(images, prompts, metadata)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return torch.as_tensor(self.fn(images, prompts))

    def score_samples(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return torch.as_tensor(self._with_metadata(images, prompts, metadata=metadata))


def _takes_metadata(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return "metadata" in params


_COMMON = {f.name for f in dataclasses.fields(CommonOptions)}


def _custom_check(key: str, options: dict[str, Any], setting: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    factory = _import(key, setting)
    if not callable(factory):
        raise ConfigError(f"{setting}: {key} is not callable; it must be a factory returning a reward")
    common = validate_options({k: v for k, v in options.items() if k in _COMMON}, CommonOptions, setting)
    extra = {k: v for k, v in options.items() if k not in _COMMON}
    try:
        inspect.signature(factory).bind(**extra)
    except TypeError as err:
        raise ConfigError(f"{setting}: options {sorted(extra)} do not fit {key}{inspect.signature(factory)} ({err})")
    except ValueError:  # builtins without a signature: let the call decide
        pass
    return factory, {**common, **extra}


def _entry(key: str) -> type[Reward] | None:
    """The registered class of a spec key, or None for a "pkg.module:factory" key."""
    if ":" in key:
        return None
    base = _base_name(key)
    if base not in REGISTRY:
        raise ConfigError(f"rewards.{key}: unknown reward {base!r}; valid names: {', '.join(REGISTRY)} "
                          f"(or pkg.module:factory for your own)")
    return reward_class(base)


def check_rewards(spec: dict[str, Any]) -> None:
    """Cheap start-up validation of a rewards spec; loads no model.

    Checks reward names, option names, types and values, that every model file exists locally or in the hub
    cache (or may still be downloaded: HF_HUB_OFFLINE unset), and that the servers of served rewards (remote,
    vlm_judge) answer. Imports open_clip/transformers only for the rewards that use them.

    Raises:
        ConfigError: one line naming the setting, what is wrong and the fix (unknown names list the valid ones;
            missing files name the file, where it was looked for and the download command).
    """
    for key, raw in normalize_spec(spec).items():
        setting = f"rewards.{key}"
        cls = _entry(key)
        if cls is None:
            _custom_check(key, raw, setting)
            continue
        options = validate_options(raw, cls.OPTIONS, setting)
        cls.validate(options, setting)
        for ref in cls.files(options, setting):
            locate(ref, options.get("cache_dir"), download=False)
        cls.probe(options, setting)


def check_reward_metadata(spec: dict[str, Any], rows, setting: str, source: str) -> None:
    """Start-up check that every row of a dataset (grpo.prompt_sets.PromptSet read from `source`, the value of
    `setting`) carries the metadata its rewards read (Reward.check_metadata); the first bad row fails, naming the
    setting, the file, the row and the reward."""
    for key, raw in normalize_spec(spec).items():
        cls = _entry(key)
        if cls is None:
            continue  # your own factory's reward checks what it reads itself
        options = validate_options(raw, cls.OPTIONS, f"rewards.{key}")
        for where, metadata in zip(rows.rows, rows.metadata):
            try:
                cls.check_metadata(metadata, options)
            except ValueError as err:
                raise ConfigError(f"{setting}: {source} {where} {err}, which rewards.{key} reads; give a dataset "
                                  f"whose rows carry it") from None


def describe_rewards() -> list[str]:
    """Each registered reward, its description and its options (type, default, help): `--list` and `--help`."""
    lines = []
    for name in REGISTRY:
        cls = reward_class(name)
        lines += [f"{name}: {cls.DESCRIPTION}", *("  " + line for line in describe(cls.OPTIONS))]
    return lines + ["pkg.module:factory: your own reward; factory(**options) returns (images, prompts) -> scores"]


def _zero_init_active() -> bool:
    # Only look if deepspeed is already imported: importing it here would cost seconds for nothing.
    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    return bool(pp is not None and getattr(pp, "zero_init_context", 0))


@contextlib.contextmanager
def _outside_hf_zero3() -> Iterator[None]:
    """Hides transformers' global HfDeepSpeedConfig while loading: with ZeRO-3 set there, from_pretrained would
    construct the model inside deepspeed.zero.Init and partition it (Flow-GRPO does the same unset/restore)."""
    ds = sys.modules.get("transformers.integrations.deepspeed")
    saved = getattr(ds, "_hf_deepspeed_config_weak_ref", None) if ds is not None else None
    if saved is not None:
        ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        if saved is not None:
            ds._hf_deepspeed_config_weak_ref = saved


class Rewards:
    """The rewards of one run, loaded once per rank, scored together.

    Attributes:
        names: spec keys in spec order (log as reward/<name>_mean).
        weights: float32 [R] on the CPU, in `names` order.
        rewards: name -> Reward.
    """

    def __init__(self, rewards: dict[str, Reward], weights: dict[str, float]) -> None:
        self.rewards = rewards
        self.names = list(rewards)
        self.weights = torch.tensor([weights[n] for n in self.names], dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, name: str) -> Reward:
        return self.rewards[name]

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Raw per-component scores.

        Args:
            images: [B, 3, H, W] float in [0, 1] (this rank's images only).
            prompts: B prompts.
            metadata: B dicts, each sample's dataset metadata (grpo/prompt_sets.py); None = none.

        Returns:
            float32 [B, R] on the images' device, column r = reward names[r] (unweighted, unnormalised).
        """
        return torch.stack([self.rewards[n](images, prompts, metadata) for n in self.names], dim=1)

    def load(self) -> None:
        """Moves offloaded reward models to their scoring device."""
        for reward in self.rewards.values():
            reward.load()

    def offload(self) -> None:
        """Moves offloadable reward models back to the CPU and frees their accelerator memory."""
        for reward in self.rewards.values():
            reward.offload()

    @contextlib.contextmanager
    def on_device(self) -> Iterator[Rewards]:
        """Wrap a scoring phase: `with rewards.on_device(): comps = rewards(images, prompts, metadata)`.

        Loads offloaded models on entry and offloads them on exit (a no-op for rewards without `offload: true`).
        """
        self.load()
        try:
            yield self
        finally:
            self.offload()


def build_rewards(spec: dict[str, Any], device: torch.device | str) -> Rewards:
    """Loads every reward of `spec` once on this rank: eval mode, requires_grad False, in its `dtype` option.

    Must not run inside `deepspeed.zero.Init` (nor with transformers' ZeRO-3 HfDeepSpeedConfig active, which is
    hidden here while loading): zero.Init partitions every parameter created in its scope across ranks and leaves
    each rank an empty placeholder, while each rank scores its own images with the whole model, outside any engine.
    Reward models are small next to FLUX (HPS ViT-H ~1B parameters, ~4 GB fp32); `device: cpu` or `offload: true`
    trade their accelerator memory for speed.

    Args:
        spec: the rewards spec (see module docstring); validated with check_rewards first.
        device: this rank's device.

    Returns:
        Rewards, in spec order.

    Raises:
        ConfigError: as check_rewards, or a checkpoint that does not fit its architecture.
        RuntimeError: called inside deepspeed.zero.Init.
    """
    if _zero_init_active():
        raise RuntimeError("build_rewards was called inside deepspeed.zero.Init, which would partition the reward "
                           "models; build rewards before or after the zero.Init scope")
    check_rewards(spec)
    device = torch.device(device)
    rewards: dict[str, Reward] = {}
    weights: dict[str, float] = {}
    with _outside_hf_zero3():
        for key, raw in normalize_spec(spec).items():
            setting = f"rewards.{key}"
            start = time.perf_counter()
            cls = _entry(key)
            if cls is None:
                factory, options = _custom_check(key, raw, setting)
                extra = {k: v for k, v in options.items() if k not in _COMMON}
                made = factory(**extra)
                reward = made if isinstance(made, Reward) else _CustomReward(key, made, options["batch_size"])
                reward.name = key
            else:
                options = validate_options(raw, cls.OPTIONS, setting)
                reward = cls(key, device, options)
            for module in reward.modules():
                if any(hasattr(p, "ds_id") for p in module.parameters()):
                    raise RuntimeError(f"{setting}: the model was partitioned by DeepSpeed ZeRO-3; build rewards "
                                       f"outside deepspeed.zero.Init")
            rewards[key] = reward
            weights[key] = options["weight"]
            logger.info("reward %s ready in %.1f s (weight %g, scoring on %s)", key, time.perf_counter() - start,
                        options["weight"], reward.device if cls is not None else "the images' device")
    return Rewards(rewards, weights)
