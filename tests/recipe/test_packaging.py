"""The package for real: a fresh virtual environment that sees the running environment's packages (torch & co.),
`pip install --no-deps -e .`, then the `flux-grpo` command from another folder, with no PYTHONPATH. The dispatcher
itself, in-process: tests/unit/test_cli.py.

The venv is made --without-pip and installed into by this interpreter's pip (`pip --python`). The build runs
offline (--no-build-isolation --no-index) with the setuptools the tests' environment imports when that one can build
an editable wheel: setuptools >= 70.1 has bdist_wheel itself, an older one needs the `wheel` package. Otherwise, as in
a fresh Python 3.11 virtual environment (ensurepip's setuptools 65.5, no `wheel`; the README's installs add neither),
pip builds in isolation, fetching what pyproject.toml's build-system requires from the configured index, as the
README's own `pip install --no-deps -e .` does there.

It sees our packages through a .pth file listing the site-packages folders on this interpreter's sys.path, not
through --system-site-packages: `python -m venv` always builds on the base interpreter, so inside a virtual
environment --system-site-packages exposes the base's site-packages (no torch, an old setuptools without bdist_wheel),
not the environment's the tests run in. A .pth file's plain lines only extend sys.path (the folders' own .pth files,
e.g. another editable install of this project, are not run), so the venv's own editable install is the one imported.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import ROOT
from tools.launch import launch_env

PRESET = ROOT / "recipes" / "configs" / "tiny" / "nft_lora.yaml"


def _builds_editable_wheels() -> bool:
    """The setuptools first on this sys.path (the one the venv imports too) has bdist_wheel: >= 70.1, or `wheel`."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        tools = Version(version("setuptools"))
    except PackageNotFoundError:
        return False
    return tools >= Version("70.1") or (tools >= Version("64") and importlib.util.find_spec("wheel") is not None)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("venv") / "venv"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    purelib = subprocess.run([str(where / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()  # the venv's own
    (Path(purelib) / "_test_environment.pth").write_text("".join(f"{p}\n" for p in ours))
    offline = ["--no-build-isolation", "--no-index"] if _builds_editable_wheels() else []
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(where / "bin" / "python"), "install", "-q",
                           "--no-deps", *offline, "-e", str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"venv + editable install: {time.monotonic() - t0:.1f} s")
    return where


def _run(venv: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = launch_env({"PYTHONPATH": None}, job=False)  # what the install provides, not the checkout on the path
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_installed_command_from_another_folder(venv, tmp_path):
    listed = _run(venv, tmp_path, "flux-grpo")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("usage: flux-grpo COMMAND") and "\n  train " in listed.stdout
    where = _run(venv, tmp_path, "python", "-c", "import grpo, recipes, tools.cli; print(grpo.__file__, recipes.__file__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.split() == [str(ROOT / "grpo" / "__init__.py"), str(ROOT / "recipes" / "__init__.py")]
    bad = _run(venv, tmp_path, "flux-grpo", "check", "--world-size", "1", str(PRESET), "no_such_key=1")
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: no_such_key: unknown setting") and bad.stderr.count("\n") == 1
    unknown = _run(venv, tmp_path, "flux-grpo", "chek")
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: flux-grpo: unknown command 'chek'")


@pytest.mark.slow
def test_a_check_passes_from_another_folder_with_absolute_paths(venv, tmp_path):
    """The presets' paths are relative to the working directory (run from the checkout): elsewhere the check names the
    missing model folder (exit 2), and passes once the paths are absolute."""
    relative = _run(venv, tmp_path, "flux-grpo", "check", "--world-size", "1", str(PRESET))
    assert relative.returncode == 2 and relative.stderr.startswith("error: model.path: assets/tiny-flux")
    absolute = [f"model.path={ROOT / 'assets' / 'tiny-flux'}", f"deepspeed.config={ROOT / 'ds_configs' / 'zero3.json'}",
                f"data.train_prompts={ROOT / 'assets' / 'prompts' / 'tiny_train.txt'}",
                f"data.eval_prompts={ROOT / 'assets' / 'prompts' / 'tiny_heldout.txt'}", f"output_dir={tmp_path / 'run'}"]
    ok = _run(venv, tmp_path, "flux-grpo", "check", "--world-size", "1", str(PRESET), *absolute)
    assert ok.returncode == 0, ok.stderr
