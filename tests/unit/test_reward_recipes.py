"""The reward recipes of docs/rewards.md (recipes/rewards/): GenEval's rules on injected detections, the GenEval
factory through the reward registry on a tiny random-weight OWLv2 and CLIP built from configs (no download), and
the OCR score. The YAML blocks are read from the page itself."""

import math
import re

import numpy as np
import pytest
import torch
import yaml

from grpo.rewards import build_rewards
from recipes.rewards.geneval import (ClipColours, OwlDetector, geneval, relative_position, requirements,
                                     score_row)
from recipes.rewards.ocr import levenshtein, ocr, similarity
from tests import ROOT

PAGE = ROOT / "docs" / "rewards.md"


def recipe(name: str) -> dict:
    """The `rewards:` map of the page's YAML block that starts with "# recipe: NAME"."""
    blocks = re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), re.S)
    [block] = [b for b in blocks if re.match(rf"# recipe: {re.escape(name)}(\s|$)", b)]
    return yaml.safe_load(block)["rewards"]


def fixed(found: dict, colours: dict | None = None, seen: list | None = None):
    """A detector returning `found` whatever the image (recording the threshold it was given) and a colour
    classifier returning `colours[class]`."""
    def detect(image, classes, threshold):
        if seen is not None:
            seen.append(threshold)
        return {c: found.get(c, []) for c in classes}

    return detect, (lambda image, cls, boxes: (colours or {}).get(cls, []))


IMAGE = np.zeros((64, 64, 3), np.uint8)
LEFT, RIGHT = (0.0, 20.0, 10.0, 30.0), (40.0, 20.0, 50.0, 30.0)


def test_relative_position_is_genevals_rule():
    assert relative_position(LEFT, RIGHT) == {"left of"} and relative_position(RIGHT, LEFT) == {"right of"}
    assert relative_position((0, 0, 10, 10), (0, 40, 10, 50)) == {"above"}
    # overlapping boxes whose centres differ by less than 0.1 x their sizes: no relation
    assert relative_position((0, 0, 40, 40), (1, 1, 41, 41)) == set()


@pytest.mark.parametrize("meta,found,colours,share", [
    ({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, {"dog": [LEFT]}, {}, 1.0),
    ({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, {}, {}, 0.0),
    # counting: 3 wanted, fewer than 4 allowed
    ({"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]},
     {"cup": [LEFT] * 3}, {}, 1.0),
    ({"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]},
     {"cup": [LEFT] * 4}, {}, 0.5),
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}, {"car": [LEFT]},
     {"car": ["red"]}, 1.0),
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}, {"car": [LEFT]},
     {"car": ["blue"]}, 0.5),
    ({"tag": "position", "include": [{"class": "dog", "count": 1},
                                     {"class": "cat", "count": 1, "position": ["right of", 0]}]},
     {"dog": [LEFT], "cat": [RIGHT]}, {}, 1.0),
    ({"tag": "position", "include": [{"class": "dog", "count": 1},
                                     {"class": "cat", "count": 1, "position": ["right of", 0]}]},
     {"dog": [RIGHT], "cat": [LEFT]}, {}, 2 / 3),
    ({"tag": "position", "include": [{"class": "dog", "count": 1},  # no dog: the relation cannot hold
                                     {"class": "cat", "count": 1, "position": ["right of", 0]}]},
     {"cat": [RIGHT]}, {}, 1 / 3),
])
def test_genevals_requirements_on_injected_detections(meta, found, colours, share):
    detect, colour = fixed(found, colours)
    assert score_row(IMAGE, meta, detect, colour, 0.3, 0.9, strict=False) == pytest.approx(share)
    assert score_row(IMAGE, meta, detect, colour, 0.3, 0.9, strict=True) == float(share == 1.0)


