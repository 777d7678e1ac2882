"""The reward interface: images in [0, 1] + prompts (+ each sample's dataset metadata) -> one float32 score per image,
batched, without gradients."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from grpo.rewards.hub import FileRef
from grpo.rewards.options import CommonOptions, parse_dtype
from grpo.rewards.preprocess import check_images

__all__ = ["Reward", "ModelReward", "per_sample", "unique_prompts", "freeze", "to_uint8", "quantize_uint8",
           "cast_keeping_norms_fp32"]

logger = logging.getLogger(__name__)


def unique_prompts(prompts: Sequence[str]) -> tuple[list[str], Tensor]:
    """Distinct prompts in first-seen order and, per input, its index among them ([B] long, CPU).

    GRPO scores G images per prompt, so text towers run once per distinct prompt instead of G times.
    """
    index: dict[str, int] = {}
    inverse = [index.setdefault(p, len(index)) for p in prompts]
    return list(index), torch.tensor(inverse, dtype=torch.long)


def per_sample(metadata: Sequence[dict] | None, n: int) -> list[dict]:
    """One metadata dict per sample: None (a caller with prompts only, a .txt dataset) is n empty ones."""
    if metadata is None:
        return [{} for _ in range(n)]
    if len(metadata) != n:
        raise ValueError(f"{len(metadata)} metadata rows for {n} images; give one dict per image")
    return list(metadata)


def freeze(module: nn.Module) -> nn.Module:
    """Eval mode (dropout off) and no gradients: reward models are never trained here."""
    module.eval()
    module.requires_grad_(False)
    return module


def to_uint8(images: Tensor) -> Tensor:
    """Float images in [0, 1] -> uint8 levels round(x * 255), clamped: the PIL image upstream scorers are given."""
    return (images.float() * 255).round_().clamp_(0, 255).to(torch.uint8)


def quantize_uint8(images: Tensor) -> Tensor:
    """Float images in [0, 1] -> float32 on uint8 levels: round(x * 255) / 255, clamped.

    Bit-for-bit what ToTensor gives for the PIL image that upstream scorers (HPSv2, DanceGRPO, Flow-GRPO, DDPO) score.
    Idempotent: uint8 levels / 255 round back to the same levels, so images sent as uint8 score the same.
    """
    return to_uint8(images).float().div_(255)


_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)


def _norm_in_fp32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _norm_out_dtype(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    return output.to(module._grpo_out_dtype)


def cast_keeping_norms_fp32(module: nn.Module, dtype: torch.dtype) -> None:
    """Casts `module` to `dtype` except its normalisation layers, which keep float32 weights and run in float32.

    Their inputs are upcast and their outputs cast back to `dtype` (hooks), so Linear/Conv/attention run in `dtype`.
    A no-op cast for float32.
    """
    module.to(dtype=dtype)
    if dtype == torch.float32:
        return
    for m in module.modules():
        if isinstance(m, _NORMS) and not getattr(m, "_grpo_fp32", False):
            m.float()
            m._grpo_fp32 = True
            m._grpo_out_dtype = dtype
            m.register_forward_pre_hook(_norm_in_fp32)
            m.register_forward_hook(_norm_out_dtype)


class Reward:
    """Base class: splits batches, moves images to where the model is and scores back to the images' device.

    Subclasses implement `score` (images already on `self.device`, at most `batch_size` of them) and, for models,
    list their modules in `modules()` so `load`/`offload` can move them. Rewards that read each sample's metadata (its
    dataset row's fields other than the prompt, grpo/prompt_sets.py) implement `score_samples` instead, and check
    the rows they will read at start-up in `check_metadata`.

    Class attributes:
        OPTIONS: the dataclass of options the preset may set (grpo/rewards/options.py; validated by check_rewards).
        DESCRIPTION: one line for `python -m tools.rewards --list`.
    """

    OPTIONS: ClassVar[type] = CommonOptions
    DESCRIPTION: ClassVar[str] = ""

    def __init__(self, name: str, batch_size: int | None = None) -> None:
        self.name = name
        self.batch_size = batch_size

    # -- start-up checks (class level, nothing loaded) --------------------------------------------------------------
    @classmethod
    def files(cls, options: dict[str, Any], setting: str) -> list[FileRef]:
        """Files the reward will read, for the start-up check. `options` are validated and complete."""
        return []

    @classmethod
    def validate(cls, options: dict[str, Any], setting: str) -> None:
        """Extra cheap checks beyond types (raise ConfigError)."""

    @classmethod
    def probe(cls, options: dict[str, Any], setting: str) -> None:
        """Start-up check of the services the reward calls (rewards scored by a server): raise ConfigError if one
        does not answer. Runs after `validate` and `files`."""

    # -- scoring ------------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where scoring runs now."""
        return torch.device("cpu")

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        """Scores one chunk: images [b, 3, H, W] in [0, 1] on `self.device` -> [b] (any float dtype)."""
        raise NotImplementedError

    def score_samples(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """`score` with each sample's metadata (one dict per image, {} when the dataset has none); the rewards that
        read only the prompts keep this default, which leaves it out."""
        return self.score(images, prompts)

    @classmethod
    def check_metadata(cls, metadata: dict, options: dict[str, Any]) -> None:
        """Start-up check of one dataset row's metadata, for the rewards that read it: raise ValueError with the
        rest of a sentence saying what is wrong (e.g. "has no 'color' ..."); the caller names the file and row."""

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Scores a batch.

        Args:
            images: [B, 3, H, W] float in [0, 1], any device.
            prompts: B prompts.
            metadata: B dicts, each sample's dataset metadata; None = none (every reward that reads no metadata
                scores the same either way).

        Returns:
            float32 [B] on the images' device.
        """
        check_images(images, prompts)
        prompts = list(prompts)
        n = images.shape[0]
        metadata = per_sample(metadata, n)
        step = self.batch_size or max(n, 1)
        device = self.device
        out = [
            self.score_samples(self.prepare(images[i : i + step].to(device)), prompts[i : i + step],
                               metadata[i : i + step]).float().reshape(-1)
            for i in range(0, n, step)
        ]
        scores = torch.cat(out) if out else torch.zeros(0)
        if scores.shape[0] != n:
            raise RuntimeError(f"reward {self.name} returned {scores.shape[0]} scores for {n} images")
        return scores.to(images.device)

    def prepare(self, images: Tensor) -> Tensor:
        """What `score` receives for a chunk of images (model rewards: uint8-quantised unless quantize: false)."""
        return images

    # -- placement ----------------------------------------------------------------------------------------------------
    def modules(self) -> list[nn.Module]:
        """Modules moved by load()/offload(); none for programmatic rewards."""
        return []

    def load(self) -> None:
        """Moves an offloaded model to its scoring device (no-op unless the reward was built with offload)."""

    def offload(self) -> None:
        """Moves an offloadable model back to the CPU (no-op unless the reward was built with offload)."""


class ModelReward(Reward):
    """A reward backed by networks: dtype, device and offload handling shared by HPS, PickScore, CLIP, aesthetic.

    Args:
        name: the reward's key in the spec.
        device: the rank's device (build_rewards' argument).
        options: validated options including ModelOptions' (dtype, device, offload, batch_size).
    """

    def __init__(self, name: str, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(name, options["batch_size"])
        self.dtype = parse_dtype(options["dtype"])
        # The scoring device: the rank's device unless `device: cpu` keeps the model off the accelerator.
        self.home = torch.device("cpu") if options["device"] == "cpu" else torch.device(device)
        self.offloadable = bool(options["offload"]) and self.home.type != "cpu"
        self.cache_dir = options["cache_dir"]
        self.quantize = bool(options.get("quantize", True))
        self._where = torch.device("cpu") if self.offloadable else self.home

    @property
    def device(self) -> torch.device:
        return self._where

    def place(self) -> None:
        """Freezes the modules and puts them where they start: CPU if offloadable, else the scoring device."""
        for m in self.modules():
            cast_keeping_norms_fp32(freeze(m).to(device=self._where), self.dtype)

    def prepare(self, images: Tensor) -> Tensor:
        return quantize_uint8(images) if self.quantize else images.float()

    def _move(self, device: torch.device) -> None:
        for m in self.modules():
            m.to(device)
        self._where = device

    def load(self) -> None:
        if self.offloadable and self._where != self.home:
            self._move(self.home)

    def offload(self) -> None:
        if self.offloadable and self._where.type != "cpu":
            home = self._where
            self._move(torch.device("cpu"))
            backend = getattr(torch, home.type, None)
            if backend is not None and hasattr(backend, "empty_cache"):
                backend.empty_cache()  # return the freed blocks to the policy, not to the caching allocator
