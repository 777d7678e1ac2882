"""pyproject.toml and requirements.txt list the same packages with the same specifiers (requirements.txt is the
pinned environment the README installs; the pyproject is the distribution's metadata, `pip install -e .`)."""

from __future__ import annotations

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
import pytest

from tests import ROOT
from tests.unit.test_device import _requirements

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# Ranges in the pyproject, exact pins in the requirements files: the package's metadata holds both tested stacks
# (requirements.txt's CPU/CUDA torch and requirements-npu.txt's), so installing it never swaps an NPU machine's torch.
RANGES = {"torch", "torchvision"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _specs(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        req = Requirement(line)
        out[req.name.lower().replace("_", "-")] = str(req.specifier)
    return out


def _canonical(spec: str) -> str:
    return ",".join(sorted(str(s) for s in SpecifierSet(spec)))


def test_pyproject_lists_requirements_txt():
    project = _pyproject()["project"]
    deps, test = _specs(project["dependencies"]), _specs(project["optional-dependencies"]["test"])
    assert not deps.keys() & test.keys()
    listed = {**deps, **test}
    pinned = _requirements(ROOT / "requirements.txt")
    assert listed.keys() == pinned.keys()
    assert {k: _canonical(v) for k, v in listed.items() if k not in RANGES} == {
        k: _canonical(v) for k, v in pinned.items() if k not in RANGES}
    assert set(test) == {"pytest", "pytest-timeout"}  # the test runners; hpsv2 stays --no-deps (requirements-test.txt)


@pytest.mark.parametrize("name", sorted(RANGES))
def test_torch_ranges_hold_both_tested_pins(name):
    deps = _specs(_pyproject()["project"]["dependencies"])
    for path in ("requirements.txt", "requirements-npu.txt"):
        pin = _requirements(ROOT / path)[name]
        assert pin.startswith("==") and pin[2:] in SpecifierSet(deps[name]), (path, pin, deps[name])


def test_packages_entry_point_and_package_data():
    cfg = _pyproject()
    packages = set(cfg["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for top in ("grpo", "tools", "recipes")
               for p in (ROOT / top).rglob("__init__.py")}
    assert packages == on_disk  # a new subpackage must be listed, or a wheel would lack it
    assert (ROOT / "maintainer" / "__init__.py").is_file() and not {p for p in packages if p.startswith("maintainer")}
    assert cfg["project"]["scripts"] == {"flux-grpo": "tools.cli:main"}
    shipped = {f"{pkg}/{name}" for pkg, names in cfg["tool"]["setuptools"]["package-data"].items() for name in names}
    data = {str(p.relative_to(ROOT)) for top in ("grpo", "tools") for p in (ROOT / top).rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc")}
    assert data == shipped
    assert "psutil" in _requirements(ROOT / "requirements-npu.txt")
