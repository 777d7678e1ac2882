"""OCR reward: the text read from the image against the row's target text, as Flow-GRPO's OCR reward scores it.

A user reward (``pkg.module:factory``, docs/rewards.md). The score is Flow-GRPO's (yifan123/flow_grpo,
flow_grpo/ocr.py, ``OcrScorer.__call__``): both texts lower-cased with spaces removed; 1 when the target appears
in what was read, else 1 - min(Levenshtein distance, len(target)) / len(target), in [0, 1]. The target is the
row's `field` (default ``text``) of the dataset (grpo/prompt_sets.py), e.g.

    {"prompt": "A neon sign that says \\"OPEN LATE\\"", "text": "OPEN LATE"}

Two readers:
  - ``vlm`` (default): a vision-language model behind an OpenAI-compatible chat API (vLLM, SGLang) asked to
    transcribe the image (`template`), through the ``vlm_judge`` reward's own request code (its options: url,
    model, template, max_tokens, ...); runs in the training processes, the model on the serving machine.
  - ``got_ocr2``: GOT-OCR 2.0 in transformers (GotOcr2ForConditionalGeneration, "stepfun-ai/GOT-OCR-2.0-hf"),
    plain-text OCR of the whole image; serve it with ``python -m tools.rewards serve`` and use it as ``remote``.
Flow-GRPO reads with PaddleOCR, which is not a transformers model; GOT-OCR 2.0 is (transformers >= 4.49).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from grpo.rewards.base import to_uint8

# reader(image [H, W, 3] uint8, prompt, row) -> the text it read
Reader = Callable[[np.ndarray, str, dict], str]

TRANSCRIBE = "Transcribe all the text in this image exactly, with nothing else. (The image was generated for: {prompt})"


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character). Written out (one short dynamic
    programme) rather than adding a dependency: Flow-GRPO calls the `Levenshtein` package's distance, the same
    number."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def similarity(read: str, target: str) -> float:
    """Flow-GRPO's OCR score of the text `read` against `target` (module docstring); NaN for an empty target."""
    read, target = read.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not target:
        return float("nan")
    distance = 0 if target in read else min(levenshtein(read, target), len(target))
    return 1 - distance / len(target)


class VLMReader:
    """Asks a served VLM for the text through grpo.rewards.vlm_judge's request (same options, same image
    encoding); the answer is the text, not a score."""

    def __init__(self, options: dict):
        from grpo.rewards.options import validate_options
        from grpo.rewards.vlm_judge import VLMJudgeOptions, VLMJudgeReward

        options = validate_options({"template": TRANSCRIBE, "max_tokens": 128, **options}, VLMJudgeOptions,
                                   "rewards.ocr")
        VLMJudgeReward.validate(options, "rewards.ocr")
        self.judge = VLMJudgeReward("ocr", torch.device("cpu"), options)

    def __call__(self, image: np.ndarray, prompt: str, row: dict) -> str:
        return self.judge.ask(image, prompt, row)


class GotOcr2Reader:
    """GOT-OCR 2.0 through transformers: plain-text OCR of the whole image, greedy."""

    def __init__(self, model: str, device: torch.device, max_new_tokens: int):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model)
        self.model = AutoModelForImageTextToText.from_pretrained(model).eval().to(device)
        self.device, self.max_new_tokens = device, max_new_tokens

    @torch.no_grad()
    def __call__(self, image: np.ndarray, prompt: str, row: dict) -> str:
        inputs = self.processor(image, return_tensors="pt").to(self.device)
        out = self.model.generate(**inputs, do_sample=False, tokenizer=self.processor.tokenizer,
                                  stop_strings="<|im_end|>", max_new_tokens=self.max_new_tokens)
        return self.processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def ocr(reader: str = "vlm", field: str = "text", model: str = "stepfun-ai/GOT-OCR-2.0-hf", max_new_tokens: int = 64,
        read: Reader | None = None, **vlm_options) -> Callable[[torch.Tensor, Sequence[str], Sequence[dict]],
                                                               torch.Tensor]:
    """The reward's factory (``recipes.rewards.ocr:ocr``). reader: vlm (the other keywords are vlm_judge's options:
    url, model, template, ...) or got_ocr2 (model, max_new_tokens); `read` replaces the reader (tests, another
    OCR). A row without the `field` scores NaN (its group is skipped), as an image without a target has no score."""
    if reader not in ("vlm", "got_ocr2"):
        raise ValueError(f"reader: {reader!r}; use vlm or got_ocr2")
    loaded: dict[str, Reader] = {}

    def score(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        if not loaded:
            loaded["read"] = read or (VLMReader({"model": model, **vlm_options}) if reader == "vlm"
                                      else GotOcr2Reader(model, images.device, max_new_tokens))
        pixels = to_uint8(images).permute(0, 2, 3, 1).cpu().numpy()
        return torch.tensor([similarity(loaded["read"](p, prompt, row), str(row[field])) if row.get(field) is not None
                             else float("nan") for p, prompt, row in zip(pixels, prompts, metadata)],
                            dtype=torch.float32)

    return score
