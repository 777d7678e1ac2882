"""Runs the recipe's main() on many bad inputs in one process (one import of torch/DeepSpeed for all of them).

    python tests/bad_input_driver.py CASES.json RESULTS.json

CASES.json: [{"name", "argv"}]; RESULTS.json: [{"name", "rc", "stderr"}]. A single process (world size 1): the
recipe joins a 1-process gloo group on the first case that gets that far and reuses it afterwards.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo.tools._recipe import load_recipe  # noqa: E402


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    recipe = load_recipe()

    def no_heavy_work(self):  # every check must have run before setup() (model loading) begins
        raise RuntimeError("reached setup(): the input was accepted")

    recipe.FluxGRPORecipe.setup = no_heavy_work
    results = []
    for case in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = recipe.main(case["argv"])
            except SystemExit as e:  # argparse
                rc = e.code
            except Exception as e:  # noqa: BLE001 -- reported as a failure of that case, not of the driver
                rc = f"{type(e).__name__}: {e}"
        results.append({"name": case["name"], "rc": rc, "stderr": err.getvalue()})
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
