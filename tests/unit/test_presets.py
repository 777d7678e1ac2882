"""Presets from two axes: a model base (<model>/base.yaml over shared.yaml) and an objective (objectives/<name>.yaml,
with its strategy overlays beside it), composed by `extends: [base.yaml, ../objectives/grpo.yaml]`. Every runnable
preset resolves to the settings it had at a8d41cc, before the split, apart from the deliberate changes listed here;
each holds only what differs from what it extends; `python -m tools.check --resolved` prints it back whole.

tests/unit/data/presets_a8d41cc.json holds every runnable preset of a8d41cc resolved (all folders), made at that
commit by:

    import json
    from pathlib import Path
    from grpo.config import load_config, to_dict
    from grpo.errors import ConfigError
    out = {}
    for p in sorted(Path(".").glob("recipes/configs/**/*.yaml")):
        if p.name == "base.yaml":
            continue
        try:
            cfg = load_config(p)
        except ConfigError as e:  # the FLUX.1-dev-based presets name no training prompts
            assert "data.train_prompts" in str(e)
            cfg = load_config(p, ["data.train_prompts=assets/prompts/tiny_train.txt"])
        out[str(p)] = to_dict(cfg)
    Path("tests/unit/data/presets_a8d41cc.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\\n")

(It subsumes presets_before.json, the 18 presets of 1bcf08d, which resolved at a8d41cc as that test checked.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from grpo.config import dump_config, load_config, to_dict
from grpo.errors import ConfigError
from grpo.schema import merge, read_preset, read_yaml
from tools import check

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "recipes/configs"
ORACLE = json.loads((ROOT / "tests/unit/data/presets_a8d41cc.json").read_text())

# Presets that moved since a8d41cc, out of the model folders: measured below DanceGRPO or collapsed (their headers say
# how), or on the step-distilled klein with an objective no source trains it with (the field trains klein base:
# flux2_klein_base/).
MOVED = {
    "recipes/configs/tiny/opgrpo_lora.yaml": "recipes/configs/experimental/tiny_opgrpo_lora.yaml",
    "recipes/configs/flux1_dev/opgrpo_lora.yaml": "recipes/configs/experimental/flux1_dev_opgrpo_lora.yaml",
    "recipes/configs/tiny/grpo_candidates_lora.yaml": "recipes/configs/experimental/tiny_grpo_candidates_lora.yaml",
    "recipes/configs/tiny/mixgrpo_flash_frozen_lora.yaml":
        "recipes/configs/experimental/tiny_mixgrpo_flash_frozen_lora.yaml",
    "recipes/configs/flux2_klein/nft_lora.yaml": "recipes/configs/experimental/flux2_klein_nft_lora.yaml",
    "recipes/configs/flux2_klein/edit_nft_lora.yaml": "recipes/configs/experimental/flux2_klein_edit_nft_lora.yaml",
}
# Presets new since a8d41cc (no oracle entry): every objective on every real family, FLUX.2 [klein] base with
# true CFG, the tiny FLUX.3.
NEW = ["recipes/configs/experimental/flux2_klein_awm_lora.yaml", "recipes/configs/flux2_dev/nft_lora.yaml",
       "recipes/configs/flux2_dev/awm_lora.yaml", "recipes/configs/flux1_kontext_dev/awm_lora.yaml",
       "recipes/configs/tiny_flux2/awm_lora.yaml", "recipes/configs/tiny_flux3/grpo_lora.yaml",
       "recipes/configs/tiny_flux3/nft_lora.yaml", "recipes/configs/tiny_flux3/awm_lora.yaml",
       *(f"recipes/configs/flux2_klein_base/{name}.yaml" for name in
         ("grpo_lora", "grpo_full", "nft_lora", "nft_full", "awm_lora", "awm_full", "grpo_lora_9b", "nft_lora_9b",
          "awm_lora_9b")),
       *(f"recipes/configs/flux3/{name}.yaml" for name in
         ("grpo_lora", "grpo_full", "nft_lora", "nft_full", "awm_lora", "awm_full"))]
REAL = ("flux1_dev", "flux1_kontext_dev", "flux2_klein", "flux2_klein_base", "flux2_dev", "flux3")  # real models
# Every objective has a preset on these; the step-distilled klein keeps GRPO only, the objective a source trains it
# with (Flow-Factory's examples/grpo/*/flux2_klein): its nft and awm presets are experimental.
EVERY_OBJECTIVE = tuple(m for m in REAL if m != "flux2_klein")
TINY_PROMPTS = "assets/prompts/tiny_train.txt"  # what every FLUX.1-dev preset trained on before it had to be given


def _runnable() -> list[str]:
    """Every runnable preset, found by glob in every folder: not a model base, shared.yaml nor an objective file."""
    return sorted(str(p.relative_to(ROOT)) for p in CONFIGS.rglob("*.yaml")
                  if p.name not in ("base.yaml", "shared.yaml") and p.parent.name != "objectives")


RUNNABLE = _runnable()
BASES = sorted(str(p.relative_to(ROOT)) for p in CONFIGS.glob("*/base.yaml"))
OBJECTIVES = sorted(str(p.relative_to(ROOT)) for p in (CONFIGS / "objectives").glob("*.yaml"))
OLD = {new: old for old, new in MOVED.items()}


def _real(preset: str) -> bool:
    """A preset on a real model: it names no prompts (an experimental one by its file name)."""
    return Path(preset).parent.name in REAL or Path(preset).name.startswith(tuple(f"{m}_" for m in REAL))


def _overrides(preset: str) -> list[str]:
    """A real model's preset names no prompts: the test gives the training file it used to name, and no eval."""
    return [f"data.train_prompts={TINY_PROMPTS}", "data.eval_prompts=null"] if _real(preset) else []


