"""Presets, overrides, batch arithmetic and DeepSpeed config filling."""

import json
import shutil
from pathlib import Path

import pytest

from grpo.config import load_config
from grpo.layout import derive_layout
from grpo.objectives.grpo import trained_transitions
from grpo.inputs import load_ds_config
from grpo.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
# The runnable presets: model bases, shared.yaml and objective files name no objective or no model
PRESETS = sorted(p for p in (ROOT / "recipes" / "configs").rglob("*.yaml")
                 if p.name not in ("base.yaml", "shared.yaml") and p.parent.name != "objectives")


def _tiny(preset: Path) -> bool:
    return preset.parent.name.startswith("tiny") or preset.name.startswith("tiny")  # experimental/tiny_*.yaml too


def _prompts(preset: Path) -> list[str]:
    """The presets of real models name no prompts: give the tiny world's training file and no held-out eval."""
    return [] if _tiny(preset) else ["data.train_prompts=assets/prompts/tiny_train.txt", "data.eval_prompts=null"]
DS_CONFIGS = sorted((ROOT / "ds_configs").glob("*.json"))


def test_presets_exist():
    names = {str(p.relative_to(ROOT / "recipes" / "configs")) for p in PRESETS}
    assert {"tiny/grpo_lora.yaml", "tiny/grpo_full.yaml", "flux1_dev/grpo_lora.yaml",
            "flux1_dev/grpo_full.yaml"} <= names


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.parent.name + "/" + p.name)
def test_every_preset_loads_and_splits(preset):
    cfg = load_config(preset, _prompts(preset))
    worlds = (1, 2) if _tiny(preset) else (1, 2, 8, 64)
    if cfg.sampling.branch is not None and not _tiny(preset):  # whole trees of 16 a process
        worlds = (1, 2, 8, 16)
        with pytest.raises(ConfigError, match="batch.micro_batch_size"):
            derive_layout(cfg, 64)
    for world in worlds:
        lay = derive_layout(cfg, world)
        ids = [lay.rank_sample_ids(r) for r in range(world)]
        flat = sorted(i for r in ids for i in r)
        assert flat == list(range(lay.samples_per_step))  # every sample on exactly one rank
        assert lay.ds_train_batch_size == lay.micro_batch_size * lay.grad_accum_steps * world


def test_tiny_preset_on_8_and_64_processes():
    """As its header says: valid as it is on 1, 2 and 8 processes, and on 64 with micro-batch 1."""
    cfg = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml")
    assert [derive_layout(cfg, n).samples_per_rank for n in (1, 2, 8)] == [64, 32, 8]
    cfg = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", ["batch.micro_batch_size=1"])
    assert derive_layout(cfg, 64).samples_per_rank == 1


def test_tiny_presets_differ_from_flux1_dev_only_in_values():
    """Tiny presets mirror the real ones key for key (resolved), so a user moving up changes values, not structure;
    only the training and held-out prompts, which the FLUX.1-dev ones leave to the user."""
    from grpo.schema import read_preset

    for kind in ("lora", "full"):
        tiny = read_preset(ROOT / f"recipes/configs/tiny/grpo_{kind}.yaml")
        dev = read_preset(ROOT / f"recipes/configs/flux1_dev/grpo_{kind}.yaml")
        assert _yaml_keys(tiny) - {"data.train_prompts", "data.eval_prompts"} == _yaml_keys(dev)


def test_update_blocks_are_world_size_invariant():
    cfg = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml",
                      ["batch.updates_per_step=2", "batch.micro_batch_size=4"])
    one, two = derive_layout(cfg, 1), derive_layout(cfg, 2)
    n = one.samples_per_rank_per_update
    blocks_one = [set(one.rank_sample_ids(0)[u * n:(u + 1) * n]) for u in range(2)]
    m = two.samples_per_rank_per_update
    blocks_two = [set(two.rank_sample_ids(0)[u * m:(u + 1) * m]) | set(two.rank_sample_ids(1)[u * m:(u + 1) * m])
                  for u in range(2)]
    assert blocks_one == blocks_two


