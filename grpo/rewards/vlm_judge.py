"""The `vlm_judge` reward: a vision-language model served behind an OpenAI-compatible chat completions API (vLLM's or
SGLang's `/v1/chat/completions`) rates each image against its prompt, as the VLM-judge rewards of Pref-GRPO and
Flow-GRPO (UnifiedReward, Qwen-VL scorers) do.

One request per image: a user message holding the image as a base64 PNG data URL (its uint8 levels, lossless) and
the `template` text with {prompt} replaced by the image's prompt and any other {field} by that field of the sample's
dataset row (grpo/prompt_sets.py: e.g. an edit's target or an OCR reward's text; checked on every row at start-up),
after an optional `system` message. A row's `image`/`images` (an edit's source, reference images) go first, before
the image to rate, unless `source_images` is false, so an editing judge sees what was asked to be changed; greedy
decoding (temperature 0) by default so a rating is reproducible. `concurrency` requests are in flight per rank, and
the server batches them. The answer must match `answer` as a whole (a regular expression; surrounding whitespace
ignored) with its first group a number in [min_score, max_score]; that number is the score. Anything else is a
malformed answer: by default an error naming the answer and the expected format (a judge that drifts from the format
would otherwise train on noise); `on_malformed: nan` scores it NaN instead, and the recipe skips that image's group
(logged as nonfinite/<name>).
"""

from __future__ import annotations

import base64
import functools
import io
import logging
import os
import re
import string
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from grpo.errors import ConfigError
from grpo.prompt_sets import row_images
from grpo.rewards.base import Reward, to_uint8
from grpo.rewards.client import Service, ServiceError, ServiceOptions
from grpo.schema import setting

__all__ = ["VLMJudgeReward", "VLMJudgeOptions", "MalformedAnswer", "png_data_url", "DEFAULT_TEMPLATE"]

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "You are an expert judge of text-to-image generation. The image was generated for the prompt: \"{prompt}\". "
    "Rate how well the image follows the prompt and how good it looks, from 0 (worst) to 10 (best). "
    "Answer with exactly one line: Score: <number>"
)


@dataclass(kw_only=True)
class VLMJudgeOptions(ServiceOptions):
    url: str = setting(help="OpenAI-compatible base URL ending in /v1, e.g. http://10.0.0.5:8000/v1 (vLLM, SGLang)")
    model: str = setting(help="the served model's id (GET <url>/models), e.g. Qwen/Qwen2.5-VL-7B-Instruct")
    template: str = setting(DEFAULT_TEMPLATE, help="user message after the image; {prompt} = the image's prompt, "
                                                   "{field} = that field of its dataset row")
    source_images: bool = setting(True, help="send the row's image/images (an edit's source, references) before the "
                                             "image to rate")
    system: str | None = setting(None, help="system message (null = none)")
    answer: str = setting(r"Score: (-?\d+(?:\.\d+)?)",
                          help="regular expression the whole answer must match; its first group is the score")
    min_score: float = setting(0.0, help="lowest valid score; below it the answer is malformed")
    max_score: float = setting(10.0, help="highest valid score; above it the answer is malformed")
    max_tokens: int = setting(16, help="answer token limit")
    temperature: float = setting(0.0, help="sampling temperature of the judge (0 = greedy, reproducible)")
    concurrency: int = setting(8, help="requests in flight per rank (the server batches them)")
    api_key_env: str | None = setting(None, help="environment variable holding an API key sent as a Bearer token")
    on_malformed: str = setting("error", choices=("error", "nan"),
                                help="a malformed answer: error (stop with its text) or nan (skip its group)")


class MalformedAnswer(ServiceError):
    """The judge's answer does not have the required format (one line)."""


