"""Start-up checks of a rewards spec (check_rewards): names, options, missing files, hub cache, offline."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

from grpo.errors import ConfigError
from grpo.rewards import REGISTRY, build_rewards, check_rewards, normalize_spec

from tests.unit.reward_inputs import images, make_brightness


def test_tiny_spec_passes(tiny_reward_spec) -> None:
    check_rewards(tiny_reward_spec)


def test_shorthand_weight() -> None:
    assert normalize_spec({"jpeg_compressibility": 2, "tiny_world": None}) == {
        "jpeg_compressibility": {"weight": 2.0}, "tiny_world": {}}
    check_rewards({"jpeg_compressibility": 0.5, "tiny_world": {"weight": 1}})


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as err:
        check_rewards({"hps": 1.0})
    msg = str(err.value)
    assert msg.startswith("rewards.hps: unknown reward 'hps'")
    assert all(name in msg for name in REGISTRY)
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ({"jpeg_compressibility": {"qualty": 90}}, r"rewards\.jpeg_compressibility\.qualty: unknown setting; "
                                                   r"valid keys under rewards\.jpeg_compressibility: weight, "
                                                   r"batch_size, quality"),
        ({"jpeg_compressibility": {"quality": "high"}}, r"rewards\.jpeg_compressibility\.quality: expected an integer"),
        ({"jpeg_compressibility": {"quality": 101}}, r"quality: 101 outside 1-95"),
        ({"jpeg_compressibility": {"weight": "1"}}, r"\.weight: expected a number"),
        ({"jpeg_compressibility": {"weight": float("nan")}}, r"\.weight: must be a finite number"),
        ({"jpeg_compressibility": {"batch_size": 0}}, r"\.batch_size: must be >= 1"),
        ({"hpsv2": {"dtype": "float64"}}, r"rewards\.hpsv2\.dtype: 'float64' is not one of"),
        ({"hpsv2": {"device": "cuda:3"}}, r"rewards\.hpsv2\.device: 'cuda:3' is not one of 'cpu'"),
        ({"hpsv2": {"offload": "yes"}}, r"rewards\.hpsv2\.offload: expected true or false"),
        ({"hpsv2": {"version": "v3"}}, r"rewards\.hpsv2\.version: 'v3' is not one of 'v2.0', 'v2.1'"),
        ({"hpsv2": {"model": "ViT-Q-99"}}, r"rewards\.hpsv2\.model: unknown open_clip architecture 'ViT-Q-99'"),
        ({"clip_score": {"pretrained": "no_such_tag"}}, r"'no_such_tag' is not an open_clip tag of ViT-H-14 \(tags: "
                                                        r".*laion2b_s32b_b79k"),
        ({"pickscore": {"logit_scale": 1}}, r"rewards\.pickscore\.logit_scale: expected true or false"),
        ({"pickscore": [1.0]}, r"rewards\.pickscore: expected a weight or a map of options"),
        ({}, r"rewards: expected a non-empty map"),
    ],
)
def test_bad_options(spec, pattern) -> None:
    with pytest.raises(ConfigError, match=pattern) as err:
        check_rewards(spec)
    assert "\n" not in str(err.value)


def test_missing_local_file_names_file_folder_and_command(tiny_reward_spec) -> None:
    spec = {"hpsv2": {**tiny_reward_spec["hpsv2"], "version": "v2.0"}}  # only v2.1 was written
    folder = tiny_reward_spec["hpsv2"]["repo"]
    with pytest.raises(ConfigError) as err:
        check_rewards(spec)
    assert str(err.value) == (
        f"rewards.hpsv2.repo: HPS_v2_compressed.pt not found in local folder {folder}; get it with "
        f"`hf download xswu/HPSv2 HPS_v2_compressed.pt --local-dir {folder}`"
    )


def test_missing_folder_of_each_model_reward(tiny_reward_spec, tmp_path) -> None:
    gone = str(tmp_path / "nowhere")
    cases = {
        "pickscore": ("model", "config.json", "yuvalkirstain/PickScore_v1"),
        "clip_score": ("pretrained", "open_clip_config.json", "ORG/NAME"),
        "aesthetic": ("mlp_repo", "sac+logos+ava1-l14-linearMSE.pth", "camenduru/improved-aesthetic-predictor"),
    }
    for name, (option, filename, hint) in cases.items():
        spec = {name: {**tiny_reward_spec[name], option: gone}}
        with pytest.raises(ConfigError) as err:
            check_rewards(spec)
        msg = str(err.value)
        assert msg.startswith(f"rewards.{name}.{option}: {filename}") and gone in msg and f"hf download {hint}" in msg


def test_hub_id_offline_not_cached(offline, tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        check_rewards({"hpsv2": {"cache_dir": str(tmp_path)}})
    msg = str(err.value)
    assert msg == (
        f"rewards.hpsv2.repo: HPS_v2.1_compressed.pt of hub repo xswu/HPSv2 is not in the Hugging Face cache "
        f"{tmp_path} and HF_HUB_OFFLINE is set; get it with `hf download xswu/HPSv2 HPS_v2.1_compressed.pt "
        f"--cache-dir {tmp_path}` (or `hf download xswu/HPSv2 HPS_v2.1_compressed.pt --local-dir DIR` and set "
        f"rewards.hpsv2.repo: DIR), or unset HF_HUB_OFFLINE"
    )


def test_default_presets_fail_offline_with_clear_messages(offline, tmp_path) -> None:
    # What a flux1_dev preset without local files hits at start-up on an offline cluster.
    expect = {
        "pickscore": "config.json of hub repo yuvalkirstain/PickScore_v1",
        "clip_score": "open_clip_model.safetensors or open_clip_pytorch_model.bin of hub repo "
                      "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        "aesthetic": "of hub repo timm/vit_large_patch14_clip_224.openai",
    }
    for name, text in expect.items():
        with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set") as err:
            check_rewards({name: {"cache_dir": str(tmp_path)}})
        assert text in str(err.value)


def _fake_hub_cache(cache: Path, repo: str, files: dict[str, Path]) -> None:
    """Lays files out as huggingface_hub's cache does (refs/main -> snapshots/<commit>/...)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = cache / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, src in files.items():
        shutil.copy(src, snap / name)


