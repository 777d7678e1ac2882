"""The vlm_judge reward against a local server process speaking the OpenAI chat completions API
(tests/recipe/judge_server.py: its answer depends on the image's pixels and the prompt)."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import requests
import torch

from grpo.errors import ConfigError
from grpo.rewards import build_rewards, check_rewards
from grpo.rewards.client import ServiceError
from grpo.rewards.vlm_judge import MalformedAnswer
from tools.launch import free_port

from tests import ROOT
from tests.unit.reward_inputs import images


@pytest.fixture(scope="module")
def judge_url():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tests.recipe.judge_server", "--port", str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                requests.get(f"{url}/models", timeout=1)
                break
            except requests.RequestException:
                assert server.poll() is None and time.monotonic() < deadline, "the judge server did not start"
                time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait()


def _judge(url: str, **options) -> dict:
    return {"vlm_judge": {"url": url, "model": "tiny-judge", "retries": 0, **options}}


def _expected(x: torch.Tensor, channels: list[int]) -> torch.Tensor:
    """The fixture judge's rule on the uint8 levels the reward sends: 10 x mean of one channel, 2 decimals."""
    u8 = (x * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return torch.tensor([float(f"{10 * np.asarray(a)[..., c].mean() / 255:.2f}") for a, c in zip(u8, channels)])


def test_scores_are_the_judges_parsed_answers(judge_url) -> None:
    x = images(5, 24, 40, seed=4)
    prompts = ["a red circle", "a green square", "a blue sky", "a cat on a green lawn", "a red fox"]
    reward = build_rewards(_judge(judge_url, concurrency=3, batch_size=2), "cpu")["vlm_judge"]
    torch.testing.assert_close(reward(x, prompts), _expected(x, [0, 1, 2, 1, 0]), atol=0, rtol=0)
    # The prompt reaches the judge through the template, the system message travels with it.
    custom = build_rewards(_judge(judge_url, template="Prompt: {prompt}. Rate it.", system="Be strict."), "cpu")
    torch.testing.assert_close(custom(x[:2], ["a blue car", "a green car"])[:, 0], _expected(x[:2], [2, 1]))


def test_malformed_answers(judge_url) -> None:
    x, prompts = images(3, 16, 16, seed=5), ["a red circle", "please ramble", "a blue sky"]
    strict = build_rewards(_judge(judge_url), "cpu")
    with pytest.raises(MalformedAnswer) as err:
        strict(x, prompts)
    msg = str(err.value)
    assert msg.startswith("rewards.vlm_judge: the judge answered 'What a lovely picture, I would give it a high "
                          "mark.', expected a whole answer matching 'Score: (-?\\\\d+(?:\\\\.\\\\d+)?)' with a score "
                          "in [0, 10]"), msg
    assert "\n" not in msg
    # A score outside [min_score, max_score] is malformed too.
    with pytest.raises(MalformedAnswer, match=r"with a score in \[0, 1\]"):
        build_rewards(_judge(judge_url, max_score=1.0), "cpu")(torch.ones(1, 3, 8, 8), ["a red circle"])
    lenient = build_rewards(_judge(judge_url, on_malformed="nan"), "cpu")(x, prompts)[:, 0]
    assert torch.isnan(lenient[1]) and torch.equal(lenient[[0, 2]], _expected(x[[0, 2]], [0, 2]))


def test_start_up_checks_and_request_errors(judge_url, monkeypatch) -> None:
    check_rewards(_judge(judge_url))
    with pytest.raises(ConfigError, match=r"^rewards\.vlm_judge\.model: .* serves tiny-judge, not 'qwen'; use its id"):
        check_rewards(_judge(judge_url, model="qwen"))
    down = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ConfigError, match=rf"^rewards\.vlm_judge\.url: no answer from {down}/models"):
        check_rewards(_judge(down))
    bad = [({"template": "Rate it."}, r"template: no \{prompt\} placeholder"),
           ({"template": "{prompt} as {0}"}, r"template: \{0\} is not a field name; name a field in braces"),
           ({"template": "{prompt} as {"}, r"template: Single '\{' encountered"),
           ({"answer": "Score: \\d+"}, r"answer: needs a group"),
           ({"answer": "Score: (\\d+"}, r"answer: not a regular expression"),
           ({"min_score": 5.0, "max_score": 1.0}, r"min_score: 5.0 must be below max_score 1.0"),
           ({"on_malformed": "skip"}, r"on_malformed"),
           ({"api_key_env": "GRPO_TEST_NO_SUCH_KEY"}, r"api_key_env: the environment variable GRPO_TEST_NO_SUCH_KEY")]
    monkeypatch.delenv("GRPO_TEST_NO_SUCH_KEY", raising=False)
    for options, pattern in bad:
        with pytest.raises(ConfigError, match=rf"^rewards\.vlm_judge\.{pattern}"):
            check_rewards(_judge(judge_url, **options))
    # A request the server refuses (HTTP 400) is not retried and ends in one line with the server's message.
    reward = build_rewards(_judge(judge_url, retries=3), "cpu")["vlm_judge"]
    reward.options = {**reward.options, "model": "other"}
    with pytest.raises(ServiceError, match=r"^rewards\.vlm_judge: .*/chat/completions failed after 1 attempt: HTTP "
                                           r"400: The model `other` does not exist\.$"):
        reward(images(1, 8, 8), ["a red circle"])