def png_data_url(image: np.ndarray) -> str:
    """uint8 [H, W, 3] -> "data:image/png;base64,..." (lossless)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@functools.lru_cache(maxsize=256)
def file_data_url(path: str) -> str:
    """A dataset's image file as a PNG data URL of its RGB pixels (cached: a group's samples share their source)."""
    from PIL import Image

    with Image.open(path) as image:
        return png_data_url(np.asarray(image.convert("RGB")))


def template_fields(template: str) -> list[str]:
    """The field names a template's braces hold ({prompt}, {target}, ...), each once; ValueError for braces that a
    row cannot fill (positional {}, attribute or index access, an unmatched brace)."""
    fields = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"{{{name}}} is not a field name")
        fields.append(name)
    return list(dict.fromkeys(fields))


def _api_key(options: dict[str, Any], setting_name: str) -> dict[str, str]:
    name = options["api_key_env"]
    if name is None:
        return {}
    key = os.environ.get(name)
    if not key:
        raise ConfigError(f"{setting_name}.api_key_env: the environment variable {name} is not set; export it or "
                          f"set api_key_env: null")
    return {"Authorization": f"Bearer {key}"}


class VLMJudgeReward(Reward):
    """The judge's rating of each image against its prompt."""

    DESCRIPTION = "VLM judge behind an OpenAI-compatible chat API (vLLM, SGLang): template + PNG image -> parsed score"
    OPTIONS = VLMJudgeOptions

    @classmethod
    def validate(cls, options: dict[str, Any], setting: str) -> None:
        Service.check(options, setting)
        try:
            fields = template_fields(options["template"])
        except ValueError as err:
            raise ConfigError(f"{setting}.template: {err}; name a field in braces, e.g. {{prompt}} or {{target}}, and "
                              f"write literal braces as {{{{ and }}}}") from None
        if "prompt" not in fields:
            raise ConfigError(f"{setting}.template: no {{prompt}} placeholder; the judge must see the prompt")
        try:
            groups = re.compile(options["answer"]).groups
        except re.error as err:
            raise ConfigError(f"{setting}.answer: not a regular expression ({err})") from None
        if groups < 1:
            raise ConfigError(f"{setting}.answer: needs a group around the number, e.g. Score: (\\d+)")
        if not options["min_score"] < options["max_score"]:
            raise ConfigError(f"{setting}.min_score: {options['min_score']} must be below max_score "
                              f"{options['max_score']}")
        for key in ("concurrency", "max_tokens"):
            if options[key] < 1:
                raise ConfigError(f"{setting}.{key}: {options[key]}; use at least 1")
        _api_key(options, setting)

    @classmethod
    def probe(cls, options: dict[str, Any], setting: str) -> None:
        service = Service(options, setting, _api_key(options, setting))
        listed = service.probe("/models", "an OpenAI-compatible server (vllm serve MODEL)")
        ids = [m.get("id") for m in listed.get("data", [])] if isinstance(listed, dict) else []
        if options["model"] not in ids:
            raise ConfigError(f"{setting}.model: {options['url']} serves {', '.join(map(str, ids)) or 'no model'}, "
                              f"not {options['model']!r}; use its id")

    @classmethod
    def check_metadata(cls, metadata: dict, options: dict[str, Any]) -> None:
        missing = [f for f in template_fields(options["template"]) if f != "prompt" and metadata.get(f) is None]
        if missing:
            raise ValueError(f"has no {', '.join(map(repr, missing))} (template fields)")

    def __init__(self, name: str, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(name, options["batch_size"])
        self.setting = f"rewards.{name}"
        self.service = Service(options, self.setting, _api_key(options, self.setting))
        self.options = options
        self.pattern = re.compile(options["answer"])
        self.fields = template_fields(options["template"])

    def messages(self, image: np.ndarray, prompt: str, metadata: dict | None = None) -> list[dict[str, Any]]:
        """The chat of one image: [system], user (the row's source images, the image, then the template text)."""
        metadata = metadata or {}
        values = {f: metadata.get(f) for f in self.fields if f != "prompt"}
        sources = row_images(metadata) if self.options["source_images"] else []
        user = {"role": "user", "content": [
            *({"type": "image_url", "image_url": {"url": file_data_url(path)}} for path in sources),
            {"type": "image_url", "image_url": {"url": png_data_url(image)}},
            {"type": "text", "text": self.options["template"].format(**values, prompt=prompt)},
        ]}
        system = self.options["system"]
        return ([{"role": "system", "content": system}] if system is not None else []) + [user]

    def ask(self, image: np.ndarray, prompt: str, metadata: dict | None = None) -> str:
        """The judge's answer text for one image."""
        body = {"model": self.options["model"], "messages": self.messages(image, prompt, metadata),
                "max_tokens": self.options["max_tokens"], "temperature": self.options["temperature"]}
        response = self.service.post("/chat/completions", json=body)
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ServiceError(f"{self.setting}: {self.service.url}/chat/completions answered no chat completion "
                               f"({response.text[:120]!r}); is it an OpenAI-compatible server?") from None
        return content if isinstance(content, str) else ""

    def parse(self, answer: str) -> float:
        """The score in `answer`; MalformedAnswer if it does not match `answer` or is out of range."""
        match = self.pattern.fullmatch(answer.strip())
        value = float(match.group(1)) if match and _is_number(match.group(1)) else None
        low, high = self.options["min_score"], self.options["max_score"]
        if value is None or not low <= value <= high:
            raise MalformedAnswer(f"{self.setting}: the judge answered {answer[:200]!r}, expected a whole answer "
                                  f"matching {self.pattern.pattern!r} with a score in [{low:g}, {high:g}]; make "
                                  f"{self.setting}.template ask for that format, change {self.setting}.answer, or "
                                  f"set {self.setting}.on_malformed: nan to skip the groups of such images")
        return value

    def score_samples(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        pixels = to_uint8(images).permute(0, 2, 3, 1).cpu().numpy()
        with ThreadPoolExecutor(min(self.options["concurrency"], len(prompts))) as pool:
            answers = list(pool.map(self.ask, pixels, prompts, metadata))
        scores = []
        for answer in answers:
            try:
                scores.append(self.parse(answer))
            except MalformedAnswer as err:
                if self.options["on_malformed"] == "error":
                    raise
                logger.warning("%s (scored NaN: on_malformed is nan)", err)
                scores.append(float("nan"))
        return torch.tensor(scores, dtype=torch.float32)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