def test_overrides_types_and_lora_switch():
    cfg = load_config(ROOT / "recipes/configs/tiny/grpo_full.yaml",
                      ["max_steps=3", "output_dir=/tmp/x", "seed=7", "lora.rank=4", "optim.lr=1e-5",
                       "sampling.shift=dynamic"])
    assert (cfg.max_steps, cfg.output_dir, cfg.seed) == (3, "/tmp/x", 7)
    assert cfg.lora is not None and cfg.lora.rank == 4
    assert cfg.optim.lr == 1e-5 and cfg.sampling.shift == "dynamic"
    assert load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", ["lora=null"]).lora is None


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["sampling.colour=1"], "sampling.colour: unknown setting; valid keys under sampling: resolution"),
        (["bogus=1"], "bogus: unknown setting; valid keys: output_dir"),
        (["max_steps=ten"], "max_steps: expected an integer"),
        (["max_steps=0"], "max_steps: must be > 0"),
        (["sampling.group_size=1"], "sampling.group_size"),
        (["sampling.eta=0"], "sampling.eta"),
        (["sampling.sde=ddim"], "sampling.sde"),
        (["sampling.shift=auto"], "sampling.shift"),
        (["sampling.eval_num_steps=0"], "sampling.eval_num_steps: 0; use at least 1, or null for num_steps"),
        (["sampling.resolution=60"], "sampling.resolution"),
        (["grpo.timestep_fraction=1.5"], "grpo.timestep_fraction"),
        (["advantage.std_scope=global"], "advantage.std_scope"),
        (["model.gradient_checkpointing=maybe"], "model.gradient_checkpointing: expected bool or int"),
        (["lora.target_modules=[]"], "lora.target_modules"),
        (["rewards={}"], "rewards: empty"),
        (["noequals"], "expected key=value"),
    ],
)
def test_bad_settings_name_the_setting(overrides, needle):
    with pytest.raises(ConfigError) as e:
        cfg = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", overrides)
        derive_layout(cfg, 1)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_short_rollouts_leave_awm_fewer_noise_levels():
    """AWM draws its levels from the rollout's schedule (points 1 .. int(0.9 n) - 1): 3 steps leave one, sigma 0.857,
    which time_to_reward's 3-step strategies train; asking for the preset's 2 stops before any work."""
    preset = ROOT / "recipes/configs/tiny/awm_lora.yaml"
    derive_layout(load_config(preset, ["sampling.num_steps=3", "sampling.eval_num_steps=6", "awm.timesteps=1"]), 1)
    with pytest.raises(ConfigError) as e:
        derive_layout(load_config(preset, ["sampling.num_steps=3", "sampling.eval_num_steps=6"]), 1)
    assert str(e.value) == "awm.timesteps: 2; use 1 .. 1, the schedule points 1..1 of 3 it draws from"


def test_impossible_batch_arithmetic():
    cfg = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", ["batch.prompts_per_step=3"])
    with pytest.raises(ConfigError, match="do not split over 2 processes|micro_batch_size"):
        derive_layout(cfg, 2)


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_trained_transitions_matches_dancegrpo():
    assert trained_transitions(16, 0.6) == 9  # 9 of 15 (DanceGRPO train_grpo_flux.py: floor((N-1)·fraction))
    assert trained_transitions(12, 0.6) == 6


@pytest.mark.parametrize("ds_path", DS_CONFIGS, ids=lambda p: p.name)
def test_ds_configs_are_stage3_and_get_batch_fields(ds_path):
    cfg = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml")
    lay = derive_layout(cfg, 2)
    ds = load_ds_config(str(ds_path), cfg, lay)
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["train_batch_size"] == lay.ds_train_batch_size
    assert ds["gradient_accumulation_steps"] == lay.grad_accum_steps
    assert ds["gradient_clipping"] == cfg.optim.max_grad_norm


def test_ds_config_with_batch_fields_is_rejected(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 8}))
    cfg = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml")
    with pytest.raises(ConfigError, match="sets train_batch_size; remove it"):
        load_ds_config(str(p), cfg, derive_layout(cfg, 1))


@pytest.mark.parametrize("value", ["6", "128", "-8"])
def test_rollout_micro_batch_must_be_a_dividing_multiple_of_the_update_micro_batch(value):
    # tiny preset: micro-batch 8, 32 images per process on 2 processes; -8 is refused by load_config already
    with pytest.raises(ConfigError, match="^batch.rollout_micro_batch_size: "):
        cfg = load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", [f"batch.rollout_micro_batch_size={value}"])
        derive_layout(cfg, 2)
    assert derive_layout(load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml",
                                     ["batch.rollout_micro_batch_size=16"]), 2).rollout_micro_batch_size == 16


