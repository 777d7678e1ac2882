"""GenEval-style reward: a row's object / count / colour / position tags checked on an open-vocabulary detector's boxes.

A user reward (``pkg.module:factory``, docs/rewards.md), served by ``python -m tools.rewards serve`` on the machine
that holds the detector and used by the training run as a ``remote`` reward. Each dataset row carries GenEval's
metadata (``evaluation_metadata.jsonl`` of djghosh13/geneval: ``tag``, ``include``: [{class, count, color?,
position?: [relation, index]}], ``exclude``: [{class, count}]), e.g.

    {"prompt": "a photo of a red car", "tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}

The rules are GenEval's own (djghosh13/geneval, evaluation/evaluate_images.py, ``evaluate`` and
``relative_position``): at least `count` boxes of each included class; fewer than `count` of each excluded one; at
least `count` of them classified as the asked colour by CLIP zero-shot over GenEval's ten colours ("a photo of a
{color} {class}"); every box of the class in the asked relation ("left of", "right of", "above", "below") to every
box of the referenced include, the boxes' centres compared after shrinking their offset by 0.1 x the boxes' sizes.
GenEval's score is 1 when all hold; as a reward the default is the share of requirements met (each include's count,
colour and position, each exclude), `strict: true` gives GenEval's 0/1.

The detector differs: GenEval's Mask2Former (mmdet 2.x, a COCO-80 closed vocabulary) does not load in transformers;
OWLv2 (Owlv2ForObjectDetection, "google/owlv2-base-patch16-ensemble") does and takes any class name as a text query.
Its confidences are on another scale than Mask2Former's, so the thresholds are options (GenEval: 0.3, and 0.9 for
counting prompts), and OWLv2's duplicate boxes of one object are merged by non-maximum suppression (`nms_iou`).
The rules are written out here (a few lines of box arithmetic) because GenEval ships them inside its evaluation
script, bound to mmdet and not importable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from grpo.rewards.base import to_uint8

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")  # GenEval's
POSITION_THRESHOLD = 0.1  # GenEval's

Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels
# detect(image [H, W, 3] uint8, classes, threshold) -> {class: [boxes]}; colours(image, class, boxes) -> colour names
Detector = Callable[[np.ndarray, list[str], float], dict[str, list[Box]]]
ColourClassifier = Callable[[np.ndarray, str, list[Box]], list[str]]


def relative_position(a: Box, b: Box) -> set[str]:
    """Where box a is relative to box b, GenEval's rule: the centres' offset, shrunk by 0.1 x the two boxes' sizes
    per axis, normalised; a direction holds where its component passes 0.5 (image y grows downwards)."""
    boxes = np.array([a, b], dtype=np.float64).reshape(2, 2, 2)
    centre_a, centre_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = centre_a - centre_b
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    found = set()
    if dx < -0.5:
        found.add("left of")
    if dx > 0.5:
        found.add("right of")
    if dy < -0.5:
        found.add("above")
    if dy > 0.5:
        found.add("below")
    return found


def requirements(meta: dict, found: dict[str, list[Box]], colours: Callable[[str, list[Box]], list[str]]
                 ) -> tuple[int, int]:
    """(met, total) of a row's GenEval requirements on the boxes found per class."""
    met = total = 0
    groups: list[list[Box] | None] = []
    for req in meta.get("include", []):
        boxes = found.get(req["class"], [])
        ok = len(boxes) >= req["count"]
        met, total = met + ok, total + 1
        groups.append(boxes if ok else None)
        if "color" in req:
            total += 1
            met += ok and colours(req["class"], boxes).count(req["color"]) >= req["count"]
        if "position" in req:
            relation, index = req["position"]
            targets = groups[index] if index < len(groups) else None
            total += 1
            met += bool(ok and targets and all(relation in relative_position(box, target)
                                               for box in boxes for target in targets))
    for req in meta.get("exclude", []):
        total += 1
        met += len(found.get(req["class"], [])) < req["count"]
    return met, total


def score_row(image: np.ndarray, meta: dict, detect: Detector, colours: ColourClassifier, threshold: float,
              counting_threshold: float, strict: bool) -> float:
    """One image's reward from its row's tags; NaN for a row without GenEval tags (nothing to check)."""
    classes = sorted({r["class"] for r in meta.get("include", []) + meta.get("exclude", [])})
    if not classes:
        return float("nan")
    found = detect(image, classes, counting_threshold if meta.get("tag") == "counting" else threshold)
    met, total = requirements(meta, found, lambda cls, boxes: colours(image, cls, boxes))
    return float(met == total) if strict else met / total


