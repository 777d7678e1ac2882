"""tools/shards.py's parts without a model: the key of a shard folder changes with everything a shard's numbers depend
on (and only then), shard files round-trip and a missing one is one line, and nproc= is checked before any process
starts. The sharded bench end to end (2 processes, a served reward, resume): tests/recipe/test_bench.py."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from grpo.config import load_config
from grpo.errors import ConfigError
from tests import ROOT, TINY
from tools import bench, shards
from tools import eval as tool_eval

PRESET = ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml"


def test_the_key_changes_with_what_the_numbers_depend_on(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    shutil.copy(bench.find_suite("tiny") / "prompts.jsonl", prompts)
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    cfg = load_config(PRESET, [f"data.eval_prompts={prompts}"])
    ckpt = {"files": {"a.pt": [10, "ab" * 32]}, "weights": "model", "step": 1}

    source = tmp_path / "source.png"
    source.write_bytes(b"png")

    def name(c=cfg, shard_size=4, meta=None) -> str:
        return shards.key_name(shards.shard_key(c, str(model), shard_size, meta, [str(source)]))

    base, trained = name(), name(meta=ckpt)
    assert name() == base and name(meta=dict(ckpt)) == trained and base != trained  # deterministic
    changed = [
        name(c=dataclasses.replace(cfg, seed=1)),  # a protocol's pinned setting
        name(c=load_config(PRESET, [f"data.eval_prompts={prompts}", "rewards={tiny_world: 2.0}"])),  # a reward
        name(shard_size=2),
        name(meta={**ckpt, "weights": "ema"}),
        name(meta={**ckpt, "files": {"a.pt": [10, "cd" * 32]}}),  # the checkpoint's content (meta.json's sha256)
    ]
    assert len({base, trained, *changed}) == 2 + len(changed)
    prompts.write_text(prompts.read_text().replace("red", "blue", 1))  # the prompt file's bytes, same path
    assert name() != base
    after_prompts = name()
    weights = next(model.rglob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b"\0")  # the base model's files, same folder
    assert name() != after_prompts
    after_model = name()
    source.write_bytes(b"png, edited")  # an editing set's source image, same path
    assert name() != after_model


def test_shard_files_round_trip_and_a_missing_one_is_one_line(tmp_path):
    store = shards.ShardStore(tmp_path, {"k": 1}, "base")
    images = torch.rand(2, 3, 8, 8)
    store.save(1, [2, 3], torch.tensor([[0.5], [0.25]]), ["r"], [2.0], images[1:], [3])
    store.save(0, [0, 1], torch.tensor([[1.0], [0.0]]), ["r"], [2.0], images[:0], [])
    assert sorted(p.name for p in store.dir.iterdir()) == ["00000.safetensors", "00001.safetensors", "key.json"]
    assert json.loads((store.dir / "key.json").read_text()) == {"k": 1}
    got = store.load(2)
    assert got["ids"] == [0, 1, 2, 3] and (got["names"], got["weights"]) == (["r"], [2.0])
    assert got["components"].flatten().tolist() == [1.0, 0.0, 0.5, 0.25]
    assert list(got["images"]) == [3] and torch.equal(got["images"][3], images[1])
    with pytest.raises(ConfigError, match=r"shards \[2\] missing.*shared by all processes"):
        store.load(3)
    assert shards.ShardStore(tmp_path, {"k": 2}, "base").dir != store.dir


def test_nproc_is_checked_before_any_process_starts(capsys):
    assert bench.main([str(PRESET), "suite=tiny", "nproc=0"]) == 2
    assert bench.main([str(PRESET), "suite=tiny", "nproc=2", "seed=3"]) == 2  # the bench's own check, not N ranks'
    assert tool_eval.main([str(PRESET), "nproc=two"]) == 2
    assert tool_eval.main([str(PRESET), "nproc=2", "weights=best"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err), err
    assert "nproc: '0'" in err[0] and "pinned by the suite" in err[1] and "weights: 'best'" in err[3]
