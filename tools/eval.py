"""Evaluate a checkpoint offline: held-out prompts from the base model and from the checkpoint, scored by the rewards.

The held-out prompts are sampled (eta = 0, fixed noise) without DeepSpeed's engine, in one process or in shards
over N (``nproc=N``: tools/shards.py; the same images and scores on any N), each finished shard kept under the
results' ``shards/`` so that a rerun samples only what is left.

    python -m tools.eval CONFIG [checkpoint=PATH] [weights=auto|ema|model] [out=DIR] [nproc=N] [key=value ...]

checkpoint: a checkpoint folder or a run folder (default: the newest valid checkpoint under output_dir; the base
model only when there is none). weights: auto (the EMA's when the checkpoint has them), ema or model. Writes
``grid.png`` (one row per prompt: base | checkpoint; for an editing set source | base | checkpoint) and
``scores.json`` (`python -m tools.compare` reads two of them paired, image by image) beside the evaluated run:
``RUN/eval/<checkpoint>/`` for ``RUN/checkpoints/<checkpoint>`` whatever the preset's output_dir, so evaluating
another run of the same preset never writes over this one's; ``output_dir/eval/base/`` for the base model alone;
``out=DIR`` writes to DIR instead (e.g. a re-scoring under other settings kept apart from the first). The sampling
and scoring are the recipe's own (grpo/eval.py), so the images are those of the run's held-out evals.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from grpo import device as dev
from grpo import engine as eng
from grpo.checkpoint import find_checkpoint
from grpo.checkpoint.files import write_text_atomic
from grpo.config import RecipeConfig, load_config
from grpo.data import micro_batches
from grpo.distributed import leave
from grpo.errors import ConfigError, run_command
from grpo.eval import eval_images, sample_heldout, score_heldout
from grpo.export import apply_weights, trained_weights, weights_meta
from grpo.inputs import load_ds_config, resolve_model_path
from grpo.layout import Layout, derive_layout
from grpo.models import family_of
from grpo.metrics import save_grid
from grpo.prompt_sets import PromptSet, read_image, row_images
from grpo.prompts import ensure_cache, ensure_negative, ensure_references, load_cache, read_prompt_set
from grpo.rewards import build_rewards, check_reward_metadata, check_rewards, mix
from grpo.rollout import FluxSampler
from tools.shards import ShardStore, barrier, join, nproc_of, relaunch, shard_key

log = logging.getLogger(__name__)


def _side_by_side(*columns: torch.Tensor) -> torch.Tensor:
    """k x [N,3,H,W] -> [kN,3,H,W] ordered a_0, b_0, ..., a_1, b_1, ... (a k-column grid: one prompt per row)."""
    return torch.stack(columns, dim=1).flatten(0, 1)


def _summary(components: torch.Tensor, total: torch.Tensor, names: list[str], n_prompts: int) -> dict:
    return {
        "reward_mean": total.mean().item(),
        "per_prompt": total.view(-1, n_prompts).mean(0).tolist(),  # rows of the [seeds, prompts] layout of the ids
        "components": {n: components[:, i].tolist() for i, n in enumerate(names)},  # per image
        "per_image": total.tolist(),  # the weighted total, paired across checkpoints (python -m tools.compare)
    }


def results_dir(cfg: RecipeConfig, checkpoint: Path | None) -> Path:
    """Beside the evaluated run: RUN/eval/<name> for a checkpoint RUN/checkpoints/<name> (a checkpoint folder
    elsewhere: <its folder>/eval/<name>), output_dir/eval/base for the base model alone."""
    if checkpoint is None:
        return Path(cfg.output_dir) / "eval" / "base"
    folder = checkpoint.parent
    run = folder.parent if folder.name == "checkpoints" else folder
    return run / "eval" / checkpoint.name


class Inputs(NamedTuple):
    layout: Layout
    dtype: torch.dtype  # the transformer's, as the preset trains it
    model_path: str  # the base model's local folder
    rows: PromptSet  # the held-out prompts and their metadata
    found: Path | None  # the checkpoint (None: the base model alone)
    meta: dict | None  # its meta.json, "weights" the ones picked (grpo.export.weights_meta)


def inputs(cfg: RecipeConfig, checkpoint: str | Path | None, weights: str = "auto") -> Inputs:
    """What an eval reads, checked before any model loads (ConfigError: bad input, one line); see
    :func:`evaluate_checkpoint` for the arguments."""
    if not cfg.data.eval_prompts:
        raise ConfigError("data.eval_prompts: null; tools.eval needs a held-out prompt file, e.g. "
                          "assets/prompts/tiny_heldout.txt")
    layout = derive_layout(cfg, 1)
    ds = load_ds_config(cfg.deepspeed.config, cfg, layout)
    dtype = eng.precision(ds)
    model_path = resolve_model_path(cfg.model.path, cfg.model.revision)
    check_rewards(cfg.rewards)
    rows = read_prompt_set(cfg.data.eval_prompts, "data.eval_prompts")
    family_of(model_path).check_references(rows, "data.eval_prompts", cfg.data.eval_prompts, model_path)
    check_reward_metadata(cfg.rewards, rows, "data.eval_prompts", cfg.data.eval_prompts)
    if weights not in ("auto", "ema", "model"):
        raise ConfigError(f"weights: {weights!r}; use auto, ema or model")
    if checkpoint is None:
        found = find_checkpoint(Path(cfg.output_dir), required=False)
        if found is None:
            log.warning("no checkpoint under %s/checkpoints: evaluating the base model only", cfg.output_dir)
    else:
        found = find_checkpoint(Path(checkpoint))
    meta = weights_meta(found, weights) if found is not None else None
    return Inputs(layout, dtype, model_path, rows, found, meta)


def evaluate_checkpoint(cfg: RecipeConfig, checkpoint: str | Path | None, weights: str = "auto",
                        out_dir: str | Path | None = None, all_images: bool = True) -> dict | None:
    """Sample and score the held-out prompts with the base model and with `checkpoint`'s weights, in shards over the
    processes of this job (one process, or torchrun's ranks: tools/shards.py), each shard saved under
    ``<results>/shards/`` as it finishes: a rerun samples only the shards not done yet.

    Args:
        cfg: the preset (model, sampling, rewards, held-out prompts).
        checkpoint: a checkpoint folder, a run folder, or None for the newest valid checkpoint under
            cfg.output_dir/checkpoints (base only when there is none).
        weights: auto (EMA when the checkpoint has it), ema, or model.
        out_dir: where grid.png and scores.json go; default :func:`results_dir`.
        all_images: keep every image in the results (and the shard files); False: the grid's only (the first seed
            of every prompt), for a suite of thousands of images.

    Returns:
        On rank 0: {"prompts", "metadata", "base": {...}, "checkpoint": {...} | None, "images": {"base": T,
        "checkpoint": T} (every image, or the first seed's), "dir"}; None on the other ranks.
    """
    layout, dtype, model_path, rows, found, meta = inputs(cfg, checkpoint, weights)
    out = Path(out_dir) if out_dir else results_dir(cfg, found)

    # One shard per rollout micro-batch, cut the same on any number of processes (tools/shards.py).
    micro = layout.rollout_micro_batch_size
    shards = micro_batches(list(range(eval_images(rows, cfg))), micro)
    keep = (lambda j: True) if all_images else (lambda j: j < len(rows))  # the grid shows the first seed
    sources = [f for m in rows.metadata for f in row_images(m)]
    stores = {"base": ShardStore(out / "shards", shard_key(cfg, model_path, micro, None, sources), "base")}
    if meta is not None:
        stores["checkpoint"] = ShardStore(out / "shards", shard_key(cfg, model_path, micro, meta, sources),
                                          "checkpoint")
    rank, world, device = join()
    mine = range(rank, len(shards), world)
    todo = {role: [k for k in mine if not store.done(k)] for role, store in stores.items()}
    resumed = len(mine) * len(stores) - sum(map(len, todo.values()))
    if resumed:
        log.info("rank %d: %d of its %d shards already done under %s (resumed)", rank, resumed,
                 len(mine) * len(stores), out / "shards")
    # Rank 0 encodes missing prompt caches while the others wait, as the recipe does (they would write the same
    # files), when any shard is left: every rank reads the same answer, as nothing is written before this barrier.
    if rank == 0 and any(not store.done(k) for store in stores.values() for k in range(len(shards))):
        _prompt_cache(cfg, model_path, rows, device)
    barrier(world)
    if any(todo.values()):
        cache = _prompt_cache(cfg, model_path, rows, device)
        parts = family_of(model_path).load_parts(model_path, vae_dtype=dev.resolve_dtype(cfg.model.dtype),
                                                 transformer_dtype=dtype)
        model = parts.transformer.to(device).eval()
        dev.set_attention_backend(model, cfg.model.attention_backend)
        sampler = FluxSampler.from_parts(parts, parts.vae.to(device), cfg.sampling, cfg.seed, device,
                                         dtype).for_eval()
        rewards = build_rewards(cfg.rewards, device)
        for role, store in stores.items():
            if role == "checkpoint" and todo[role]:
                apply_weights(model, trained_weights(found, weights)[0], meta)
            for k in todo[role]:
                ids = shards[k]
                x0 = sample_heldout(model, sampler, cache, ids, micro)
                images, comps = score_heldout(sampler, rewards, cache, ids, x0, micro)
                kept = [i for i, j in enumerate(ids) if keep(j)]
                store.save(k, ids, comps, rewards.names, rewards.weights.tolist(), images[kept],
                           [ids[i] for i in kept])
    barrier(world)  # every shard is on disk
    if rank != 0:
        return None

    joined = {role: store.load(len(shards)) for role, store in stores.items()}
    result = {"prompts": list(rows.prompts), "metadata": list(rows.metadata), "base": None, "checkpoint": None,
              "images": {}}
    for role, j in joined.items():
        total = mix(j["components"], torch.tensor(j["weights"]), None, False)
        result[role] = _summary(j["components"], total, j["names"], len(rows))
        result["images"][role] = torch.stack([j["images"][i] for i in sorted(j["images"])])
    if meta is not None:
        result["checkpoint"] = {"path": str(found), "step": meta["step"], "weights": meta["weights"],
                                **result["checkpoint"]}
    base_images = result["images"]["base"]
    out.mkdir(parents=True, exist_ok=True)
    first = slice(0, len(rows))  # the first seed's image of every prompt: one row per prompt
    # An editing set's rows start with their source image (as the model saw it: at the sampling resolution).
    sources = [torch.stack([read_image(row_images(m)[0], cfg.sampling.resolution) for m in rows.metadata])
               ] if any(row_images(m) for m in rows.metadata) else []
    columns = [*sources, base_images[first], *([result["images"]["checkpoint"][first]] if found is not None else [])]
    grid = _side_by_side(*columns) if len(columns) > 1 else base_images[first]
    save_grid(grid, out / "grid.png", len(columns) if len(columns) > 1 else min(len(rows), 8))
    write_text_atomic(out / "scores.json", json.dumps({k: v for k, v in result.items() if k != "images"}, indent=1))
    result["dir"] = str(out)
    line = (f"held-out reward over {len(rows)} prompts x {cfg.logging.eval_seeds} seeds: "
            f"base {result['base']['reward_mean']:.4f}")
    if found is not None:
        line += f" | {found.name} ({meta['weights']}) {result['checkpoint']['reward_mean']:.4f}"
    log.info("%s -> %s", line, out)
    return result


def _prompt_cache(cfg: RecipeConfig, model_path: str, rows, device: torch.device):
    """The held-out prompts' embeddings (and source images, negative prompt), encoded first when missing."""
    return load_cache(ensure_cache(model_path, cfg.data.eval_prompts, "data.eval_prompts", cfg.data, device, rows),
                      rows, ensure_references(model_path, cfg.data.eval_prompts, rows, cfg.data.cache_dir,
                                              cfg.sampling.resolution, device),
                      ensure_negative(model_path, cfg.sampling, cfg.data, device))


def config_tool(argv: list[str] | None, doc: str, keys: tuple[str, ...],
                body: Callable[[str, dict[str, str], list[str]], str | None], module: str | None = None,
                check: Callable[[str, dict[str, str], list[str]], object] | None = None) -> int:
    """The command line of a tool `CONFIG [key=value ...]`: help, logging, then ``body(config, own, overrides)`` (own:
    {key: value} of the tool's own `keys`; overrides: the rest, for the preset) under run_command (exit 2, one line).

    A tool that samples in shards (tools/shards.py) names its `module` and its cheap start-up `check` (same
    arguments as `body`): its ``nproc=N`` (N > 1) runs the check here, so that bad input is one line before N
    processes import torch, then the tool again as N processes under tools.torchrun; the job's code is returned."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(doc)
        return 0 if argv else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    mine = tuple(f"{k}=" for k in (*keys, *(["nproc"] if module else [])))
    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv[1:] if a.startswith(mine)}
    overrides = [a for a in argv[1:] if not a.startswith(mine)]
    job: list[int] = []  # the exit code of the N processes, when launched

    def run() -> str | None:
        nproc = nproc_of(own.pop("nproc", None))
        if nproc == 1:
            return body(argv[0], own, overrides)
        if check is not None:
            check(argv[0], own, overrides)
        job.append(relaunch(module, [a for a in argv if not a.startswith("nproc=")], nproc))
        return None

    try:
        code = run_command(run)
    finally:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank of a job (tools.shards.join): the process group
            leave()  # goes while the interpreter is whole (grpo/distributed.py); a caller's own group is kept
    return job[0] if job else code


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.eval CONFIG [checkpoint=PATH] [weights=auto|ema|model] [out=DIR] [nproc=N] [key=value ...]`."""
    def body(config: str, own: dict[str, str], overrides: list[str]) -> str | None:
        result = evaluate_checkpoint(load_config(config, overrides), own.get("checkpoint") or None,
                                     own.get("weights", "auto"), own.get("out") or None)
        return None if result is None else result["dir"]  # rank 0 of several prints it

    def check(config: str, own: dict[str, str], overrides: list[str]) -> None:
        inputs(load_config(config, overrides), own.get("checkpoint") or None, own.get("weights", "auto"))

    return config_tool(argv, __doc__, ("checkpoint", "weights", "out"), body, "tools.eval", check)


if __name__ == "__main__":
    sys.exit(main())
