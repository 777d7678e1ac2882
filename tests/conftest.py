"""Test-wide settings and fixtures: never touch a model hub, use DeepSpeed's CPU accelerator when no device is present,
the time limit of slow tests, tiny reward model files built once per session."""

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

# No test touches a hub: set before huggingface_hub is imported by anything.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if importlib.util.find_spec("torch_npu") is None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The per-test limit of slow tests: their chains of runs set subprocess limits of up to 40 min (the whole device check
# on the CPU), far above pytest.ini's 1200 s for the default set.
SLOW_TIMEOUT_S = 3600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests get SLOW_TIMEOUT_S instead of pytest.ini's timeout, unless they set @pytest.mark.timeout."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture(scope="session")
def tiny_reward_spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """{reward name: options} pointing at tiny random-weight files laid out like the hub repos (see
    grpo.rewards.tiny_models)."""
    from grpo.rewards.tiny_models import write_tiny_reward_files

    return write_tiny_reward_files(tmp_path_factory.mktemp("tiny_rewards"))


@pytest.fixture(scope="session")
def tiny_flux2_dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained tiny Flux2Pipeline (FLUX.2 [dev] layout) folder, built in about a second
    (maintainer.tiny_worlds.flux2.build_dev)."""
    import torch

    from maintainer.tiny_worlds.flux2 import build_dev

    out = tmp_path_factory.mktemp("tiny-flux2-dev")
    with torch.random.fork_rng(devices=[]):  # the build seeds torch's global generator; the session's stays as it was
        build_dev(out)
    return out


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1 for one test (restored afterwards)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