def test_hub_ids_load_from_cache_offline(tiny_reward_spec, offline, tmp_path) -> None:
    """Hub ids resolve through the Hugging Face cache (cache_dir) with HF_HUB_OFFLINE=1, for every file kind."""
    hps = Path(tiny_reward_spec["hpsv2"]["repo"])
    clip = Path(tiny_reward_spec["clip_score"]["pretrained"])
    mlp = Path(tiny_reward_spec["aesthetic"]["mlp_repo"])
    pick, proc = Path(tiny_reward_spec["pickscore"]["model"]), Path(tiny_reward_spec["pickscore"]["processor"])
    _fake_hub_cache(tmp_path, "xswu/HPSv2", {"HPS_v2.1_compressed.pt": hps / "HPS_v2.1_compressed.pt"})
    _fake_hub_cache(tmp_path, "test-org/tiny-clip", {p.name: p for p in clip.iterdir()})
    _fake_hub_cache(tmp_path, "test-org/aesthetic", {p.name: p for p in mlp.iterdir()})
    _fake_hub_cache(tmp_path, "test-org/pickscore", {p.name: p for p in pick.iterdir()})
    _fake_hub_cache(tmp_path, "test-org/processor", {p.name: p for p in proc.iterdir()})
    cache = {"cache_dir": str(tmp_path)}
    hub_spec = {
        "hpsv2": {**tiny_reward_spec["hpsv2"], **cache, "repo": "xswu/HPSv2"},
        "clip_score": {**cache, "pretrained": "hf-hub:test-org/tiny-clip"},
        "aesthetic": {**tiny_reward_spec["aesthetic"], **cache, "pretrained": "hf-hub:test-org/tiny-clip",
                      "mlp_repo": "test-org/aesthetic"},
        "pickscore": {**cache, "model": "test-org/pickscore", "processor": "test-org/processor"},
    }
    check_rewards(hub_spec)
    local_spec = {k: tiny_reward_spec[k] for k in hub_spec}
    x = images(3)
    prompts = ["a red circle on a blue background"] * 3
    torch.testing.assert_close(build_rewards(hub_spec, "cpu")(x, prompts), build_rewards(local_spec, "cpu")(x, prompts))