# Settings new since a8d41cc, in every preset at the value that keeps the run as it was (dotted key -> value).
NEW_SETTINGS = {
    "sampling.true_cfg": None,  # new setting, off: true CFG
    "sampling.eval_cfg_scale": None,  # new setting: the evals guide as the rollouts do
    "logging.collapse_alarm.sigmas": 3.0,  # new setting: the collapse alarm warns (grpo/best.py), training unchanged
    "logging.collapse_alarm.stop": False,  # ... and never stops the run
    "export.formats": ["diffusers"],  # new setting: the final LoRA in diffusers' format only, as before
    "perf.peak_tflops": None,  # new setting: the device's peak from grpo/perf.py's table (MFU metrics only)
}
# The same for the lora section, in the presets that have one.
NEW_LORA_SETTINGS = {
    "lora.init_from": None,  # new setting, off: the adapters start from PEFT's init
}
# The same for the grpo section, in the presets that have one.
NEW_GRPO_SETTINGS = {
    "grpo.trust_region": None,  # new setting, off: Flow-DPPO's KL mask (the ratio clip stays)
    "grpo.gardo": None,  # new setting, off: GARDO's gated KL and refreshed reference
}
# The same for the forward-process objectives' sections (nft, awm), in the presets that have one.
NEW_FORWARD_SETTINGS = {
    "norm_guard": None,  # new setting, off: NormGuard's hinge on the velocity norm
}


def deliberate(preset: str) -> dict[str, object]:
    """The settings of `preset` that changed on purpose since a8d41cc (dotted key -> the value now)."""
    changes: dict[str, object] = {}
    if _real(preset):
        # No tiny-world file in a real model's preset: its held-out prompts are given, or null (issue 52, item 2).
        changes["data.eval_prompts"] = None
    if Path(OLD.get(preset, preset)).parent.name in ("flux2_klein", "flux2_dev"):
        # FLUX.2's own sampler, nothing of FLUX.1's: the pipelines' dynamic shift (compute_empirical_mu), not 3.0
        changes["sampling.shift"] = "dynamic"
    if Path(OLD.get(preset, preset)).parent.name == "tiny_flux2":
        # the held-out evals at the world's inference setting, true CFG 4 (Flux2KleinPipeline on a non-distilled klein)
        changes["sampling.eval_cfg_scale"] = 4.0
    if preset == "recipes/configs/tiny_flux2/nft_lora.yaml":
        # ... but the CFG-free DiffusionNFT default run is judged as DiffusionNFT samples: without CFG, as it ran
        changes["sampling.eval_cfg_scale"] = 1.0
    return changes


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


def _files(path: Path) -> list[Path]:
    """Every file a preset's extends reach (itself included), resolved."""
    raw = read_yaml(path)
    bases = raw.get("extends") or []
    entries = [bases] if isinstance(bases, str) else bases
    return [path.resolve(), *(f for b in entries for f in _files(path.parent / b))]


# ---------------------------------------------------------------------------------------------------- the oracle


