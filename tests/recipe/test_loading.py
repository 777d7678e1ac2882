"""Loading the transformer into ZeRO-3 shards (grpo/loading.py): same weights as from_pretrained, LoRA on top."""

import json

import pytest
import torch

from benchmarks._common import transformer_config, write_model_folder
from grpo.errors import ConfigError
from grpo.loading import _check_shapes, _fill_units, checkpoint_files, fill_from_safetensors, transformer_loader
from tests import ROOT, TINY
from tools.launch import run_torchrun


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny transformer twice: fp32 in 5 shards with an index json, bf16 in one file."""
    tmp = tmp_path_factory.mktemp("models")
    cfg = transformer_config("tiny")
    return {"fp32_sharded": write_model_folder(tmp / "fp32_sharded", cfg, max_shard_size="2MB"),
            "bf16_single": write_model_folder(tmp / "bf16_single", cfg, dtype=torch.bfloat16, seed=1)}


def test_checkpoint_files_maps_every_tensor_to_its_shard(folders):
    sharded = checkpoint_files(folders["fp32_sharded"] / "transformer")
    single = checkpoint_files(folders["bf16_single"] / "transformer")
    assert set(sharded) == set(single)
    assert len({p.name for p in sharded.values()}) == 5
    assert {p.name for p in single.values()} == {"diffusion_pytorch_model.safetensors"}
    with pytest.raises(ConfigError, match="model.zero_init=false"):
        checkpoint_files(folders["fp32_sharded"])  # the pipeline folder itself holds no weights


def test_every_parameter_is_filled_exactly_once():
    from benchmarks._common import build_transformer

    model = build_transformer(transformer_config("tiny"))
    names = [n for unit in _fill_units(model) for n, _ in unit]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_shape_and_key_mismatches_are_caught_before_any_collective(folders):
    folder = folders["fp32_sharded"] / "transformer"
    files = checkpoint_files(folder)
    name = "proj_out.weight"
    with pytest.raises(ConfigError, match=f"model.path: {name} has shape"):
        _check_shapes(files, {name: (1, 2)}, folder)
    extra = torch.nn.Module()
    extra.unknown = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ConfigError, match="lacks 1 transformer weight"):
        fill_from_safetensors(extra, folder)  # raised on every rank before the first gather


def test_loader_choice(monkeypatch):
    from grpo import loading

    monkeypatch.setattr(loading, "load_transformer_zero3", lambda path, dtype, ds: ("zero3", path, dtype, ds))
    plain = transformer_loader(False, {})(str(TINY), torch.float32)
    assert type(plain).__name__ == "FluxTransformer2DModel" and plain.dtype == torch.float32
    assert transformer_loader(True, {"x": 1})(str(TINY), torch.bfloat16) == ("zero3", str(TINY), torch.bfloat16,
                                                                              {"x": 1})


def test_two_processes_load_the_same_weights_as_from_pretrained_and_lora_trains(folders, tmp_path):
    out = tmp_path / "check.json"
    run_torchrun(2, [str(ROOT / "benchmarks" / "zero3_memory.py"), "--worker", "load-check", "--model",
                     str(folders["fp32_sharded"]), str(folders["bf16_single"]), "--out", str(out)], accelerator=None)
    report = json.loads(out.read_text())
    assert report["world"] == 2
    for name, r in report["folders"].items():
        assert r["mismatched"] == [], name  # bit-identical to from_pretrained(dtype=...)
        assert r["dtypes"] == (["torch.bfloat16"] if "bf16" in name else ["torch.float32"])
        assert r["local_numel"] <= r["full_numel"] / 2 + 1000  # each rank holds only its shard
        assert r["lora_params"] > 0 and r["lora_same_on_all_ranks"]
        assert r["forward_max_diff"] == 0.0  # gaussian LoRA init has B = 0: the engine's output is the base model's
