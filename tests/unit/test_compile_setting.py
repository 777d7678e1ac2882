"""model.compile: the setting's validation and which modules it compiles (lazily: nothing is compiled here)."""

import json

import pytest

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.models.blocks import compile_blocks
from tests import ROOT, TINY

PRESET = ROOT / "recipes/configs/tiny/awm_lora.yaml"


def test_off_by_default_and_accepts_booleans():
    assert load_config(PRESET).model.compile is False
    assert load_config(PRESET, ["model.compile=true"]).model.compile is True


@pytest.mark.parametrize("bad", ["maybe", "2", "[1]"])
def test_a_bad_value_is_one_line_naming_the_setting(bad):
    with pytest.raises(ConfigError) as e:
        load_config(PRESET, [f"model.compile={bad}"])
    assert "model.compile" in str(e.value) and "\n" not in str(e.value)


def test_no_cpp_compiler_is_refused_before_loading(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="model.compile: true needs a C\\+\\+ compiler"):
        load_config(PRESET, ["model.compile=true"])
    load_config(PRESET, ["model.compile=false"])  # off: no compiler needed


@pytest.mark.parametrize("enabled", [True, False])
def test_compiles_exactly_the_repeated_blocks(enabled):
    from diffusers import FluxTransformer2DModel

    config = json.loads((TINY / "transformer" / "config.json").read_text())
    model = FluxTransformer2DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    compile_blocks(model, enabled)
    blocks = {id(b) for b in [*model.transformer_blocks, *model.single_transformer_blocks]}
    assert blocks
    compiled = {id(m) for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled == (blocks if enabled else set())
