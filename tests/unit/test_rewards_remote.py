"""The reward server and the `remote` reward, in this process: a real uvicorn server on a free localhost port in a
thread, programmatic rewards (no model to load). The 2-process recipe step against a server process is in
tests/recipe/test_remote_reward.py."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import requests
import torch

from grpo.errors import EXIT_RETRY_LATER, ConfigError
from grpo.rewards import build_rewards, check_rewards
from grpo.rewards.client import ServiceDown, ServiceError
from grpo.rewards.remote import encode_images
from tools.launch import free_port

from tests import ROOT
from tests.unit.reward_inputs import PROMPTS, images

SERVED = {"jpeg_compressibility": 1.0, "jpeg_incompressibility": {"quality": 50},
          "tests.unit.test_rewards_remote:broken": 1.0}


def broken():
    """A reward whose scoring fails on the server."""

    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB")

    return score


def sleepy(seconds: float):
    """A reward slower than the client's timeout."""

    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        time.sleep(seconds)
        return torch.zeros(len(prompts))

    return score


@contextmanager
def serving(spec: dict, wait_s: float = 0.0, max_images: int = 64):
    import uvicorn

    from grpo.rewards.service import Batcher, make_app

    batcher = Batcher(build_rewards(spec, "cpu"), max_images=max_images, wait_s=wait_s)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(batcher), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", batcher
    finally:
        server.should_exit = True
        thread.join()
        batcher.close()


@pytest.fixture(scope="module")
def server():
    with serving(SERVED) as served:
        yield served


def _remote(url: str, reward: str, **options) -> dict:
    return {"remote": {"url": url, "reward": reward, "retries": 1, "backoff": 0.01, **options}}


def test_remote_scores_equal_in_process_and_concurrent_requests_are_batched(server) -> None:
    url, _ = server
    x, prompts = images(len(PROMPTS), 40, 56, seed=3), list(PROMPTS)
    local = build_rewards({k: SERVED[k] for k in ("jpeg_compressibility", "jpeg_incompressibility")}, "cpu")
    remote = build_rewards({**_remote(url, "jpeg_compressibility", batch_size=4),
                            "remote@q50": _remote(url, "jpeg_incompressibility")["remote"]}, "cpu")
    assert torch.equal(remote(x, prompts), local(x, prompts))  # jpeg encodes uint8 levels: the same input
    # Two ranks asking at once are scored as one batch: the first request waits (up to 10 s) until max_images.
    with serving({"jpeg_compressibility": 1.0}, wait_s=10.0, max_images=len(x)) as (batching, batcher):
        remote = build_rewards(_remote(batching, "jpeg_compressibility"), "cpu")["remote"]
        out: dict[int, torch.Tensor] = {}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, remote(x[i::2], prompts[i::2])))
                   for i in (0, 1)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert batcher.batches == 1 and time.monotonic() - start < 10
    for i in (0, 1):
        assert torch.equal(out[i], local["jpeg_compressibility"](x[i::2], prompts[i::2]))


def test_server_errors_are_one_line(server) -> None:
    url, _ = server
    body = encode_images(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), ["a", "b"])
    answer = requests.post(f"{url}/score/hpsv2", data=body, timeout=10)
    assert answer.status_code == 404 and answer.json()["error"].startswith("reward 'hpsv2' is not served here")
    answer = requests.post(f"{url}/score/jpeg_compressibility", data=b"not safetensors", timeout=10)
    assert answer.status_code == 400 and "not a safetensors file" in answer.json()["error"]
    answer = requests.post(f"{url}/score/jpeg_compressibility", data=encode_images(torch.zeros(2, 3, 8, 8), ["a"]),
                           timeout=10)
    assert answer.status_code == 400 and answer.json()["error"] == "expected images: uint8 [B, 3, H, W]"
    # A failing reward: HTTP 500, retried, then one line on the rank naming the reward, the URL and the cause.
    remote = build_rewards(_remote(url, "tests.unit.test_rewards_remote:broken"), "cpu")
    with pytest.raises(ServiceError) as err:
        remote(images(2, 8, 8), ["a", "b"])
    msg = str(err.value)
    assert msg.startswith(f"rewards.remote: {url}/score/tests.unit.test_rewards_remote%3Abroken failed after "
                          "2 attempts: HTTP 500: tests.unit.test_rewards_remote:broken: RuntimeError: CUDA out of "
                          "memory."), msg
    assert "\n" not in msg
    assert not isinstance(err.value, ServiceDown)  # a reward failing on the server is a bug, not an outage


def test_start_up_checks_reach_the_server(server) -> None:
    url, _ = server
    check_rewards(_remote(url, "jpeg_compressibility"))
    with pytest.raises(ConfigError, match=r"^rewards\.remote\.reward: .* serves jpeg_compressibility, "
                                          r"jpeg_incompressibility, .*not 'hpsv2'"):
        check_rewards(_remote(url, "hpsv2"))
    with pytest.raises(ConfigError, match=r"^rewards\.remote\.url: 'localhost:8000' is not an http"):
        check_rewards(_remote("localhost:8000", "hpsv2"))
    with pytest.raises(ConfigError, match=r"^rewards\.remote\.reward: missing from the config"):
        check_rewards({"remote": {"url": url}})


def test_a_server_that_is_down(tmp_path, capsys) -> None:
    """tools.check (run before torchrun) exits 2 with one line; scoring after the server went away, or slower than
    the timeout, fails clearly after the retries."""
    from tools.check import main

    url = f"http://127.0.0.1:{free_port()}"
    rewards = f"rewards={{remote: {{url: '{url}', reward: hpsv2}}}}"
    code = main(["--world-size", "2", str(ROOT / "recipes/configs/tiny/grpo_full.yaml"), rewards,
                 f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: rewards.remote.url: no answer from {url}/health (ConnectionError); start the "
                          "reward server (python -m tools.rewards serve"), err
    with serving({"jpeg_compressibility": 1.0}) as (up, _):
        remote = build_rewards(_remote(up, "jpeg_compressibility"), "cpu")
    # ServiceDown: a grpo.errors.DependencyDown, which ends the run with exit 75 (retry later)
    with pytest.raises(ServiceDown, match=rf"^rewards\.remote: {up}/score/jpeg_compressibility failed after 2 "
                                          r"attempts: ConnectionError; the server stopped answering: restart it .*"
                                          r"checkpoint\.resume=auto$") as down:
        remote(images(2, 8, 8), ["a", "b"])
    assert down.value.code == EXIT_RETRY_LATER
    slow = "tests.unit.test_rewards_remote:sleepy"
    with serving({slow: {"seconds": 0.3}}) as (up, _):
        remote = build_rewards(_remote(up, slow, timeout=0.05), "cpu")
        with pytest.raises(ServiceDown, match=r"^rewards\.remote: .* failed after 2 attempts: no answer within "
                                              r"timeout 0\.05 s; the server stopped answering"):
            remote(images(2, 8, 8), ["a", "b"])


def test_serve_cli_refuses_bad_input_before_loading(tmp_path, capsys) -> None:
    from tools.rewards import main

    config = tmp_path / "served.yaml"
    config.write_text("rewards:\n  hps: 1.0\n")
    assert main(["serve", str(config)]) == 2
    assert "error: rewards.hps: unknown reward 'hps'" in capsys.readouterr().err
    config.write_text("jpeg_compressibility: 1.0\n")  # a bare rewards map is a config too
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", str(config), "--port", str(busy.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --port: cannot listen on 127.0.0.1:") and err.count("\n") == 1, err