def test_a_preset_missing_a_required_key_names_it_and_its_help(tmp_path):
    shutil.copytree(ROOT / "recipes/configs", tmp_path / "configs")  # its extends reach shared.yaml, objectives/
    base = tmp_path / "configs/tiny/base.yaml"
    base.write_text(base.read_text().replace("  eta: 0.7", "  # eta removed"))
    preset = tmp_path / "configs/tiny/p.yaml"
    preset.write_text((ROOT / "recipes/configs/tiny/grpo_lora.yaml").read_text())  # extends: [base.yaml, ...]
    with pytest.raises(ConfigError) as e:
        load_config(preset)
    assert str(e.value).startswith(f"sampling.eta: missing from {preset}; add it (SDE noise")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override, needle", [
    ("optim.lr=inf", "optim.lr: must be a finite number, got inf"),
    ("optim.lr=.inf", "optim.lr: must be a finite number, got inf"),
    ("sampling.eta=.nan", "sampling.eta: must be a finite number, got nan"),
    ("optim.lr='1e-4'", "optim.lr: expected a number, got '1e-4'"),
    ("optim.betas=[0.9, 1.0]", "optim.betas: expected two numbers in [0, 1)"),
    ("optim.betas=[-0.1, 0.9]", "optim.betas: expected two numbers in [0, 1)"),
])
def test_non_finite_and_out_of_range_numbers_are_refused(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", [override])
    assert str(e.value).startswith(needle) and "\n" not in str(e.value)


def test_exponent_without_dot_is_a_number():
    assert load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", ["optim.lr=1e-4"]).optim.lr == 1e-4


def test_duplicate_yaml_key_is_refused_with_its_line(tmp_path):
    preset = tmp_path / "dup.yaml"
    text = (ROOT / "recipes/configs/tiny/base.yaml").read_text()  # refused before its extends chain is read
    preset.write_text(text.replace("  eta: 0.7", "  eta: 0.7\n  eta: 0.3"))
    line = text.splitlines().index("  eta: 0.7                        # more exploration than FLUX.1-dev's 0.3: 6 "
                                   "steps only") + 1
    with pytest.raises(ConfigError) as e:
        load_config(preset)
    assert str(e.value) == f"config: {preset} line {line + 1}: key 'eta' is already set at line {line}; keep one"


def test_non_utf8_config_is_one_line(tmp_path):
    preset = tmp_path / "latin1.yaml"
    preset.write_bytes("output_dir: runs/caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"^config: .*latin1.yaml is not UTF-8 text \(byte 20\); save it as UTF-8$"):
        load_config(preset)


def test_lora_switch_on_a_full_preset_fills_the_documented_lora_keys():
    from grpo.config import LORA_SWITCH_DEFAULTS

    lora = load_config(ROOT / "recipes/configs/tiny/grpo_full.yaml", ["lora.rank=16"]).lora
    assert lora.rank == 16 and lora.alpha == LORA_SWITCH_DEFAULTS["alpha"]
    assert lora.target_modules == LORA_SWITCH_DEFAULTS["target_modules"]
    with pytest.raises(ConfigError, match="^lora.rank: missing from"):
        load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", ["lora={alpha: 2, init: gaussian, "
                                                                   "target_modules: [to_q]}"])


def test_resume_rules_and_paths_come_from_the_schema():
    from grpo.config import is_path, resume_free

    assert resume_free("logging.eval_every") and resume_free("checkpoint") and resume_free("model.zero_init")
    assert not resume_free("optim.lr") and not resume_free("rewards.hpsv2.weight") and not resume_free("lora")
    assert not resume_free("no_such.key")
    assert is_path("model.path") and is_path("deepspeed.config") and not is_path("model.dtype")


def test_help_lists_every_setting_with_its_help(capsys):
    import dataclasses

    from grpo.config import RecipeConfig
    from tools.check import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for section in dataclasses.fields(RecipeConfig):
        assert f"  {section.name} (" in out
    assert "  sampling.eta (float; required): SDE noise" in out
    assert "  ema.decay (float or null; default null): " in out
    assert "  logging.eval_every (int; required): " in out and "[may change on resume]" in out
    assert "\n  hpsv2: HPS" in out and "    version (v2.0 | v2.1; default v2.1): " in out


MIX = "sampling.window={placement: progressive, size: 2, shift_every: 4, stride: 1}"


@pytest.mark.parametrize("overrides,match", [
    ([MIX, "grpo.timestep_fraction=0.6"], "grpo.timestep_fraction: 0.6 with sampling.window"),
    (["sampling.window={placement: progressive, size: 5, shift_every: 4, stride: 1}"], r"window.size: 5; use 1 \.\. "),
    (["sampling.window={placement: progressive, size: 2, stride: 1}"], "window.shift_every: required with placement"),
    (["sampling.window={placement: random, size: 2, high: 3, stride: 1}"], "window.stride: not read by placement random"),
    (["sampling.window={placement: random, size: 2, high: 6}"], "window.high: 6; use size"),
    (["sampling.window={placement: sideways, size: 2}"], "sampling.window.placement"),
    (["sampling.tail=dpm2", "sampling.compress_ratio=0.5"], "dpm2 replaces the steps after an SDE window"),
    ([MIX, "sampling.tail=dpm2"], "sampling.compress_ratio: None; dpm2 needs"),
    ([MIX, "sampling.tail=dpm2", "sampling.compress_ratio=0.5", "sampling.shift=dynamic"], "static schedule"),
    (["sampling.compress_ratio=0.5"], "only for sampling.tail: dpm2"),
    (["grpo.ratio_norm=true"], "ratio_norm: true needs sampling.sde: flow"),
    (["sampling.sde=cps", "sampling.eta=1.5"], "above 1, the largest CPS noise level"),
])
def test_strategy_settings_refused_with_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", overrides)


def test_ode_rollouts_take_a_dpm2_tail_without_a_window():
    """nft/awm have no SDE window; their tail: dpm2 replaces the ODE rollout's steps after the first."""
    for preset in ("nft_lora.yaml", "awm_lora.yaml"):
        cfg = load_config(ROOT / "recipes/configs/tiny" / preset, ["sampling.tail=dpm2", "sampling.compress_ratio=0.5"])
        assert cfg.sampling.window is None and cfg.sampling.tail == "dpm2"
    with pytest.raises(ConfigError, match="sampling.compress_ratio: None; dpm2 needs"):
        load_config(ROOT / "recipes/configs/tiny/nft_lora.yaml", ["sampling.tail=dpm2"])


def test_a_window_trains_its_steps():
    cfg = load_config(ROOT / "recipes/configs/tiny/mixgrpo_lora.yaml")
    lay = derive_layout(cfg, 2)
    assert lay.trained_transitions == 2 and lay.grad_accum_steps == lay.micro_batches_per_update * 2


def _schema_keys(cls, prefix: str = "") -> set[str]:
    """Every dotted setting of a schema class, sections included."""
    import dataclasses
    import typing

    from grpo.schema import _is_section, _split_optional

    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        out.add(key)
        inner, _ = _split_optional(hints[f.name])
        if _is_section(inner):
            out |= _schema_keys(inner, key + ".")
    return out


def _yaml_keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict) and k != "rewards":
            out |= _yaml_keys(v, prefix + k + ".")
    return out


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.parent.name + "/" + p.name)
def test_every_preset_lists_every_setting(preset):
    """Copy-and-edit presets show everything they use: every schema key is written out (a section set to null, such
    as lora: null or sampling.window: null, stands for its keys; profile's details are needed only with profile.steps,
    and a window's placement and an objective use only their own keys)."""
    from grpo.config import RecipeConfig
    from grpo.objectives import OBJECTIVES
    from grpo.schema import read_preset

    raw = read_preset(preset)  # the extends chain merged: what the run uses
    if not _tiny(preset):
        raw["data"].update(train_prompts="given on the command line", eval_prompts="given on the command line")
    written = _yaml_keys(raw)
    nulls = {k for k in written if _lookup(raw, k) is None}
    unused = set()  # keys the preset cannot rely on: profiling's details while it is off, the other window placement
    if raw["profile"]["steps"] == []:
        unused |= {k for k in _schema_keys(RecipeConfig) if k.startswith("profile.")} - {"profile.steps"}
    window = raw["sampling"]["window"]
    if window is not None:
        other = ("high",) if window["placement"] == "progressive" else ("shift_every", "stride")
        unused |= {f"sampling.window.{k}" for k in other}
    others = set(OBJECTIVES) - {raw["algorithm"]}  # the other objectives' sections are absent
    unused |= {k for k in _schema_keys(RecipeConfig) if k.split(".")[0] in others}
    missing = {k for k in _schema_keys(RecipeConfig) - written - unused
               if not any(k.startswith(n + ".") for n in nulls)}
    assert not missing, f"{preset.name} does not list {sorted(missing)}"


