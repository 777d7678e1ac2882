"""tools.bench's own parts: the protocol applied over a preset (and refused when bad or overridden), the report's
arithmetic on hand values, and the shipped suites. The whole bench on the tiny world: tests/recipe/test_bench.py."""

from __future__ import annotations

import math

import pytest

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.prompts import read_prompt_set
from tests import ROOT
from tools import bench

PRESET = ROOT / "recipes" / "configs" / "tiny" / "grpo_lora.yaml"


def test_the_protocol_is_applied_over_the_preset():
    folder = bench.find_suite("tiny")
    protocol = bench.read_protocol(folder)
    cfg = load_config(PRESET, bench.apply_protocol(protocol, folder, ["optim.lr=0.5"]))
    assert cfg.optim.lr == 0.5  # the user's own overrides still apply
    assert (cfg.sampling.resolution, cfg.sampling.eval_num_steps, cfg.sampling.guidance) == (64, 6, 3.5)
    assert cfg.sampling.eval_true_cfg is None  # cfg_scale 1.0: no true CFG
    assert (cfg.logging.eval_seeds, cfg.seed) == (2, 0)
    assert cfg.data.eval_prompts == str(folder / "prompts.jsonl")
    assert protocol["tags"] == ["color", "shape"]
    # a bench trains nothing: the real models' presets, which name no training prompts, load with the suite's
    parti = bench.find_suite("partiprompts")
    cfg = load_config(ROOT / "recipes" / "configs" / "flux1_dev" / "grpo_lora.yaml",
                      bench.apply_protocol(bench.read_protocol(parti), parti, []))
    assert (cfg.sampling.resolution, cfg.sampling.eval_num_steps, cfg.data.train_prompts) == \
        (1024, 28, str(parti / "prompts.jsonl"))
    given = bench.apply_protocol(protocol, folder, ["data.train_prompts=assets/prompts/tiny_train.txt"])
    assert load_config(PRESET, given).data.train_prompts == "assets/prompts/tiny_train.txt"
    shifted = bench.read_protocol(folder) | {"seed": 7, "cfg_scale": 2.5, "steps": 3}
    cfg = load_config(PRESET, bench.apply_protocol(shifted, folder, []))
    assert (cfg.seed, cfg.sampling.eval_cfg_scale, cfg.sampling.eval_num_steps) == (7, 2.5, 3)


@pytest.mark.parametrize("override", ["sampling.resolution=32", "logging.eval_seeds=1", "seed=3",
                                      "data.eval_prompts=assets/prompts/tiny_heldout.txt"])
def test_an_override_of_a_pinned_setting_is_refused(override):
    folder = bench.find_suite("tiny")
    with pytest.raises(ConfigError, match="pinned by the suite"):
        bench.apply_protocol(bench.read_protocol(folder), folder, [override])


@pytest.mark.parametrize("text, match", [("resolution: 64\n", "missing"),
                                         ("prompts: p.txt\nresolution: 64\nsteps: 6\nguidance: 3.5\ncfg_scale: 1.0\n"
                                          "seeds_per_prompt: 1\nseed: 0\neta: 0.3\n", "eta 0.3"),
                                         ("prompts: p.txt\nsampler: dpm\n", "unknown keys \\['sampler'\\]"),
                                         ("- a\n", "a mapping")])
def test_a_bad_protocol_is_one_line(tmp_path, text, match):
    (tmp_path / "protocol.yaml").write_text(text)
    (tmp_path / "p.txt").write_text("a cat\n")
    with pytest.raises(ConfigError, match=match):
        bench.read_protocol(tmp_path)
    with pytest.raises(ConfigError, match="no protocol.yaml"):
        bench.find_suite(str(tmp_path / "nowhere"))


