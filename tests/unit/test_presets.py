"""Presets as a base plus overlays (issue 29): each resolves to the settings it had as a flat file, holds only what
differs from what it extends, and `python -m tools.check --resolved` prints it back whole.

tests/unit/data/presets_before.json holds the 18 presets' resolved settings at commit 1bcf08d, before the split (and
before the settings schema of issue 29); :func:`renamed` maps them to today's keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from grpo.config import dump_config, load_config, to_dict
from grpo.errors import ConfigError
from grpo.schema import merge, own_overrides, read_preset, read_yaml
from tools import check

ROOT = Path(__file__).resolve().parents[2]
BEFORE = json.loads((ROOT / "tests/unit/data/presets_before.json").read_text())
PRESETS = sorted(BEFORE)  # the 18 runnable presets, by path from the repository root
BASES = ["recipes/configs/tiny/base.yaml", "recipes/configs/flux1_dev/base.yaml"]
TINY_PROMPTS = "assets/prompts/tiny_train.txt"  # what every FLUX.1-dev preset trained on before it had to be given


def _overrides(preset: str) -> list[str]:
    """A FLUX.1-dev preset names no training prompts (issue 29): the test gives the file it used to name."""
    return [f"data.train_prompts={TINY_PROMPTS}"] if preset.startswith("recipes/configs/flux1_dev/") else []


def renamed(old: dict, preset: str) -> dict:
    """Settings in the schema before issue 29 -> the same settings now (/tmp/plan/schema.md), with its deliberate
    changes: advantage.eps is new (1e-8 where the source uses it, 1e-4 elsewhere), awm.timestep_draw is new,
    data.text_encoder_dtype is new (fp32), data.text_encoder_device_map and _max_memory are new (null: the whole
    encoder on one device, as before), and normalize_rewards_per_group is advantage.per_reward."""
    new = {k: v for k, v in old.items() if k not in ("grpo", "matching", "normalize_rewards_per_group")}
    # new with FLUX.2 (issue 30): encoded as before, in fp32 on one device
    new["data"] = {**old["data"], "text_encoder_dtype": "fp32", "text_encoder_device_map": None,
                   "text_encoder_max_memory": None}
    new["sampling"] = {**old["sampling"], "candidates": None,  # new with candidate selection (issue 32): off
                       "eval_num_steps": None}  # new with issue 32: evals on the rollout's steps, as before
    grpo, matching = old["grpo"], old["matching"]
    # 1e-8: DanceGRPO's, MixGRPO's and BranchGRPO's eps (a tree used 1e-8 before the setting existed)
    small_eps = preset in (*(f"recipes/configs/flux1_dev/{n}.yaml" for n in ("grpo_lora", "grpo_full", "mixgrpo_lora",
                                                                                "branchgrpo_lora")),
                           "recipes/configs/tiny/branchgrpo_lora.yaml")
    new["advantage"] = {"clip": grpo["adv_clip"], "std_scope": grpo["std_scope"], "eps": 1.0e-8 if small_eps else 1.0e-4,
                        "per_reward": old["normalize_rewards_per_group"]}
    forward = ("timesteps", "lag_rate", "lag_max", "lag_start", "kl_coef")
    own = {"grpo": (), "nft": ("beta",), "awm": ("huber_p", "anchor_coef")}[old["algorithm"]]
    if old["algorithm"] == "grpo":
        assert matching is None
        new["grpo"] = {k: grpo[k] for k in ("clip_range", "timestep_fraction", "kl_coef", "ratio_norm")}
        new["grpo"]["timestep_rescale"] = False  # new with Flash-GRPO (issue 32): off
        new["grpo"]["replay"] = None  # new with OP-GRPO's replay (issue 32): off
    else:
        new[old["algorithm"]] = {k: matching[k] for k in (*forward, *own)}
        new[old["algorithm"]]["group_noise"] = False  # new with issue 32: one noise per image, as the sources
    if old["algorithm"] == "awm":  # finding 2: AWM's own draw of the noise levels (it was uniform)
        new["awm"]["timestep_draw"] = "discrete_wo_init"
    if preset == "recipes/configs/tiny/awm_lora.yaml":  # the default run since issue 32: 120 steps, an EMA
        new["max_steps"], new["ema"] = 120, {"decay": 0.9}
        new["awm"]["group_noise"] = True  # ... and one noise per group (issue 32)
    return new


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(a: dict, b: dict) -> None:
    """Equal settings; on a difference, the keys that differ (a long dict's diff hides them)."""
    la, lb = _leaves(a), _leaves(b)
    diff = {k: (la.get(k, "<absent>"), lb.get(k, "<absent>")) for k in la.keys() | lb.keys() if la.get(k, ...) !=
            lb.get(k, ...)}
    assert not diff, diff


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_resolves_to_its_settings_before_the_split(preset):
    _same(to_dict(load_config(ROOT / preset, _overrides(preset))), renamed(BEFORE[preset], preset))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_is_an_overlay_holding_only_what_differs(preset):
    """No key repeats the value of what the overlay extends (a repeated value would hide a later change to the
    base), and every preset extends a base, directly or through another overlay."""
    path = ROOT / preset
    own = read_yaml(path)
    assert isinstance(own.get("extends"), str), f"{preset} extends nothing"
    base = read_preset(path.parent / own.pop("extends"))

    def redundant(overlay: dict, under: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in overlay.items():
            if isinstance(value, dict) and isinstance(under.get(key), dict):
                out += redundant(value, under[key], f"{prefix}{key}.")
            elif key in under and under[key] == value:
                out.append(f"{prefix}{key}")
        return out

    assert not redundant(own, base), f"{preset} repeats what it extends: {redundant(own, base)}"
    chain, at = [], path
    while "extends" in (raw := read_yaml(at)):
        at = at.parent / raw["extends"]
        chain.append(str(at.relative_to(ROOT)))
    assert chain[-1] in BASES


def test_bases_name_no_objective_and_flux1_dev_no_training_prompts():
    for base in BASES:
        raw = read_yaml(ROOT / base)
        assert "extends" not in raw and "algorithm" not in raw
        assert not {"grpo", "nft", "awm"} & raw.keys()
    assert "train_prompts" not in read_yaml(ROOT / "recipes/configs/flux1_dev/base.yaml")["data"]


def test_merge_mappings_key_by_key_anything_else_replaces():
    base = {"a": {"x": 1, "y": [1, 2], "z": {"k": 1}}, "lora": {"rank": 8}, "w": None}
    over = {"a": {"y": [3], "z": None}, "lora": None, "w": {"size": 2}}
    assert merge(base, over) == {"a": {"x": 1, "y": [3], "z": None}, "lora": None, "w": {"size": 2}}
    assert base["a"] == {"x": 1, "y": [1, 2], "z": {"k": 1}}  # neither input is changed


def test_extends_chains_are_relative_to_the_file_and_overrides_apply_last(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.yaml").write_text((ROOT / "recipes/configs/tiny/base.yaml").read_text())
    (tmp_path / "sub/a.yaml").write_text("extends: ../base.yaml\noutput_dir: runs/a\nalgorithm: grpo\n"
                                         "grpo: {clip_range: 1.0e-4, timestep_fraction: 1.0}\n")
    (tmp_path / "sub/b.yaml").write_text("extends: a.yaml\noutput_dir: runs/b\ngrpo: {clip_range: 1.0e-5}\n"
                                         "lora: null\n")
    cfg = load_config(tmp_path / "sub/b.yaml", ["grpo.timestep_fraction=0.5"])
    assert (cfg.output_dir, cfg.grpo.clip_range, cfg.grpo.timestep_fraction, cfg.lora) == ("runs/b", 1e-5, 0.5, None)
    assert cfg.sampling.num_steps == 6  # from the base, two files up


def test_a_family_overlay_laid_over_another_familys_preset_is_that_familys_preset():
    """own_overrides: tiny_flux2/base.yaml's own settings over tiny/grpo_lora.yaml resolve to tiny_flux2/grpo_lora.yaml
    (the FLUX.2 strategy tests and time_to_reward --family flux2 run the FLUX.1 strategy presets this way)."""
    overlay = own_overrides(ROOT / "recipes/configs/tiny_flux2/base.yaml")
    assert "model.path=assets/tiny-flux2" in overlay and not any(o.startswith("extends") for o in overlay)
    laid = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", [*overlay, "output_dir=runs/tiny_flux2_grpo_lora"])
    assert laid == load_config(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml")
    assert laid != load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", ["output_dir=runs/tiny_flux2_grpo_lora"])


def _refused(path: Path, capsys) -> str:
    """The one-line error of a preset, as load_config raises it and as a command line reports it (exit 2)."""
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    assert check.main(["--resolved", str(path)]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    return message


def test_an_extends_cycle_is_one_line(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\nseed: 1\n")
    message = _refused(tmp_path / "a.yaml", capsys)
    assert "cycle" in message and "remove the extends" in message
    (tmp_path / "c.yaml").write_text("extends: c.yaml\n")
    assert "cycle" in _refused(tmp_path / "c.yaml", capsys)


def test_a_missing_base_is_one_line(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("extends: nowhere.yaml\nseed: 1\n")
    message = _refused(tmp_path / "a.yaml", capsys)
    assert "nowhere.yaml does not exist" in message and "relative to" in message


def test_a_base_that_is_not_a_mapping_is_one_line(tmp_path, capsys):
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "a.yaml").write_text("extends: list.yaml\n")
    message = _refused(tmp_path / "a.yaml", capsys)
    assert "list.yaml (extended by" in message and "must be a mapping" in message
    (tmp_path / "b.yaml").write_text("extends: [list.yaml]\n")
    assert "extends: expected the path of a preset" in _refused(tmp_path / "b.yaml", capsys)


def test_duplicate_keys_are_refused_in_each_file_of_the_chain(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text("seed: 1\nseed: 2\n")
    (tmp_path / "a.yaml").write_text("extends: base.yaml\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"base\.yaml line 2: key 'seed' is already set at line 1"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize("preset", PRESETS)
def test_resolved_prints_every_setting_with_its_help_and_loads_back(preset, tmp_path):
    text = check.resolved(preset, _overrides(preset))
    assert "extends" not in yaml.safe_load(text)
    copy = tmp_path / "resolved.yaml"
    copy.write_text(text)
    _same(to_dict(load_config(copy)), to_dict(load_config(ROOT / preset, _overrides(preset))))
    assert "# SDE noise of the rollouts" in text and "# added to the std" in text  # the schema's help, as comments


def test_resolved_needs_no_world_size(capsys):
    assert check.main(["--resolved", "recipes/configs/tiny/grpo_lora.yaml", "max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["max_steps"] == 3


@pytest.mark.parametrize("preset", ["recipes/configs/tiny/grpo_full.yaml", "recipes/configs/flux1_dev/awm_full.yaml"])
def test_the_run_folders_config_yaml_keeps_the_resolved_settings(preset, tmp_path):
    cfg = load_config(ROOT / preset, _overrides(preset))
    dump_config(cfg, tmp_path / "config.yaml")
    assert "extends" not in yaml.safe_load((tmp_path / "config.yaml").read_text())
    _same(to_dict(load_config(tmp_path / "config.yaml")), to_dict(cfg))


@pytest.mark.parametrize("preset", [p for p in PRESETS if "/flux1_dev/" in p])
def test_a_flux1_dev_preset_without_training_prompts_is_refused(preset, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / preset)
    message = str(e.value)
    assert message.startswith("data.train_prompts: missing from ") and "\n" not in message
    assert "your prompt file" in message and "data.train_prompts=" in message
