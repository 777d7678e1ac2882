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