def test_custom_reward_by_dotted_path() -> None:
    target = f"{make_brightness.__module__}:make_brightness"
    with pytest.raises(ConfigError, match=r"options \['colour'\] do not fit"):
        check_rewards({target: {"colour": 1}})
    with pytest.raises(ConfigError, match="cannot import no_such_pkg"):
        check_rewards({"no_such_pkg.mod:factory": 1.0})
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        check_rewards({"grpo.rewards.programmatic:nope": 1.0})
    rewards = build_rewards({target: {"weight": 0.5, "scale": 2.0, "batch_size": 1}}, "cpu")
    x = images(3)
    torch.testing.assert_close(rewards(x, ["a", "b", "c"]), 2.0 * x.mean(dim=(1, 2, 3))[:, None])
    torch.testing.assert_close(rewards.weights, torch.tensor([0.5]))


def test_labelled_duplicate_rewards() -> None:
    spec = {"jpeg_incompressibility": 1.0, "jpeg_incompressibility@q50": {"weight": 0.5, "quality": 50}}
    rewards = build_rewards(copy.deepcopy(spec), "cpu")
    assert rewards.names == ["jpeg_incompressibility", "jpeg_incompressibility@q50"]
    torch.testing.assert_close(rewards.weights, torch.tensor([1.0, 0.5]))
    comps = rewards(images(2), ["a", "b"])
    assert (comps[:, 0] > comps[:, 1]).all()  # quality 95 files are bigger than quality 50 ones


PRESETS = sorted((Path(__file__).resolve().parents[2] / "recipes" / "configs" / "flux1_dev").glob("*.yaml"))


def _localize(spec: dict, root: Path) -> dict:
    """Points every hub file of `spec` at a local folder holding (empty) files of the expected names."""
    from grpo.rewards.hub import is_local
    from grpo.rewards.options import validate_options
    from grpo.rewards.registry import _entry

    spec = copy.deepcopy(normalize_spec(spec))
    for key, raw in spec.items():
        cls = _entry(key)
        for _ in range(3):  # a tag becomes a folder, which then also needs its open_clip_config.json
            options = validate_options(raw, cls.OPTIONS, f"rewards.{key}")
            for ref in cls.files(options, f"rewards.{key}"):
                option = ref.setting.rsplit(".", 1)[1]
                folder = Path(raw[option]) if is_local(ref.source) else root / key / option
                folder.mkdir(parents=True, exist_ok=True)
                (folder / ref.filenames[0]).touch()
                raw[option] = str(folder)
    return spec


@pytest.mark.skipif(not PRESETS, reason="no flux1_dev presets")
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_flux1_dev_presets_need_their_reward_files(preset, offline, tmp_path) -> None:
    from grpo.schema import read_preset

    rewards = read_preset(preset)["rewards"]  # an overlay's come from the base it extends
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set; get it with `hf download "):
        check_rewards({k: {**(v if isinstance(v, dict) else {"weight": v}), "cache_dir": str(tmp_path / "cache")}
                       for k, v in rewards.items()})
    check_rewards(_localize(rewards, tmp_path))  # passes once the files are local (not loaded: start-up check)
