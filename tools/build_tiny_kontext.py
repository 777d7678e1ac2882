"""The tiny FLUX.1-Kontext folder: the trained tiny FLUX.1 world model (assets/tiny-flux) laid out as a
FluxKontextPipeline, which has FluxPipeline's components (the same transformer class, VAE, text encoders, scheduler).

    python -m tools.build_tiny --family flux1-kontext --out assets/tiny-flux-kontext [--init-from assets/tiny-flux]

Nothing is trained: the folder is the source's model_index.json with `_class_name` FluxKontextPipeline and the
source's component folders. By default they are relative symbolic links, so assets/tiny-flux-kontext is a few
hundred bytes and can never drift from assets/tiny-flux (`copy=True` writes real copies, e.g. for a filesystem
without links). The tiny transformer never saw reference tokens: it serves the Kontext code path (parity with the
pipeline, the recipe's runs, export), not as an editing model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "assets" / "tiny-flux"
PIPELINE = "FluxKontextPipeline"


def build_kontext(out: Path, source: Path = SOURCE, copy: bool = False) -> Path:
    """Write the Kontext folder `out` from the FluxPipeline folder `source`; returns `out`."""
    out, source = Path(out), Path(source)
    index = json.loads((source / "model_index.json").read_text())
    if index.get("_class_name") != "FluxPipeline":
        raise SystemExit(f"--init-from: {source} is a {index.get('_class_name')}, not a FluxPipeline folder")
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None or not (source / name).is_dir():
            continue
        target = out / name
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
        if copy:
            shutil.copytree(source / name, target)
        else:
            target.symlink_to(os.path.relpath(source / name, out), target_is_directory=True)
    (out / "model_index.json").write_text(json.dumps({**index, "_class_name": PIPELINE}, indent=2) + "\n")
    (out / "build_info.json").write_text(json.dumps(
        {"family": "flux1-kontext", "from": os.path.relpath(source, out), "copy": copy,
         "note": "the source's weights, unchanged, under FluxKontextPipeline (tools/build_tiny_kontext.py)"},
        indent=2) + "\n")
    return out
