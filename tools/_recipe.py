"""Loading and driving the recipe script from the tools, by path (recipes/ is a package only so that an install
carries the script; a copied and edited recipe loads the same way, and `flux-grpo train` runs it through here).

:func:`load_recipe` is the one loader: the tools, the benchmarks (``load_recipe().build_policy(...)``) and the tests
reach the recipe's code through it, once per process and path. tools.npu_audit and tools.align both build the recipe of a preset exactly as a training run does
(``FluxGRPORecipe(cfg)`` then ``setup()``) and run one GRPO step through its own ``step()``, so what they observe is the
code that trains, not a re-implementation of it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE_PATH = REPO_ROOT / "recipes" / "flux_grpo.py"


def load_recipe(path: str | Path = RECIPE_PATH) -> ModuleType:
    """Imports the recipe script by path, once per process (a second call returns the same module).

    Args:
        path: A recipe script defining ``FluxGRPORecipe`` (a copied and edited recipe works too).

    Returns:
        The executed module.

    Raises:
        FileNotFoundError: ``path`` is not a loadable Python file.
    """
    return _load(Path(path).resolve())


@functools.cache
def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_tool_recipe_{path.stem}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise FileNotFoundError(f"cannot load recipe {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def has_override(overrides: Sequence[str], key: str) -> bool:
    """True when ``key=...`` is among the dotted overrides."""
    return any(o.split("=", 1)[0] == key for o in overrides)


@contextlib.contextmanager
def recipe_session(config_path: str | Path, overrides: Sequence[str],
                   recipe_path: str | Path = RECIPE_PATH) -> Iterator[Any]:
    """Builds and sets up the recipe of a preset; yields it and closes its metrics writer afterwards.

    The run writes into a temporary output_dir unless the overrides name one (the recipe refuses a directory that
    already holds a run). Joins the process group through the recipe (``grpo.device.init_distributed``), so under
    torchrun every rank must enter the session.

    Args:
        config_path: YAML preset.
        overrides: Dotted ``key=value`` overrides.
        recipe_path: The recipe script.

    Yields:
        The set-up ``FluxGRPORecipe``.
    """
    from grpo.config import load_config

    recipe_mod = load_recipe(recipe_path)
    overrides = list(overrides)
    with contextlib.ExitStack() as stack:
        if not has_override(overrides, "output_dir"):
            overrides.append(f"output_dir={stack.enter_context(tempfile.TemporaryDirectory())}/run")
        recipe = recipe_mod.FluxGRPORecipe(load_config(config_path, overrides))
        recipe.setup()
        try:
            yield recipe
        finally:
            recipe.metrics.close()
