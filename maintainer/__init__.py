"""Maintainer tools: what builds the repository's own fixtures (the tiny worlds under assets/), never run by a user
of the recipe. Not packaged (pyproject.toml lists grpo, tools and recipes only) and imported by nothing of the product:
run from a checkout, e.g. ``python -m maintainer.tiny_worlds --help`` (tests/unit/test_packaging.py and
test_layering.py check both)."""
