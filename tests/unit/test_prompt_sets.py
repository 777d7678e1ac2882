"""Prompt datasets with per-sample metadata (grpo/prompt_sets.py) and the rewards that read it: each format reads the
same rows, every bad row fails with one line naming the file and the row, metadata reaches the rewards (in-process,
remote, custom), and tiny_world_meta scores from metadata exactly what tiny_world scores from the prompt text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpo.errors import ConfigError
from grpo.prompt_sets import read_prompt_file, read_prompt_set
from grpo.rewards import build_rewards, check_reward_metadata
from grpo.tiny import world
from tests import ROOT

PROMPTS_DIR = ROOT / "assets" / "prompts"
SETTING = "data.train_prompts"


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _png(path: Path) -> Path:
    from PIL import Image

    Image.new("RGB", (4, 4), (255, 0, 0)).save(path)
    return path


@pytest.fixture
def rows(tmp_path):
    """Three rows with metadata, one with an image and one with two, as written to each format."""
    (tmp_path / "img").mkdir()
    _png(tmp_path / "img" / "a.png")
    _png(tmp_path / "img" / "b.png")
    return [
        {"prompt": "a red circle on a blue background", "color": "red", "shape": "circle", "background": "blue"},
        {"prompt": "a cat", "image": "img/a.png", "tags": ["x", "y"], "score": 0.5},
        {"prompt": "a dog", "images": ["img/a.png", "img/b.png"], "nested": {"k": 1}},
    ]


def _expected_metadata(tmp_path: Path) -> list[dict]:
    a, b = (str((tmp_path / "img" / n).resolve()) for n in ("a.png", "b.png"))
    return [{"color": "red", "shape": "circle", "background": "blue"},
            {"image": a, "tags": ["x", "y"], "score": 0.5},
            {"images": [a, b], "nested": {"k": 1}}]


def test_text_files_read_as_before():
    path = PROMPTS_DIR / "tiny_train.txt"
    got = read_prompt_set(path)
    assert got.prompts == read_prompt_file(path) == world.split_prompts()[0]
    assert got.metadata == [{}] * len(got) and got.rows[0] == "line 1"


def test_jsonl_rows_carry_their_metadata_and_absolute_image_paths(tmp_path, rows):
    got = read_prompt_set(_write_jsonl(tmp_path / "d.jsonl", [rows[0], "", rows[1], rows[2]]))
    assert got.prompts == [r["prompt"] for r in rows]
    assert got.metadata == _expected_metadata(tmp_path)
    assert got.rows == ["line 1", "line 3", "line 4"]  # the blank line holds no row and is not counted as one


def test_parquet_and_a_datasets_folder_read_the_same_rows(tmp_path, rows):
    import datasets

    # A table has every column in every row: what a row leaves out is null there (no image, for an image column).
    columns = sorted({k for r in rows for k in r})
    table = datasets.Dataset.from_list([{k: r.get(k) for k in columns} for r in rows])
    table.to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "data").mkdir()  # the folder's image paths are relative to the folder itself
    table.save_to_disk(str(tmp_path / "data" / "folder"))
    (tmp_path / "data" / "folder" / "img").symlink_to(tmp_path / "img")
    expected = [{k: m.get(k) for k in columns if k != "prompt"} for m in _expected_metadata(tmp_path)]
    for source in (tmp_path / "d.parquet", tmp_path / "data" / "folder"):
        got = read_prompt_set(source)
        assert got.prompts == [r["prompt"] for r in rows], source
        assert got.rows == ["row 0", "row 1", "row 2"]
        assert got.metadata == expected, source


def test_a_datasets_folder_of_one_split_is_read_and_of_two_refused(tmp_path, rows):
    import datasets

    one = datasets.DatasetDict({"train": datasets.Dataset.from_list([rows[0]])})
    one.save_to_disk(str(tmp_path / "one"))
    assert read_prompt_set(tmp_path / "one").prompts == [rows[0]["prompt"]]
    two = datasets.DatasetDict({"train": datasets.Dataset.from_list([rows[0]]),
                                "test": datasets.Dataset.from_list([rows[0]])})
    two.save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ConfigError, match="holds the splits train, test; save the one"):
        read_prompt_set(tmp_path / "two")


def _bad_cases(tmp: Path) -> list[tuple[str, Path, str]]:
    """(name, dataset, what the line must say after the file)."""
    import datasets

    good = {"prompt": "a cat"}
    (tmp / "broken.png").write_bytes(b"not an image at all")
    cases = [
        ("no prompt", _write_jsonl(tmp / "noprompt.jsonl", [good, {"caption": "a dog"}]), "line 2 has no \"prompt\""),
        ("empty prompt", _write_jsonl(tmp / "empty.jsonl", [good, good, {"prompt": "  "}]), "line 3 has an empty"),
        ("prompt not text", _write_jsonl(tmp / "num.jsonl", [{"prompt": 3}]), "line 1 has an empty prompt (3)"),
        ("invalid JSON", _write_jsonl(tmp / "json.jsonl", [good, "{\"prompt\": "]), "line 2 is not valid JSON"),
        ("not an object", _write_jsonl(tmp / "list.jsonl", ["[1, 2]"]), "line 1 is not a JSON object"),
        ("missing image", _write_jsonl(tmp / "img.jsonl", [{"prompt": "a", "image": "nope.png"}]),
         "line 1: image nope.png does not exist"),
        ("unreadable image", _write_jsonl(tmp / "bad_img.jsonl", [good, {"prompt": "a", "images": ["broken.png"]}]),
         "line 2: image broken.png cannot be read as an image"),
        ("image not a path", _write_jsonl(tmp / "img_num.jsonl", [{"prompt": "a", "image": 7}]),
         "line 1: image must be a path"),
        ("no rows", _write_jsonl(tmp / "none.jsonl", [""]), "holds no rows"),
    ]
    datasets.Dataset.from_list([{"caption": "a cat"}]).to_parquet(str(tmp / "nocol.parquet"))
    datasets.Dataset.from_list([good, {"prompt": ""}]).to_parquet(str(tmp / "empty.parquet"))
    datasets.Dataset.from_list([good, {"prompt": None}]).save_to_disk(str(tmp / "none_folder"))
    (tmp / "garbled.parquet").write_bytes(b"PAR1 garbage")
    (tmp / "not_a_dataset").mkdir()
    cases += [
        ("no prompt column", tmp / "nocol.parquet", "has no 'prompt' column (columns: caption)"),
        ("empty prompt in parquet", tmp / "empty.parquet", "row 1 has an empty prompt"),
        ("null prompt in a folder", tmp / "none_folder", "row 1 has no \"prompt\""),
        ("garbled parquet", tmp / "garbled.parquet", "cannot be read as Parquet"),
        ("a folder that is no dataset", tmp / "not_a_dataset", "is a folder but not a datasets save_to_disk folder"),
    ]
    return cases


def test_each_bad_row_fails_with_one_line_naming_the_file_and_row(tmp_path):
    failures = []
    for name, source, says in _bad_cases(tmp_path):
        try:
            read_prompt_set(source, SETTING)
            failures.append(f"{name}: no error")
            continue
        except ConfigError as e:
            line = str(e)
        ok = line.startswith(f"{SETTING}: {source}") and says in line and "\n" not in line and len(line) < 400
        if not ok:
            failures.append(f"{name}: {line!r}")
    assert not failures, "\n".join(failures)


def test_a_hub_id_is_refused_offline_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as e:
        read_prompt_set("someone/prompts", SETTING)
    assert str(e.value).startswith(f"{SETTING}: someone/prompts is no local file") and "HF_HUB_OFFLINE" in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):  # a mistyped text file is not taken for a hub id
        read_prompt_set("prompts/typo.txt", SETTING)


def test_the_tiny_jsonl_files_are_the_worlds_own():
    for name, text in world.prompt_files().items():
        assert (PROMPTS_DIR / name).read_text() == text, (
            f"{name}: regenerate with python -m maintainer.tiny_worlds.prompts")
    for split, prompts in zip(("train", "heldout"), world.split_prompts()):
        rows = read_prompt_set(PROMPTS_DIR / f"tiny_{split}.jsonl")
        assert rows.prompts == prompts
        assert [world.scene(m) for m in rows.metadata] == [world.parse(p) for p in prompts]


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_tiny_world_meta_equals_tiny_world_on_the_worlds_prompts(split):
    rows = read_prompt_set(PROMPTS_DIR / f"tiny_{split}.jsonl")
    rewards = build_rewards({"tiny_world": 1.0, "tiny_world_meta": 1.0}, "cpu")
    gen = torch.Generator().manual_seed(7)
    # rendered ground truth, a render of another prompt (a mismatch) and noise: high, middling and low scores
    rendered = world.render(rows.prompts, 64, gen)
    shuffled = world.render(rows.prompts[1:] + rows.prompts[:1], 64, gen)
    noise = torch.rand(len(rows), 3, 64, 64, generator=gen)
    for images in (rendered, shuffled, noise):
        scores = rewards(images, rows.prompts, rows.metadata)
        assert torch.equal(scores[:, 0], scores[:, 1])
        assert torch.equal(scores[:, 0], world.score(images, rows.prompts))
    assert rewards(rendered, rows.prompts, rows.metadata)[:, 1].mean() > 0.9


def test_tiny_world_meta_reads_metadata_not_the_prompt():
    reward = build_rewards({"tiny_world_meta": 1.0}, "cpu")["tiny_world_meta"]
    image = world.render(["a red circle on a blue background"], 64, torch.Generator().manual_seed(0))
    meta = world.record("a red circle on a blue background")
    del meta["prompt"]
    good = reward(image, ["anything at all"], [meta])
    wrong = reward(image, ["a red circle on a blue background"], [{**meta, "color": "green"}])
    assert good.item() > 0.9 and wrong.item() < good.item() - 0.2


def test_a_text_dataset_fails_the_metadata_reward_at_start_up_naming_the_row():
    rows = read_prompt_set(PROMPTS_DIR / "tiny_train.txt")
    source = str(PROMPTS_DIR / "tiny_train.txt")
    with pytest.raises(ConfigError) as e:
        check_reward_metadata({"tiny_world_meta": 1.0}, rows, SETTING, source)
    line = str(e.value)
    assert line.startswith(f"{SETTING}: {source} line 1 has no 'color', 'shape', 'background'") and "\n" not in line
    assert "rewards.tiny_world_meta" in line
    check_reward_metadata({"tiny_world": 1.0, "jpeg_compressibility": 1.0}, rows, SETTING, source)  # read none


def test_a_row_naming_a_scene_outside_the_world_fails_at_start_up(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [world.record("a red circle on a blue background"),
                                               {"prompt": "x", "color": "red", "shape": "hexagon", "background": "blue"}])
    with pytest.raises(ConfigError, match=r"d.jsonl line 2 has the scene .*hexagon.* not one of the tiny world"):
        check_reward_metadata({"tiny_world_meta": 1.0}, read_prompt_set(path), SETTING, str(path))


def seen_metadata():
    """A custom reward that scores each image by its metadata's `value` (shows what reached it)."""

    def score(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        return torch.tensor([float(m.get("value", -1)) for m in metadata])

    return score


def prompts_only():
    """A custom reward written before metadata existed: (images, prompts) only."""
    return lambda images, prompts: torch.ones(len(prompts))


def test_metadata_reaches_custom_rewards_and_old_ones_still_score():
    rewards = build_rewards({"tests.unit.test_prompt_sets:seen_metadata": {"weight": 1.0, "batch_size": 2},
                             "tests.unit.test_prompt_sets:prompts_only": 1.0, "tiny_world": 1.0}, "cpu")
    images = torch.rand(3, 3, 16, 16)
    prompts = world.all_prompts()[:3]
    got = rewards(images, prompts, [{"value": 1}, {"value": 2}, {"value": 3}])
    assert got[:, 0].tolist() == [1.0, 2.0, 3.0] and got[:, 1].tolist() == [1.0, 1.0, 1.0]
    without = rewards(images, prompts)  # the callers of before: no metadata, every sample an empty dict
    assert without[:, 0].tolist() == [-1.0] * 3 and torch.equal(without[:, 2], got[:, 2])
    with pytest.raises(ValueError, match="2 metadata rows for 3 images"):
        rewards(images, prompts, [{}, {}])


def test_remote_requests_carry_metadata_and_old_bodies_still_decode():
    from grpo.rewards.remote import decode_images, decode_request, encode_images
    from grpo.rewards.service import Batcher

    images = torch.zeros(2, 3, 8, 8, dtype=torch.uint8)
    meta = [{"value": 4, "tags": ["a"]}, {"value": 5}]
    assert decode_request(encode_images(images, ["a", "b"], meta))[2] == meta
    assert decode_request(encode_images(images, ["a", "b"]))[2] == [{}, {}]  # a client of before
    assert decode_images(encode_images(images, ["a", "b"], meta))[1] == ["a", "b"]
    with pytest.raises(ValueError, match="2 JSON objects"):
        decode_request(encode_images(images, ["a", "b"], [{}]))
    batcher = Batcher(build_rewards({"tests.unit.test_prompt_sets:seen_metadata": 1.0}, "cpu"))
    try:
        name = "tests.unit.test_prompt_sets:seen_metadata"
        assert batcher.submit(name, images, ["a", "b"], meta).result(timeout=30).tolist() == [4.0, 5.0]
        assert batcher.submit(name, images, ["a", "b"]).result(timeout=30).tolist() == [-1.0, -1.0]
    finally:
        batcher.close()


def test_the_cache_takes_metadata_from_the_dataset_not_the_file(tmp_path):
    from grpo.prompts import PromptCache, load_cache, save_cache

    rows = read_prompt_set(PROMPTS_DIR / "tiny_heldout.jsonl")
    path = tmp_path / "c.safetensors"
    save_cache(PromptCache(rows.prompts, {"prompt_embeds": torch.zeros(len(rows), 2, 3)}), path)
    assert load_cache(path).metadata == [{}] * len(rows)
    assert load_cache(path, rows).metadata == rows.metadata
    edited = read_prompt_set(PROMPTS_DIR / "tiny_heldout.jsonl")
    edited.metadata[0] = {**edited.metadata[0], "note": "changed"}
    assert load_cache(path, edited).metadata[0]["note"] == "changed"  # never stale: read with the dataset
    with pytest.raises(RuntimeError, match="other prompts"):
        load_cache(path, read_prompt_set(PROMPTS_DIR / "tiny_train.jsonl"))
