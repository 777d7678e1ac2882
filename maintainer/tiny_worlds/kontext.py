"""The tiny FLUX.1-Kontext folder: the trained tiny FLUX.1 world model (assets/tiny-flux) laid out as a
FluxKontextPipeline, which has FluxPipeline's components (the same transformer class, VAE, text encoders, scheduler),
with its transformer pretrained to edit.

    python -m maintainer.tiny_worlds --family flux1-kontext --out assets/tiny-flux-kontext
        [--init-from assets/tiny-flux] [--transformer-steps N --transformer-lr LR --transformer-batch B
         --images-per-prompt K --seed S]

The folder is the source's model_index.json with `_class_name` FluxKontextPipeline and the source's component
folders: relative symbolic links by default, so they can never drift from assets/tiny-flux (`copy=True` writes real
copies, e.g. for a filesystem without links). Without `--transformer-steps` the transformer is the source's too,
which never saw reference tokens: such a folder serves the Kontext code path only (parity, runs, export).

With `--transformer-steps N` the transformer is a real copy, trained N rectified-flow steps (build.py's
`flow_matching`) to edit: the target latents of the world's edits (grpo.tiny.world.all_edits whose target scene is a
training prompt; held-out targets are never seen), conditioned as FluxKontextPipeline conditions its call (the target
scene's prompt, guidance 3.5, the source image's packed latents appended after the noisy tokens with first RoPE
coordinate 1), through the trainer's own conditioning and transformer call (grpo.models.FLUX1_KONTEXT). Each edit's
source and target are rendered with one placement (world.render_edits), so what it learns is to change what the
prompt names and keep where the shape is. The build ends with the held-out edits sampled by FluxKontextPipeline and
graded by world.edit_score, next to the source returned unchanged and to the right edit
(`build_info.json`, `eval`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from grpo.models import FLUX1_KONTEXT
from grpo.tiny import world
from maintainer.tiny_worlds.build import RESOLUTION, flow_matching, latent_size
from maintainer.tiny_worlds.flux1 import GUIDANCE, MAX_SEQUENCE_LENGTH, encode_latents, prompt_conditioning

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "assets" / "tiny-flux"
PIPELINE = FLUX1_KONTEXT.pipelines[0]  # FluxKontextPipeline


def build_kontext(out: Path, source: Path = SOURCE, copy: bool = False, transformer_steps: int = 0,
                  transformer_batch: int = 32, transformer_lr: float = 3e-4, shift: float = 3.0,
                  images_per_prompt: int = 8, seed: int = 0, eval_steps: int = 6, eval_seeds: int = 2) -> Path:
    """Write the Kontext folder `out` from the FluxPipeline folder `source` (its transformer trained to edit when
    transformer_steps > 0: `train_edits`, then `evaluate`); returns `out`."""
    out, source = Path(out), Path(source)
    index = json.loads((source / "model_index.json").read_text())
    if index.get("_class_name") != "FluxPipeline":
        raise SystemExit(f"--init-from: {source} is a {index.get('_class_name')}, not a FluxPipeline folder")
    out.mkdir(parents=True, exist_ok=True)
    trained = {"transformer"} if transformer_steps > 0 else set()
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None or not (source / name).is_dir():
            continue
        target = out / name
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
        if copy or name in trained:
            shutil.copytree(source / name, target)
        else:
            target.symlink_to(os.path.relpath(source / name, out), target_is_directory=True)
    (out / "model_index.json").write_text(json.dumps({**index, "_class_name": PIPELINE}, indent=2) + "\n")
    info = {"family": "flux1-kontext", "from": os.path.relpath(source, out), "copy": copy,
            "note": "the source's weights, unchanged, under FluxKontextPipeline (maintainer/tiny_worlds/kontext.py)"}
    if transformer_steps > 0:
        pipe = FLUX1_KONTEXT.pipeline_class().from_pretrained(out, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        generator = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        train_edits(pipe, transformer_steps, transformer_batch, transformer_lr, shift, images_per_prompt, generator)
        seconds = {"transformer": round(time.perf_counter() - start, 1)}
        pipe.transformer.save_pretrained(out / "transformer")
        info.update(seed=seed, transformer_steps=transformer_steps, transformer_batch=transformer_batch,
                    transformer_lr=transformer_lr, shift=shift, images_per_prompt=images_per_prompt,
                    threads=torch.get_num_threads(),
                    note="the source's components under FluxKontextPipeline, the transformer trained to edit "
                         "(maintainer/tiny_worlds/kontext.py)")
        if eval_seeds > 0:
            start = time.perf_counter()
            info["eval"] = evaluate(pipe, eval_steps, list(range(eval_seeds)))
            seconds["evaluate"] = round(time.perf_counter() - start, 1)
            logger.info("held-out edits: %s", info["eval"])
        info["seconds"] = seconds
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return out


def train_edits(pipe, steps: int, batch: int, lr: float, shift: float, images_per_prompt: int,
                generator: torch.Generator) -> None:
    """Rectified-flow training of the FluxKontextPipeline `pipe.transformer` on the world's training edits,
    `images_per_prompt` renders (source and target with one placement) of each, conditioned as the pipeline's call."""
    train_targets = set(world.split_prompts()[0])
    edits = [(s, t) for s, _, t in world.all_edits() if t in train_targets]
    by_edit = prompt_conditioning(pipe, [t for _, t in edits])  # FLUX.1's prompt encoding, one row an edit
    with torch.no_grad():
        edit_of = torch.arange(len(edits)).repeat_interleave(images_per_prompt)
        sources, targets = world.render_edits([edits[i][0] for i in edit_of], [edits[i][1] for i in edit_of],
                                              RESOLUTION, generator)
        refs, latents = encode_latents(pipe, sources), encode_latents(pipe, targets)
    logger.info("%d training edits x %d renders: latents %s", len(edits), images_per_prompt, tuple(latents.shape))
    # One row a render: its edit's prompt, its own source image as the reference tokens.
    cond = replace(by_edit.select(edit_of), ref_latents=refs,
                   ref_ids=FLUX1_KONTEXT.reference_ids(latent_size(pipe), torch.device("cpu"), torch.float32))
    transformer = pipe.transformer

    def predict(xt, sigma, rows, step):
        return FLUX1_KONTEXT.velocity(transformer, xt, sigma, cond.select(rows))

    flow_matching(transformer, latents, torch.arange(len(edit_of)), predict, steps, batch, lr, shift, generator)


