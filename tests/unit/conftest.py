"""Fixtures of the unit tests that need an upstream package's code as the reference."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import types
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hpsv2_open_clip(tmp_path_factory):
    """The open_clip fork of the hpsv2 package (hpsv2/src/open_clip: the model, transform and tokenizer code its
    img_score.py scores with), imported as `hpsv2_open_clip` from a copy of the installed package.

    Not imported as hpsv2.src.open_clip: hpsv2/__init__.py imports benchmark download helpers (clint) that the
    scoring code does not use. The copy adds the BPE vocabulary that its tokenizer reads at import and that the
    1.2.0 wheel leaves out; it is OpenAI CLIP's, the file open_clip ships.
    """
    import open_clip

    found = importlib.util.find_spec("hpsv2")  # finds the package without running its __init__
    assert found is not None, "hpsv2 is missing: pip install --no-deps -r requirements-test.txt"
    copy = tmp_path_factory.mktemp("hpsv2") / "hpsv2_open_clip"
    shutil.copytree(Path(found.submodule_search_locations[0]) / "src" / "open_clip", copy)
    shutil.copy(open_clip.tokenizer.default_bpe(), copy / "bpe_simple_vocab_16e6.txt.gz")
    try:  # its factory.py has a stray, unused `from turtle import forward`; turtle needs tkinter
        import turtle  # noqa: F401
    except ImportError:
        sys.modules["turtle"] = types.SimpleNamespace(forward=None)  # a Python built without tk
    spec = importlib.util.spec_from_file_location("hpsv2_open_clip", copy / "__init__.py",
                                                  submodule_search_locations=[str(copy)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["hpsv2_open_clip"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "hpsv2_open_clip"]:
            del sys.modules[name]


def package_class(path: Path, name: str, namespace: dict) -> type:
    """Class `name` of an upstream file, compiled from its source in `namespace` (the names its body uses): for
    packages whose modules cannot be imported with this stack (pins, training-only imports) but whose scoring code
    runs. Tracebacks point into the package's file."""
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


@pytest.fixture(scope="session")
def image_reward_package():
    """The `image-reward` package's ImageReward.py and BLIP modules (ImageReward.ImageReward, .models.BLIP.*),
    imported without running its `__init__`s: they import OpenAI's `clip` for the CLIP/aesthetic baselines the
    score does not use. Shims, none in the scoring math: fairscale where absent (vit.py imports it for checkpointing
    only); four helpers its 2023 med.py/blip.py take from transformers 4, which transformers 5 moved or dropped
    (apply_chunking_to_forward and prune_linear_layer now in pytorch_utils; invert_attention_mask and get_head_mask,
    written as transformers 4 had them; BertTokenizer.additional_special_tokens_ids) and the tied-weights table
    PreTrainedModel.post_init would set, which med.py's BertModel never calls."""
    import torch
    import transformers.modeling_utils as modeling_utils
    import transformers.pytorch_utils as pytorch_utils

    found = importlib.util.find_spec("ImageReward")
    assert found is not None, "image-reward is missing: pip install --no-deps -r requirements-test.txt"
    root = found.submodule_search_locations[0]
    saved = {n: sys.modules.get(n) for n in ("ImageReward", "ImageReward.models")}
    for name, path in (("ImageReward", root), ("ImageReward.models", f"{root}/models")):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package
    stubs = []
    if importlib.util.find_spec("fairscale") is None:
        stubs = ["fairscale", "fairscale.nn", "fairscale.nn.checkpoint", "fairscale.nn.checkpoint.checkpoint_activations"]
        for name in stubs:
            sys.modules[name] = types.ModuleType(name)
        sys.modules[stubs[-1]].checkpoint_wrapper = None
    added = [n for n in ("apply_chunking_to_forward", "prune_linear_layer", "find_pruneable_heads_and_indices")
             if not hasattr(modeling_utils, n)]
    for name in added:
        setattr(modeling_utils, name, getattr(pytorch_utils, name, None))  # pruning is never called
    med = importlib.import_module("ImageReward.models.BLIP.med")

    def invert_attention_mask(self, mask):
        extended = (mask[:, None, :, :] if mask.dim() == 3 else mask[:, None, None, :]).to(self.dtype)
        return (1.0 - extended) * torch.finfo(self.dtype).min

    med.BertModel.invert_attention_mask = invert_attention_mask
    med.BertModel.get_head_mask = lambda self, head_mask, layers: [None] * layers
    med.BertModel.all_tied_weights_keys = {}
    try:
        yield types.SimpleNamespace(ImageReward=importlib.import_module("ImageReward.ImageReward"),
                                    blip=importlib.import_module("ImageReward.models.BLIP.blip"),
                                    blip_pretrain=importlib.import_module("ImageReward.models.BLIP.blip_pretrain"),
                                    vit=importlib.import_module("ImageReward.models.BLIP.vit"))
    finally:
        for name in added:
            delattr(modeling_utils, name)
        for name in [n for n in sys.modules if n.split(".")[0] == "ImageReward"] + stubs:
            del sys.modules[name]
        sys.modules.update({k: v for k, v in saved.items() if v is not None})


@pytest.fixture(scope="session")
def hpsv3_package():
    """The `hpsv3` package's scoring code: its prompt texts and process_vision_info (importable), and the classes
    HPSv3RewardInferencer (inference.py) and Qwen2VLRewardModelBT (model/qwen2vl_trainer.py) compiled from their
    source: their modules import trl, omegaconf and training code (transformers==4.45.2 pin) the score never runs."""
    from collections.abc import Mapping
    from typing import List, Optional

    import torch
    from torch import nn
    from transformers import Qwen2VLForConditionalGeneration

    found = importlib.util.find_spec("hpsv3")
    assert found is not None, "hpsv3 is missing: pip install --no-deps -r requirements-test.txt"
    root = Path(found.submodule_search_locations[0])
    saved = sys.modules.get("hpsv3")
    package = types.ModuleType("hpsv3")  # its __init__ imports inference.py, which imports the training code
    package.__path__ = [str(root)]
    sys.modules["hpsv3"] = package
    collator = importlib.import_module("hpsv3.dataset.data_collator_qwen")
    utils = importlib.import_module("hpsv3.dataset.utils")
    model = package_class(root / "model" / "qwen2vl_trainer.py", "Qwen2VLRewardModelBT", {
        "torch": torch, "nn": nn, "Optional": Optional, "List": List,
        "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration})
    inferencer = package_class(root / "inference.py", "HPSv3RewardInferencer", {
        "os": __import__("os"), "torch": torch, "Mapping": Mapping, "process_vision_info": utils.process_vision_info,
        "INSTRUCTION": collator.INSTRUCTION, "prompt_with_special_token": collator.prompt_with_special_token,
        "prompt_without_special_token": collator.prompt_without_special_token})
    yield types.SimpleNamespace(Qwen2VLRewardModelBT=model, HPSv3RewardInferencer=inferencer,
                                INSTRUCTION=collator.INSTRUCTION,
                                prompt_with_special_token=collator.prompt_with_special_token)
    for name in [n for n in sys.modules if n.split(".")[0] == "hpsv3"]:
        del sys.modules[name]
    if saved is not None:
        sys.modules["hpsv3"] = saved