def _lookup(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def test_every_preset_asks_for_deterministic_kernels():
    for preset in PRESETS:
        assert load_config(preset, _prompts(preset)).model.deterministic is True, preset
    assert load_config(PRESETS[0], [*_prompts(PRESETS[0]), "model.deterministic=false"]).model.deterministic is False


@pytest.mark.parametrize("preset, overrides, message", [
    ("tiny_flux2/grpo_lora.yaml", ["sampling.true_cfg.scale=1.0"],
     "sampling.true_cfg.scale: 1.0 is no guidance (the pipelines guide only above 1); use e.g. 4.0 "
     "(Flux2KleinPipeline's default), or sampling.true_cfg=null for off"),
    ("tiny_flux2/nft_lora.yaml", ["sampling.true_cfg.scale=4.0"],
     "sampling.true_cfg.train: nft with true CFG trains either velocity; set sampling.true_cfg.train=conditional "
     "(the conditional branch on guided samples; AWM's train.cfg False) or guided (neg + scale*(cond - neg), AWM's "
     "train.cfg True)"),
    ("tiny_flux2/grpo_lora.yaml", ["sampling.true_cfg.scale=4.0", "sampling.true_cfg.train=conditional"],
     "sampling.true_cfg.train: conditional, but grpo's ratio is between log-probs of the guided transition the "
     "rollout sampled; set sampling.true_cfg.train=guided (or null)"),
    ("tiny_flux2/grpo_lora.yaml", ["sampling.eval_cfg_scale=0.5"],
     "sampling.eval_cfg_scale: 0.5; use 1.0 (evals without CFG), a scale above 1 (e.g. 4.0, Flux2KleinPipeline's "
     "default), or null (the rollouts' true CFG)"),
])
def test_true_cfg_refuses_what_it_cannot_do(preset, overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "recipes/configs" / preset, overrides)
    assert str(e.value) == message


def test_true_cfg_is_refused_on_a_guidance_distilled_model():
    """FLUX.1-dev, Kontext and FLUX.2 [dev] keep their guidance embedding; true CFG on them is refused (see
    grpo.inputs.check_guidance for what their pipelines allow)."""
    from grpo.inputs import check_guidance
    from tests import TINY, TINY_FLUX2

    check_guidance(str(TINY_FLUX2), 1.0, true_cfg=True)
    with pytest.raises(ConfigError, match=r"^sampling.true_cfg: .* is guidance-distilled .* set "
                                          r"sampling.true_cfg=null and sampling.eval_cfg_scale=null$"):
        check_guidance(str(TINY), 3.5, true_cfg=True)


def test_a_checkpoint_from_before_true_cfg_resumes_only_with_it_off():
    """sampling.true_cfg is a section, null = off: a checkpoint written before it existed resumes with it off, and
    is refused with it on (the guided run is another run)."""
    from grpo.compat import config_differences
    from grpo.config import to_dict

    preset = ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml"
    before = to_dict(load_config(preset))
    del before["sampling"]["true_cfg"]
    assert config_differences(before, to_dict(load_config(preset))) == []
    on = config_differences(before, to_dict(load_config(preset, ["sampling.true_cfg.scale=4.0"])))
    assert on == ["sampling.true_cfg.negative_prompt='<unset>' in the checkpoint, '' now",
                  "sampling.true_cfg.scale='<unset>' in the checkpoint, 4.0 now"], on
    # and one guided before train and eval_cfg_scale existed resumes as it ran: guided, evals at the rollouts' CFG
    guided = to_dict(load_config(preset, ["sampling.true_cfg.scale=4.0"]))
    del guided["sampling"]["true_cfg"]["train"], guided["sampling"]["eval_cfg_scale"]
    assert config_differences(guided, to_dict(load_config(preset, ["sampling.true_cfg.scale=4.0"]))) == []