@pytest.mark.parametrize("preset", RUNNABLE)
def test_every_preset_resolves_to_its_settings_at_a8d41cc_apart_from_the_listed_changes(preset):
    old = OLD.get(preset, preset)
    if old not in ORACLE:
        assert preset in NEW, f"{preset} has no a8d41cc settings and is not listed as new"
        return
    want = _leaves(ORACLE[old])
    grpo = any(k.startswith("grpo.") for k in want)
    lora = any(k.startswith("lora.") for k in want)
    forward = {f"{o}.{k}": v for o in ("nft", "awm") if any(w.startswith(f"{o}.") for w in want)
               for k, v in NEW_FORWARD_SETTINGS.items()}
    for key, value in {**NEW_SETTINGS, **(NEW_GRPO_SETTINGS if grpo else {}),
                       **(NEW_LORA_SETTINGS if lora else {}), **forward}.items():
        assert key not in want, f"{key} is listed as new but was a setting at a8d41cc"
        want[key] = value
    for key, value in deliberate(preset).items():
        assert want[key] != value, f"{preset}: {key} is listed as changed but is as at a8d41cc"
        want[key] = value
    _same(_leaves(to_dict(load_config(ROOT / preset, _overrides(preset)))), want)


def test_no_preset_is_lost_and_every_new_one_is_listed():
    found = {OLD.get(p, p) for p in RUNNABLE}
    assert set(ORACLE) <= found, f"gone since a8d41cc: {sorted(set(ORACLE) - found)}"
    assert sorted(found - set(ORACLE)) == sorted(NEW)
    assert not set(MOVED) & set(RUNNABLE)  # a moved preset is gone from its old place


def test_the_default_run_resolves_exactly_as_at_a8d41cc():
    """recipes/configs/tiny/awm_lora.yaml, the README's default run: no deliberate change at all."""
    preset = "recipes/configs/tiny/awm_lora.yaml"
    assert deliberate(preset) == {}
    _same(_leaves(to_dict(load_config(ROOT / preset))), {**_leaves(ORACLE[preset]), **NEW_SETTINGS,
                                                         **NEW_LORA_SETTINGS,
                                                         **{f"awm.{k}": v for k, v in NEW_FORWARD_SETTINGS.items()}})


@pytest.mark.parametrize("objective", ["grpo", "nft", "awm"])
@pytest.mark.parametrize("model", EVERY_OBJECTIVE)
def test_every_objective_has_a_preset_on_every_real_model(model, objective):
    preset = f"recipes/configs/{model}/{objective}_lora.yaml"
    assert preset in RUNNABLE
    assert (CONFIGS / "objectives" / f"{objective}.yaml").resolve() in _files(ROOT / preset)


# ------------------------------------------------------------------------------------ two axes, each setting once