def test_dataset_fields_and_source_images_reach_the_judge(judge_url, tmp_path) -> None:
    """A template field is filled from each sample's dataset row (here it picks the channel the judge rates), and a
    row's source image goes before the image to rate (the fixture judge then rates their difference)."""
    from PIL import Image

    from grpo.prompt_sets import PromptSet
    from grpo.rewards.registry import check_reward_metadata

    sources, x = images(2, 16, 16, seed=6), images(2, 16, 16, seed=7)
    u8 = lambda t: (t * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()  # noqa: E731
    paths = []
    for i, pixels in enumerate(u8(sources)):
        paths.append(str(tmp_path / f"source{i}.png"))
        Image.fromarray(pixels).save(paths[-1])
    rows = [{"image": paths[0], "target": "green"}, {"image": paths[1], "target": "blue"}]
    prompts = ["make the cat red", "make the sky red"]  # "red" in the prompt: the field's colour comes first
    spec = _judge(judge_url, template="Is it {target} now? The edit was: {prompt}")
    got = build_rewards(spec, "cpu")["vlm_judge"](x, prompts, rows)
    change = [np.abs(u8(x)[i][..., c].astype(float) - u8(sources)[i][..., c]).mean() for i, c in enumerate((1, 2))]
    moved = torch.tensor([float(f"{10 * d / 255:.2f}") for d in change])
    torch.testing.assert_close(got, moved, atol=0, rtol=0)
    assert got[0] != _expected(x[:1], [1])[0]
    alone = build_rewards({"vlm_judge": {**spec["vlm_judge"], "source_images": False}}, "cpu")["vlm_judge"]
    torch.testing.assert_close(alone(x, prompts, rows), _expected(x, [1, 2]), atol=0, rtol=0)
    # Start-up: every row must carry the template's fields.
    check_reward_metadata(spec, PromptSet(prompts, rows, ["line 1", "line 2"]), "data.train_prompts", "edits.jsonl")
    with pytest.raises(ConfigError, match=r"^data\.train_prompts: edits\.jsonl line 2 has no 'target' \(template "
                                          r"fields\), which rewards\.vlm_judge reads"):
        check_reward_metadata(spec, PromptSet(prompts, [rows[0], {"image": paths[1]}], ["line 1", "line 2"]),
                              "data.train_prompts", "edits.jsonl")



# ------------------------------------------------------------------------ the reward recipes of docs/rewards.md
def _answer(x: torch.Tensor, channel: int = 0) -> list[str]:
    """The stand-in judge's answer to a text without colour words: "Score: S", S from the image's channel 0."""
    return [f"Score: {s:.2f}" for s in _expected(x, [channel] * len(x)).tolist()]


def test_unifiedreward_recipe_reads_the_alignment_score(judge_url) -> None:
    """docs/rewards.md's UnifiedReward block as written (template, answer pattern, 1-5 range), only the server and
    model swapped for the stand-in, whose answer to that template is UnifiedReward's three-line format."""
    from tests.unit.test_reward_recipes import recipe

    spec = {k: {**v, "url": judge_url, "model": "tiny-judge", "retries": 0} for k, v in recipe("unifiedreward").items()}
    check_rewards(spec)
    x = images(3, 24, 24, seed=6)
    scores = build_rewards(spec, "cpu")(x, ["a red fox", "a green field", "a blue car"], [{}] * 3)[:, 0]
    u8 = (x * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    expected = [float(f"{1 + 4 * a[..., c].mean() / 255:.2f}") for a, c in zip(u8, [0, 1, 2])]
    torch.testing.assert_close(scores, torch.tensor(expected), atol=0, rtol=0)


def test_ocr_recipe_scores_what_the_vlm_read_against_the_rows_text(judge_url) -> None:
    """docs/rewards.md's OCR block with a VLM reader: the stand-in reads "Score: S" off each image; the reward is
    Flow-GRPO's similarity of that to the row's text (exact, one edit away, absent)."""
    from recipes.rewards.ocr import similarity
    from tests.unit.test_reward_recipes import recipe

    spec = {k: {**v, "url": judge_url, "model": "tiny-judge", "retries": 0} for k, v in recipe("ocr-vlm").items()}
    check_rewards(spec)
    x = images(3, 24, 24, seed=7)
    read = _answer(x)
    rows = [{"text": read[0]}, {"text": "Score: 9.99"}, {}]
    scores = build_rewards(spec, "cpu")(x, ["a sign", "a poster", "a label"], rows)[:, 0]
    assert scores[0] == 1.0 and scores[1] == pytest.approx(similarity(read[1], "Score: 9.99")) and scores[1] < 1
    assert torch.isnan(scores[2])  # no target text: no score (the recipe skips that group)