def test_the_report_arithmetic_on_hand_values():
    # images 0..3 show prompts a, b, a, b; a is tagged x, b y
    prompts, metadata = ["a", "b"], [{"t": "x"}, {"t": "y"}]
    base, one = [1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 5.0, 3.0]  # differences 1, 0, 2, -1
    s = bench.summarize(prompts, metadata, ["t"], base, [one])
    run = s["runs"][0]
    assert (s["images"], s["base"], run["checkpoint"]) == (4, 2.5, 3.0)
    assert run["mean"] == 0.5 and run["higher"] == 0.5 and run["n"] == 4
    assert run["se"] == pytest.approx(math.sqrt(5 / 3 / 4))  # sample variance 5/3 of the differences, over n
    x, y = s["tags"]["t"]["x"], s["tags"]["t"]["y"]
    assert (x["n"], x["base"], x["checkpoint"], x["mean"], x["higher"]) == (2, 2.0, 3.5, 1.5, 1.0)
    assert x["se"] == pytest.approx(0.5) and y["se"] == pytest.approx(0.5)
    assert (y["mean"], y["higher"]) == (-0.5, 0.0)
    assert s["spread"]["std"] is None  # one checkpoint: no spread between runs

    two = [1.0, 2.0, 3.0, 5.0]  # differences 0, 0, 0, 1: gain 0.25
    s = bench.summarize(prompts, metadata, ["t"], base, [one, two])
    assert [r["mean"] for r in s["runs"]] == [0.5, 0.25]
    assert s["spread"]["mean"] == 0.375 and s["spread"]["std"] == pytest.approx(math.sqrt(2 * 0.125 ** 2))
    assert (s["spread"]["low"], s["spread"]["high"], s["spread"]["worst"]) == (0.25, 0.5, 1)
    # per tag: the checkpoints' mean per image (1.5, 2, 4, 4) against the base
    assert s["tags"]["t"]["x"]["mean"] == 0.75 and s["tags"]["t"]["y"]["mean"] == 0.0

    alone = bench.summarize(prompts, metadata, ["t"], base, [])  # the base model only
    assert (alone["runs"], alone["spread"]) == ([], None)
    assert alone["tags"]["t"] == {"x": {"n": 2, "base": 2.0}, "y": {"n": 2, "base": 3.0}}
    assert "| x | 2 | 2.0000 |" in bench.render(_report(alone))
    md = bench.render(_report(s))
    assert "| x | 2 | 2.0000 | 2.7500 | +0.7500 | 0.2500 | 100% |" in md and "r 2.5000 | 3.0000 | 2.7500" in md


def _report(stats: dict) -> dict:
    return {"suite": {"name": "hand", "path": "p", "prompts": 2, "source": "s"}, "protocol": {"seeds_per_prompt": 2},
            "settings": {"model": "m"}, "rewards": {"r": 1.0},
            "checkpoints": [{"path": "a", "grid": "a.png"}, {"path": "b", "grid": "b.png"}], "stats": stats,
            "components": {"r": {"base": 2.5, "checkpoints": [3.0, 2.75]}}, "date": "d", "command": ["c"],
            "code": None, "packages": {}, "device": "cpu"}


def test_the_shipped_suites_read():
    for name, prompts, tags in (("tiny", 4, ["color", "shape"]), ("partiprompts", 1632, ["category", "challenge"])):
        folder = bench.find_suite(name)
        protocol = bench.read_protocol(folder)
        rows = read_prompt_set(str(folder / protocol["prompts"]), "suite")
        assert len(rows) == prompts and protocol["tags"] == tags
        assert all(m.get(t) for m in rows.metadata for t in tags), name
        assert (folder / "SOURCE.md").is_file()
    assert "Apache License" in (bench.find_suite("partiprompts") / "LICENSE").read_text()


def test_the_cli_refuses_bad_input_in_one_line(capsys):
    assert bench.main([str(PRESET)]) == 2
    assert bench.main([str(PRESET), "suite=nowhere"]) == 2
    assert bench.main([str(PRESET), "suite=tiny", "seed=3"]) == 2
    assert bench.main([str(PRESET), "suite=tiny", "checkpoint=a,b"]) == 2  # several: out= required
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)
