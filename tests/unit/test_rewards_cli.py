"""`python -m tools.rewards` (run in-process through main())."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from grpo.rewards import REGISTRY, build_rewards
from tools.rewards import main

from tests.unit.reward_inputs import PROMPTS, images


@pytest.fixture
def image_dir(tmp_path):
    # Three 64x64 images and one 48x80: the CLI batches images of one size together.
    pictures = list(images(3, 64, 64, seed=2)) + [images(1, 48, 80, seed=4)[0]]
    folder = tmp_path / "imgs"
    folder.mkdir()
    tensors = []
    for i, img in enumerate(pictures):
        u8 = (img * 255).round().to(torch.uint8)
        Image.fromarray(u8.permute(1, 2, 0).numpy()).save(folder / f"img{i}.png")
        tensors.append(u8.float() / 255)
    return folder, tensors


def test_list(capsys) -> None:
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in REGISTRY:
        assert f"\n{name}: " in "\n" + out
    assert "logit_scale (bool; default false): " in out


def test_score_prints_scores_and_mean(image_dir, tiny_reward_spec, tmp_path, capsys) -> None:
    folder, tensors = image_dir
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:4]) + "\n")
    spec = tiny_reward_spec["hpsv2"]
    argv = ["score", "--reward", "hpsv2", "--images", str(folder), "--prompts", str(prompts), "--device", "cpu"]
    for key in ("repo", "model", "model_config"):
        argv += ["--option", f"{key}={spec[key]}"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines[:4]] == [f"img{i}.png" for i in range(4)]
    printed = torch.tensor([float(line.split("\t")[1]) for line in lines[:4]])
    reward = build_rewards({"hpsv2": spec}, "cpu")["hpsv2"]
    expected = torch.cat([reward(t[None], [p]) for t, p in zip(tensors, PROMPTS[:4])])
    torch.testing.assert_close(printed, expected, atol=2e-6, rtol=0)
    assert lines[4].startswith(f"mean\t{expected.mean().item():.6f}\t(4 images)")


def test_score_errors(image_dir, tmp_path, capsys) -> None:
    folder, _ = image_dir
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    assert main(["score", "--reward", "jpeg_compressibility", "--images", str(folder), "--prompts", str(prompts)]) == 2
    assert "has 2 prompts for 4 images" in capsys.readouterr().err
    assert main(["score", "--reward", "hps", "--images", str(folder), "--prompts", str(prompts)]) == 2
    assert "unknown reward 'hps'; valid names: hpsv2" in capsys.readouterr().err
    prompts.write_text("one prompt for all\n")
    assert main(["score", "--reward", "jpeg_compressibility", "--option", "quality=50", "--images", str(folder),
                 "--prompts", str(prompts)]) == 0