@torch.no_grad()
def evaluate(pipe, steps: int, seeds: list[int]) -> dict:
    """world.edit_score of FluxKontextPipeline edits of every held-out edit (its target scene never trained on), one
    per seed, next to the source returned unchanged and the right edit; with the mean per edit kind."""
    from PIL import Image

    heldout = set(world.split_prompts()[1])
    edits = [e for e in world.all_edits() if e[2] in heldout]
    src_prompts, kinds, tgt_prompts = map(list, zip(*edits))
    scenes, src_scenes = [world.parse(t) for t in tgt_prompts], [world.parse(s) for s in src_prompts]
    sampled, unchanged, right = [], [], []
    for seed in seeds:
        sources, targets = world.render_edits(src_prompts, tgt_prompts, RESOLUTION,
                                              torch.Generator().manual_seed(10_000 + seed))
        images = [Image.open(io.BytesIO(world.png_bytes(x))) for x in sources]
        edited = pipe(image=images, prompt=tgt_prompts, height=RESOLUTION, width=RESOLUTION,
                      max_area=RESOLUTION * RESOLUTION, _auto_resize=False, num_inference_steps=steps,
                      guidance_scale=GUIDANCE, max_sequence_length=MAX_SEQUENCE_LENGTH,
                      generator=torch.Generator().manual_seed(seed), output_type="pt").images
        sampled.append(world.edit_score(edited, scenes, sources, src_scenes))
        unchanged.append(world.edit_score(sources, scenes, sources, src_scenes))
        right.append(world.edit_score(targets, scenes, sources, src_scenes))
    sampled_all = torch.cat(sampled)
    kind_of = kinds * len(seeds)
    return {
        "edits": "heldout", "count": len(edits), "num_inference_steps": steps, "seeds": len(seeds),
        "edit_score_mean": round(sampled_all.mean().item(), 4),
        "by_kind": {k: round(sampled_all[[i for i, x in enumerate(kind_of) if x == k]].mean().item(), 4)
                    for k in world.EDIT_KINDS},
        "unchanged_source_score_mean": round(torch.cat(unchanged).mean().item(), 4),
        "right_edit_score_mean": round(torch.cat(right).mean().item(), 4),
    }