def test_counting_prompts_use_the_counting_threshold_and_untagged_rows_score_nan():
    seen = []
    detect, colour = fixed({"cup": [LEFT]}, seen=seen)
    score = geneval(detector=detect, colours=colour, threshold=0.25, counting_threshold=0.8)
    rows = [{"tag": "counting", "include": [{"class": "cup", "count": 1}]},
            {"tag": "single_object", "include": [{"class": "cup", "count": 1}]}, {}]
    out = score(torch.rand(3, 3, 64, 64), ["a", "b", "c"], rows)
    assert seen == [0.8, 0.25] and out[:2].tolist() == [1.0, 1.0] and math.isnan(out[2])


def tiny_clip_tokenizer():
    """CLIP's BPE tokenizer with a byte-level vocabulary and no merges (~520 ids), "!" at id 0 as in CLIP's own
    vocabulary: OWL's text queries count as present where their first id is above 0 (the start token), which the
    tiny FLUX.1's tokenizer, its start token at 0, would break."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = [c for c in bytes_to_unicode().values() if c != "!"]
    vocab = {t: i for i, t in enumerate(["!", *chars, *(c + "</w>" for c in ["!", *chars]),
                                         "<|startoftext|>", "<|endoftext|>"])}
    return CLIPTokenizer(vocab=vocab, merges=[])


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A random-weight OWLv2 and CLIP built from small configs, saved with their processors: the factory loads
    them by the same from_pretrained as the real checkpoints."""
    from transformers import (CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, Owlv2Config,
                              Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor)

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tiny_detectors")
    tokenizer = tiny_clip_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=77)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=64,
                  patch_size=16)
    Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=vision, projection_dim=32)).save_pretrained(
        root / "owlv2")
    Owlv2Processor(Owlv2ImageProcessor(size={"height": 64, "width": 64}), tokenizer).save_pretrained(root / "owlv2")
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)).save_pretrained(root / "clip")
    CLIPProcessor(CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}),
                  tokenizer).save_pretrained(root / "clip")
    return root / "owlv2", root / "clip"


def test_geneval_recipe_through_the_registry_on_a_tiny_detector(tiny_models):
    """The page's served map, with the tiny models: the reward the server would build scores each row as GenEval's
    rules do on what that detector and colour classifier return."""
    owl, clip = tiny_models
    [(key, options)] = recipe("geneval").items()
    options = {**options, "model": str(owl), "color_model": str(clip), "threshold": 0.0, "counting_threshold": 0.0}
    reward = build_rewards({key: options}, torch.device("cpu"))
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    rows = [{"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]},
            {"tag": "position", "include": [{"class": "dog", "count": 1},
                                            {"class": "cat", "count": 1, "position": ["left of", 0]}]}]
    scores = reward(images, ["a photo of a red car", "a photo of a cat left of a dog"], rows)[:, 0]
    detect, colours = OwlDetector(str(owl), torch.device("cpu"), 0.5), ClipColours(str(clip), torch.device("cpu"))
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for score, p, row in zip(scores.tolist(), pixels, rows):
        found = detect(p, sorted({r["class"] for r in row["include"]}), 0.0)
        assert found and all(len(b) > 0 for b in found.values())  # threshold 0: every class has boxes
        met, total = requirements(row, found, lambda cls, boxes: colours(p, cls, boxes))
        assert score == pytest.approx(met / total) and total == (2 if "color" in str(row) else 3)


def test_ocr_score_is_flow_grpos():
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3
    assert similarity("OPEN LATE", "open late") == 1.0
    assert similarity("the sign says OPEN LATE tonight", "Open Late") == 1.0  # contained
    assert similarity("OPN LATE", "OPEN LATE") == 1 - 1 / 8  # one deletion over 8 characters (no spaces)
    assert similarity("", "OPEN") == 0.0 and similarity("zzzzzzzzzzzz", "OPEN") == 0.0  # capped at the length
    reads = iter(["OPEN LATE", "OPN LATE"])
    score = ocr(read=lambda image, prompt, row: next(reads))
    out = score(torch.rand(3, 3, 8, 8), ["a", "b", "c"], [{"text": "open late"}, {"text": "open late"}, {}])
    assert out[:2].tolist() == pytest.approx([1.0, 1 - 1 / 8]) and math.isnan(out[2])
