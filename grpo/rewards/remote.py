"""The `remote` reward: a reward scored by `python -m tools.rewards serve` on another machine, so its model takes no
memory on the training devices.

Each rank sends its own images, as uint8, and their prompts; the server scores them with the reward it loaded from
the same options and sends the float32 scores back. Model rewards score uint8 levels anyway (`quantize`, on by
default), so a remote reward gives the scores of the same reward in-process, up to the float rounding of a different
batch composition (the server batches concurrent requests together). Rewards that read the float decode (tiny_world,
`quantize: false`) see the uint8 levels instead.

Wire format: the request body and the answer are safetensors files (no pickle, exact bits, NaN passes):
request {"images": uint8 [B, 3, H, W]} with metadata {"prompts": JSON list, "metadata": JSON list of B objects (each
sample's dataset metadata; a server before it ignores it, a client before it sends none: empty objects)}, answer
{"scores": float32 [B]}. Image paths in the metadata are the client's; a served reward that reads them needs the
same paths on the server.
Errors are JSON {"error": "one line"} with HTTP 400 (bad request), 404 (reward not served) or 500 (scoring failed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from grpo.errors import ConfigError
from grpo.rewards.base import Reward, to_uint8
from grpo.rewards.client import Service, ServiceError, ServiceOptions
from grpo.schema import setting

__all__ = ["RemoteReward", "RemoteOptions", "encode_images", "decode_images", "decode_request", "encode_scores",
           "decode_scores", "SERVE_COMMAND"]

SERVE_COMMAND = "python -m tools.rewards serve CONFIG --host HOST --port PORT"


def encode_images(images: Tensor, prompts: list[str], metadata: list[dict] | None = None) -> bytes:
    """uint8 [B, 3, H, W] images + B prompts (+ B metadata dicts) -> request body."""
    header = {"prompts": json.dumps(prompts)}
    if metadata is not None:
        header["metadata"] = json.dumps(metadata)
    return st_save({"images": images.contiguous().cpu()}, metadata=header)


def decode_images(body: bytes) -> tuple[Tensor, list[str]]:
    """Request body -> (uint8 [B, 3, H, W], prompts). ValueError (one line) for anything else."""
    images, prompts, _ = decode_request(body)
    return images, prompts


def decode_request(body: bytes) -> tuple[Tensor, list[str], list[dict]]:
    """Request body -> (uint8 [B, 3, H, W], prompts, metadata: B dicts, empty when the client sent none)."""
    try:
        tensors = st_load(body)
        header = _metadata(body)
        prompts = json.loads(header["prompts"])
        metadata = json.loads(header["metadata"]) if "metadata" in header else None
    except Exception as err:  # safetensors' own errors, JSON errors, a missing key
        raise ValueError(f"the body is not a safetensors file with images and prompts ({type(err).__name__})") from None
    images = tensors.get("images")
    if images is None or images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError("expected images: uint8 [B, 3, H, W]")
    if not isinstance(prompts, list) or len(prompts) != images.shape[0] or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"expected {images.shape[0]} prompts (strings), one per image")
    metadata = [{} for _ in prompts] if metadata is None else metadata
    one_each = isinstance(metadata, list) and len(metadata) == len(prompts)
    if not (one_each and all(isinstance(m, dict) for m in metadata)):
        raise ValueError(f"expected metadata: {len(prompts)} JSON objects, one per image")
    return images, prompts, metadata


def _metadata(body: bytes) -> dict[str, str]:
    # safetensors layout: 8-byte little-endian header length, then the JSON header holding "__metadata__".
    n = int.from_bytes(body[:8], "little")
    return json.loads(body[8 : 8 + n])["__metadata__"]


def encode_scores(scores: Tensor) -> bytes:
    return st_save({"scores": scores.detach().float().contiguous().cpu()})


def decode_scores(body: bytes) -> Tensor:
    return st_load(body)["scores"]


@dataclass(kw_only=True)
class RemoteOptions(ServiceOptions):
    reward: str = setting(help="the served reward to score with: a key of the server's rewards map, e.g. hpsv2")


class RemoteReward(Reward):
    """Scores through a reward server; batch_size images per request."""

    DESCRIPTION = (f"a reward served by `{SERVE_COMMAND}` elsewhere: this rank's uint8 images + prompts + metadata "
                   f"over HTTP")
    OPTIONS = RemoteOptions

    @classmethod
    def validate(cls, options: dict[str, Any], setting: str) -> None:
        Service.check(options, setting)

    @classmethod
    def probe(cls, options: dict[str, Any], setting: str) -> None:
        health = Service(options, setting).probe("/health", f"the reward server ({SERVE_COMMAND})")
        served = health.get("rewards", []) if isinstance(health, dict) else []
        if options["reward"] not in served:
            raise ConfigError(f"{setting}.reward: {options['url']} serves {', '.join(served) or 'nothing'}, not "
                              f"{options['reward']!r}; name one of them or add it to the server's config")

    def __init__(self, name: str, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(name, options["batch_size"])
        self.service = Service(options, f"rewards.{name}")
        self.path = "/score/" + quote(options["reward"], safe="")

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.score_samples(images, prompts, [{} for _ in prompts])

    def score_samples(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        response = self.service.post(self.path, data=encode_images(to_uint8(images), prompts, metadata))
        try:
            scores = decode_scores(response.content)
        except Exception as err:
            raise ServiceError(f"{self.service.setting}: {self.service.url}{self.path} answered no scores "
                               f"({type(err).__name__}); is it a reward server?") from None
        if scores.shape != (len(prompts),):
            raise ServiceError(f"{self.service.setting}: {len(prompts)} images sent, {tuple(scores.shape)} scores "
                               f"received")
        return scores