class OwlDetector:
    """OWLv2 through transformers: one text query "a photo of a {class}" per class, boxes over `threshold`, the
    duplicates of each class merged by NMS at `nms_iou`."""

    def __init__(self, model: str, device: torch.device, nms_iou: float):
        from transformers import Owlv2ForObjectDetection, Owlv2Processor

        self.processor = Owlv2Processor.from_pretrained(model)
        self.model = Owlv2ForObjectDetection.from_pretrained(model).eval().to(device)
        self.device, self.nms_iou = device, nms_iou

    @torch.no_grad()
    def __call__(self, image: np.ndarray, classes: list[str], threshold: float) -> dict[str, list[Box]]:
        from torchvision.ops import nms

        queries = [f"a photo of a {c}" for c in classes]
        inputs = self.processor(text=[queries], images=image, return_tensors="pt").to(self.device)
        side = max(image.shape[:2])  # OWLv2 pads to a square: boxes in the padded frame map back 1:1
        [out] = self.processor.post_process_grounded_object_detection(
            self.model(**inputs), threshold=threshold, target_sizes=[(side, side)])
        found: dict[str, list[Box]] = {c: [] for c in classes}
        for i, cls in enumerate(classes):
            keep = out["labels"] == i
            boxes, scores = out["boxes"][keep].float(), out["scores"][keep].float()
            for j in nms(boxes, scores, self.nms_iou).tolist():
                found[cls].append(tuple(boxes[j].tolist()))
        return found


class ClipColours:
    """GenEval's colour check: CLIP zero-shot over its ten colours, "a photo of a {color} {class}", on each box's
    crop (GenEval also greys out the background with the object's mask; a detector's box has no mask)."""

    def __init__(self, model: str, device: torch.device):
        from transformers import CLIPModel, CLIPProcessor

        self.processor = CLIPProcessor.from_pretrained(model)
        self.model = CLIPModel.from_pretrained(model).eval().to(device)
        self.device = device

    @torch.no_grad()
    def __call__(self, image: np.ndarray, cls: str, boxes: list[Box]) -> list[str]:
        if not boxes:
            return []
        h, w = image.shape[:2]
        crops = []
        for x0, y0, x1, y1 in boxes:
            x0, y0 = int(min(max(0, np.floor(x0)), w - 1)), int(min(max(0, np.floor(y0)), h - 1))  # >= 1 pixel
            x1, y1 = int(min(w, max(np.ceil(x1), x0 + 1))), int(min(h, max(np.ceil(y1), y0 + 1)))
            crops.append(image[y0:y1, x0:x1])
        inputs = self.processor(text=[f"a photo of a {c} {cls}" for c in COLORS], images=crops, return_tensors="pt",
                                padding=True).to(self.device)
        return [COLORS[i] for i in self.model(**inputs).logits_per_image.argmax(-1).tolist()]


def geneval(model: str = "google/owlv2-base-patch16-ensemble", color_model: str = "openai/clip-vit-large-patch14",
            threshold: float = 0.3, counting_threshold: float = 0.9, nms_iou: float = 0.5, strict: bool = False,
            detector: Detector | None = None, colours: ColourClassifier | None = None
            ) -> Callable[[torch.Tensor, Sequence[str], Sequence[dict]], torch.Tensor]:
    """The reward's factory (``recipes.rewards.geneval:geneval``): its options are these keywords. `detector` and
    `colours` replace the models (tests, another detector); the models load on the first call, on the images'
    device."""
    loaded: dict[str, Callable] = {}

    def score(images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> torch.Tensor:
        if not loaded:
            loaded["detect"] = detector or OwlDetector(model, images.device, nms_iou)
            loaded["colours"] = colours or ClipColours(color_model, images.device)
        pixels = to_uint8(images).permute(0, 2, 3, 1).cpu().numpy()  # the uint8 levels of a saved image
        return torch.tensor([score_row(p, m, loaded["detect"], loaded["colours"], threshold, counting_threshold,
                                       strict) for p, m in zip(pixels, metadata)], dtype=torch.float32)

    return score
