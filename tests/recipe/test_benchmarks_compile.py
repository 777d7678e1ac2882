"""The benchmarks' model.compile paths in their tiny --smoke mode (inductor compiles the blocks: minutes on 2 cores).

The numbers of a smoke run mean nothing; benchmarks/RESULTS.md holds the real runs.
"""

import re

import pytest

from tests.recipe.test_benchmarks import headline, run

pytestmark = pytest.mark.slow


def test_step_efficiency_smoke_with_compile():
    lines = run("step_efficiency.py", "--smoke", "--compile", timeout=1800)
    headline(lines, "step_efficiency")
    assert any(line.strip().startswith("zero3+compile") for line in lines)
    assert any("compile time" in line for line in lines)


def test_rollout_smoke_with_compile():
    lines = run("rollout.py", "--smoke", "--skip-zero3", "--compile", timeout=1800)
    headline(lines, "rollout_vs_diffusers")
    line = next(x for x in lines if "max |x0 compiled - x0 eager|" in x)
    assert float(re.search(r"= ([0-9.e+-]+)$", line).group(1)) <= 1e-5  # the same samples, fp32
    headline([x for x in lines if x.startswith("compiled_rollout_speedup")], "compiled_rollout_speedup")