@pytest.mark.parametrize("preset", [*RUNNABLE, *BASES])
def test_every_file_holds_only_what_differs_from_what_it_extends(preset):
    """No key repeats the value of what the file extends (a repeated value would hide a later change to the base,
    and a new objective setting would need more than one edit); every runnable preset reaches shared.yaml, one
    model base and one objective file."""
    path = ROOT / preset
    own = read_yaml(path)
    bases = own.pop("extends")
    under: dict = {}
    for base in [bases] if isinstance(bases, str) else bases:
        under = merge(under, read_preset(path.parent / base))

    def redundant(overlay: dict, below: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in overlay.items():
            if isinstance(value, dict) and isinstance(below.get(key), dict):
                out += redundant(value, below[key], f"{prefix}{key}.")
            elif key in below and below[key] == value:
                out.append(f"{prefix}{key}")
        return out

    assert not redundant(own, under), f"{preset} repeats what it extends: {redundant(own, under)}"
    if preset in RUNNABLE:
        files = _files(path)
        assert (CONFIGS / "shared.yaml").resolve() in files
        assert any(f.name == "base.yaml" for f in files)
        assert sum(f.parent.name == "objectives" and f.stem in ("grpo", "nft", "awm") for f in files) == 1


@pytest.mark.parametrize("path", [*BASES, *OBJECTIVES, "recipes/configs/shared.yaml"])
def test_bases_objectives_and_shared_are_not_runnable_alone(path):
    with pytest.raises(ConfigError):
        load_config(ROOT / path, ["data.train_prompts=p.txt", "data.eval_prompts=null"])


def test_bases_name_no_objective_and_objectives_no_model():
    for base in BASES:
        raw = read_preset(ROOT / base)
        assert "algorithm" not in raw and not {"grpo", "nft", "awm"} & raw.keys(), base
    for objective in OBJECTIVES:
        raw = read_yaml(ROOT / objective)
        assert "extends" not in raw and not {"model", "lora", "data", "rewards", "max_steps", "output_dir"} & raw.keys()
        assert not {"resolution", "num_steps", "shift", "guidance", "group_size"} & raw.get("sampling", {}).keys()
    shared = read_yaml(CONFIGS / "shared.yaml")
    assert "extends" not in shared and not {"algorithm", "rewards", "max_steps"} & shared.keys()


@pytest.mark.parametrize("base", ["flux2_klein", "flux2_klein_base", "flux2_dev", "flux3", "tiny_flux2",
                                  "tiny_kontext", "tiny_flux3"])
def test_flux2_and_the_tiny_worlds_inherit_no_flux1_sampler(base):
    """FLUX.2 [klein] and [dev] and FLUX.3 have their own sampler (the pipelines' schedule: FLUX.2's dynamic shift,
    FLUX.3's constant 6.93); the tiny FLUX.2 and Kontext bases restate the tiny world's instead of extending the
    FLUX.1 tiny base."""
    files = _files(CONFIGS / base / "base.yaml")
    assert not {(CONFIGS / "flux1_dev/base.yaml").resolve(), (CONFIGS / "tiny/base.yaml").resolve()} & set(files)
    sampling = read_yaml(CONFIGS / base / "base.yaml")["sampling"]
    assert {"resolution", "num_steps", "eta", "sde", "shift", "guidance", "group_size"} <= sampling.keys()
    if base.startswith(("flux2", "flux3")):
        assert sampling["shift"] == "dynamic"


def test_real_model_presets_name_no_prompts():
    """No tiny-world file in a real model's preset: both prompt sets are given on the command line."""
    for preset in RUNNABLE:
        if _real(preset):
            assert not {"train_prompts", "eval_prompts"} & read_preset(ROOT / preset).get("data", {}).keys(), preset


# ------------------------------------------------------------------------------------------------ extends: itself


def test_merge_mappings_key_by_key_anything_else_replaces():
    base = {"a": {"x": 1, "y": [1, 2], "z": {"k": 1}}, "lora": {"rank": 8}, "w": None}
    over = {"a": {"y": [3], "z": None}, "lora": None, "w": {"size": 2}}
    assert merge(base, over) == {"a": {"x": 1, "y": [3], "z": None}, "lora": None, "w": {"size": 2}}
    assert base["a"] == {"x": 1, "y": [1, 2], "z": {"k": 1}}  # neither input is changed


def test_extends_chains_are_relative_to_the_file_and_overrides_apply_last(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(read_preset(CONFIGS / "tiny/base.yaml")))
    (tmp_path / "sub/a.yaml").write_text("extends: ../base.yaml\noutput_dir: runs/a\nalgorithm: grpo\n"
                                         "grpo: {clip_range: 1.0e-4, timestep_fraction: 1.0}\n")
    (tmp_path / "sub/b.yaml").write_text("extends: a.yaml\noutput_dir: runs/b\ngrpo: {clip_range: 1.0e-5}\n"
                                         "lora: null\n")
    cfg = load_config(tmp_path / "sub/b.yaml", ["grpo.timestep_fraction=0.5"])
    assert (cfg.output_dir, cfg.grpo.clip_range, cfg.grpo.timestep_fraction, cfg.lora) == ("runs/b", 1e-5, 0.5, None)
    assert cfg.sampling.num_steps == 6  # from the base, two files up


def test_an_extends_list_merges_in_order_each_entry_with_what_it_extends(tmp_path):
    """The list's first entry first, later ones over it, the file itself last; an entry's own extends (depth-first)
    come before it."""
    (tmp_path / "root.yaml").write_text("a: root\nb: root\nc: root\nd: root\n")
    (tmp_path / "one.yaml").write_text("extends: root.yaml\nb: one\nc: one\n")
    (tmp_path / "two.yaml").write_text("c: two\nd: two\n")
    (tmp_path / "top.yaml").write_text("extends: [one.yaml, two.yaml]\nd: top\n")
    assert read_preset(tmp_path / "top.yaml") == {"a": "root", "b": "one", "c": "two", "d": "top"}
    (tmp_path / "rev.yaml").write_text("extends: [two.yaml, one.yaml]\n")  # one with its root, over two
    assert read_preset(tmp_path / "rev.yaml") == {"a": "root", "b": "one", "c": "one", "d": "root"}


def test_a_diamond_is_no_cycle_and_its_shared_file_is_merged_once(tmp_path):
    """Two entries over one shared file: shared is merged where first reached, not again under the second entry (that
    would undo what the first set over it)."""
    (tmp_path / "shared.yaml").write_text("x: shared\ny: shared\n")
    (tmp_path / "base.yaml").write_text("extends: shared.yaml\nx: base\n")
    (tmp_path / "objective.yaml").write_text("extends: shared.yaml\ny: objective\n")
    (tmp_path / "preset.yaml").write_text("extends: [base.yaml, objective.yaml]\n")
    assert read_preset(tmp_path / "preset.yaml") == {"x": "base", "y": "objective"}


def test_swap_resolves_a_preset_on_another_model_base():
    """tiny/grpo_lora.yaml on the tiny FLUX.2 base is tiny_flux2/grpo_lora.yaml (time_to_reward --family flux2 and
    the FLUX.2 strategy tests run the FLUX.1 strategy presets this way)."""
    swap = {CONFIGS / "tiny/base.yaml": CONFIGS / "tiny_flux2/base.yaml"}
    laid = read_preset(CONFIGS / "tiny/grpo_lora.yaml", swap=swap)
    assert laid["model"]["path"] == "assets/tiny-flux2"
    flux2 = read_preset(CONFIGS / "tiny_flux2/grpo_lora.yaml")
    assert merge(laid, {"output_dir": "runs/tiny_flux2_grpo_lora"}) == flux2
    mix = read_preset(CONFIGS / "tiny/mixgrpo_lora.yaml", swap=swap)  # two files up the chain: swapped as well
    assert mix["model"]["path"] == "assets/tiny-flux2" and mix["sampling"]["window"]["size"] == 2


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
    (tmp_path / "d.yaml").write_text("extends: [e.yaml]\n")  # through a list entry, two files on
    (tmp_path / "e.yaml").write_text("extends: [f.yaml]\n")
    (tmp_path / "f.yaml").write_text("extends: [seed.yaml, d.yaml]\n")
    (tmp_path / "seed.yaml").write_text("seed: 1\n")
    message = _refused(tmp_path / "d.yaml", capsys)
    assert "cycle" in message and "d.yaml -> " in message and "e.yaml -> " in message


def test_a_missing_base_is_one_line(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("extends: nowhere.yaml\nseed: 1\n")
    message = _refused(tmp_path / "a.yaml", capsys)
    assert "nowhere.yaml does not exist" in message and "relative to" in message
    (tmp_path / "b.yaml").write_text("seed: 1\n")
    (tmp_path / "c.yaml").write_text("extends: [b.yaml, gone.yaml]\n")
    assert "extends: gone.yaml does not exist" in _refused(tmp_path / "c.yaml", capsys)


def test_a_base_that_is_not_a_mapping_is_one_line(tmp_path, capsys):
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "a.yaml").write_text("extends: list.yaml\n")
    message = _refused(tmp_path / "a.yaml", capsys)
    assert "list.yaml (extended by" in message and "must be a mapping" in message
    (tmp_path / "b.yaml").write_text("extends: [list.yaml]\n")
    assert "must be a mapping" in _refused(tmp_path / "b.yaml", capsys)


@pytest.mark.parametrize("extends", ["[1]", "[base.yaml, {a: 1}]", "[]", "''", "{a: b}"])
def test_an_extends_entry_that_is_not_a_path_is_one_line(extends, tmp_path, capsys):
    (tmp_path / "base.yaml").write_text("seed: 1\n")
    (tmp_path / "a.yaml").write_text(f"extends: {extends}\n")
    assert "extends: expected the path of a preset" in _refused(tmp_path / "a.yaml", capsys)


def test_duplicate_keys_are_refused_in_each_file_of_the_chain(tmp_path, capsys):
    (tmp_path / "base.yaml").write_text("seed: 1\nseed: 2\n")
    (tmp_path / "a.yaml").write_text("extends: base.yaml\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"base\.yaml line 2: key 'seed' is already set at line 1"):
        load_config(tmp_path / "a.yaml")


# --------------------------------------------------------------------------------- resolved, checked, given prompts


@pytest.mark.parametrize("preset", RUNNABLE)
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


@pytest.mark.parametrize("preset", [p for p in RUNNABLE if _real(p)])
def test_a_real_model_preset_without_its_prompts_is_refused(preset, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / preset)
    message = str(e.value)
    assert message.startswith("data.train_prompts: missing from ") and "\n" not in message
    assert "your prompt file" in message and "data.train_prompts=" in message
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / preset, [f"data.train_prompts={TINY_PROMPTS}"])
    assert str(e.value).startswith("data.eval_prompts: missing from ") and "\n" not in str(e.value)


def test_check_names_the_missing_eval_prompts_in_one_line(capsys):
    """`python -m tools.check --world-size 8 recipes/configs/flux1_dev/grpo_lora.yaml data.train_prompts=FILE`: exit 2,
    one line naming data.eval_prompts and how to give it (a file, or null for no held-out eval)."""
    assert check.main(["--world-size", "8", "recipes/configs/flux1_dev/grpo_lora.yaml",
                       f"data.train_prompts={TINY_PROMPTS}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: data.eval_prompts: missing from ")
    assert "a dataset or prompt file, or null for no held-out eval" in err
    assert "add data.eval_prompts=PATH (or null) to the command" in err


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding the real models' configs only (tools/flux_configs.json, what tools.plan reads
    offline) under their hub ids, so that a real preset's model.path resolves as after `hf download`; no weights."""
    import huggingface_hub.constants

    shipped = json.loads((ROOT / "tools/flux_configs.json").read_text())
    pipelines = {"black-forest-labs/FLUX.1-dev": "FluxPipeline",
                 "black-forest-labs/FLUX.1-Kontext-dev": "FluxKontextPipeline",
                 "black-forest-labs/FLUX.2-dev": "Flux2Pipeline",
                 "black-forest-labs/FLUX.2-klein-4B": "Flux2KleinPipeline",
                 "black-forest-labs/FLUX.2-klein-9B": "Flux2KleinPipeline",
                 "black-forest-labs/FLUX.2-klein-base-4B": "Flux2KleinPipeline",
                 "black-forest-labs/FLUX.2-klein-base-9B": "Flux2KleinPipeline",
                 "black-forest-labs/flux-3-image-klein-base": "Flux3ModularPipeline"}
    for repo, pipeline in pipelines.items():
        folder = tmp_path / "hub" / ("models--" + repo.replace("/", "--"))
        snapshot = folder / "snapshots" / ("0" * 40)
        (folder / "refs").mkdir(parents=True)
        (folder / "refs/main").write_text("0" * 40)
        for part in ("transformer", "vae"):
            (snapshot / part).mkdir(parents=True)
            (snapshot / part / "config.json").write_text(json.dumps(shipped[repo][part]))
        # a ModularPipeline's save (FLUX.3) has modular_model_index.json, not model_index.json
        index = "modular_model_index.json" if pipeline.endswith("ModularPipeline") else "model_index.json"
        (snapshot / index).write_text(json.dumps({"_class_name": pipeline}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path


@pytest.mark.parametrize("preset", [p for p in RUNNABLE if _real(p)])
def test_every_real_model_preset_passes_the_start_up_checks_on_8_processes(preset, hub_cache, capsys):
    """`python -m tools.check --world-size 8 PRESET data.train_prompts=... data.eval_prompts=...` with the model's
    configs in the hub cache and the reward's files local (as tests/unit/test_rewards_config.py does)."""
    from tests.unit.test_rewards_config import _localize

    rewards = _localize(read_preset(ROOT / preset)["rewards"], hub_cache / "rewards")
    edits = "kontext" in preset  # Kontext edits a source image a row
    prompts = "assets/prompts/tiny_edit_train.jsonl" if edits else TINY_PROMPTS
    heldout = "assets/prompts/tiny_edit_heldout.jsonl" if edits else "assets/prompts/tiny_heldout.txt"
    code = check.main(["--world-size", "8", preset, f"data.train_prompts={prompts}", f"data.eval_prompts={heldout}",
                       "rewards=" + yaml.safe_dump(rewards, default_flow_style=True, width=10_000).strip(),
                       f"output_dir={hub_cache / 'run'}"])
    assert code == 0, capsys.readouterr().err
