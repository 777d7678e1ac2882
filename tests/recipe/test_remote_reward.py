"""A GRPO step on 2 processes whose reward is served by `python -m tools.rewards serve` (a real server process on a
free localhost port) gives the rewards of the same reward in-process."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import requests
import torch
import yaml

from tests import ROOT
from tests.recipe.test_recipe_distributed import one_step
from tools.launch import free_port, launch_env

LORA = "recipes/configs/tiny/grpo_lora.yaml"


def _wait_healthy(server: subprocess.Popen, url: str, log, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the reward server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            time.sleep(0.2)
    raise AssertionError(f"the reward server did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_two_process_step_with_a_served_reward(tmp_path, tiny_reward_spec) -> None:
    hps = tiny_reward_spec["hpsv2"]
    config = tmp_path / "served.yaml"
    config.write_text(yaml.safe_dump({"rewards": {"hpsv2": hps}}))
    for run in ("remote", "local"):
        (tmp_path / run).mkdir()
    port, log = free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "tools.rewards", "serve", str(config), "--port", str(port),
                                   "--device", "cpu"], cwd=ROOT, env=launch_env(), stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        _wait_healthy(server, url, log)
        remote = one_step(tmp_path / "remote", 2, LORA,
                          ["rewards=" + json.dumps({"remote": {"url": url, "reward": "hpsv2", "timeout": 60}})])
    finally:
        server.terminate()
        server.wait(timeout=60)
    local = one_step(tmp_path / "local", 2, LORA, ["rewards=" + json.dumps({"hpsv2": hps})])
    # The server batches both ranks' images together, a different batch than each rank's own: float rounding only
    # (measured ~1.5e-8 on the tiny HPS).
    torch.testing.assert_close(remote["rewards"], local["rewards"], atol=1e-6, rtol=0)
    torch.testing.assert_close(remote["advantages"], local["advantages"], atol=1e-5, rtol=0)
    assert remote["stats"]["ratio_max_dev"] == 0.0
    assert "reward/remote_mean" in remote["stats"]
