"""Evaluate a checkpoint offline: held-out prompts from the base model and from the checkpoint, scored by the rewards.

The held-out prompts are sampled (eta = 0, fixed noise) in one process without DeepSpeed.

    python -m tools.eval CONFIG [checkpoint=PATH] [weights=auto|ema|model] [out=DIR] [key=value ...]

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
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from grpo import device as dev
from grpo import engine as eng
from grpo.checkpoint import find_checkpoint
from grpo.config import RecipeConfig, load_config
from grpo.errors import ConfigError, run_command
from grpo.eval import eval_images, sample_heldout, score_heldout
from grpo.export import apply_weights, trained_weights
from grpo.inputs import load_ds_config, resolve_model_path
from grpo.layout import derive_layout
from grpo.models import family_of
from grpo.metrics import save_grid
from grpo.prompt_sets import read_image, row_images
from grpo.prompts import ensure_cache, ensure_negative, ensure_references, load_cache, read_prompt_set
from grpo.rewards import build_rewards, check_reward_metadata, check_rewards, mix
from grpo.rollout import FluxSampler

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


def evaluate_checkpoint(cfg: RecipeConfig, checkpoint: str | Path | None, weights: str = "auto",
                        out_dir: str | Path | None = None) -> dict:
    """Sample and score the held-out prompts with the base model and with `checkpoint`'s weights (one process).

    Args:
        cfg: the preset (model, sampling, rewards, held-out prompts).
        checkpoint: a checkpoint folder, a run folder, or None for the newest valid checkpoint under
            cfg.output_dir/checkpoints (base only when there is none).
        weights: auto (EMA when the checkpoint has it), ema, or model.
        out_dir: where grid.png and scores.json go; default :func:`results_dir`.

    Returns:
        {"prompts", "base": {...}, "checkpoint": {...} | None, "images": {"base": T, "checkpoint": T}, "dir"}.
    """
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
    state, meta = trained_weights(found, weights) if found is not None else (None, None)

    device = dev.device_for_local_rank(0)
    cache = load_cache(ensure_cache(model_path, cfg.data.eval_prompts, "data.eval_prompts", cfg.data, device, rows),
                       rows, ensure_references(model_path, cfg.data.eval_prompts, rows, cfg.data.cache_dir,
                                               cfg.sampling.resolution, device),
                       ensure_negative(model_path, cfg.sampling, cfg.data, device))
    parts = family_of(model_path).load_parts(model_path, vae_dtype=dev.resolve_dtype(cfg.model.dtype),
                                             transformer_dtype=dtype)
    model = parts.transformer.to(device).eval()
    dev.set_attention_backend(model, cfg.model.attention_backend)
    sampler = FluxSampler.from_parts(parts, parts.vae.to(device), cfg.sampling, cfg.seed, device, dtype).for_eval()
    micro = layout.rollout_micro_batch_size
    rewards = build_rewards(cfg.rewards, device)
    ids = list(range(eval_images(cache, cfg)))

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x0 = sample_heldout(model, sampler, cache, ids, micro)
        images, comps = score_heldout(sampler, rewards, cache, ids, x0, micro)
        return images, comps, mix(comps, rewards.weights.to(comps.device), None, False)

    base_images, base_comps, base_total = run()
    result = {"prompts": list(cache.prompts), "metadata": list(cache.metadata),
              "base": _summary(base_comps, base_total, rewards.names, len(cache)),
              "checkpoint": None, "images": {"base": base_images.cpu()}}
    if found is not None:
        apply_weights(model, state, meta)
        images, comps, total = run()
        result["checkpoint"] = {"path": str(found), "step": meta["step"], "weights": meta["weights"],
                                **_summary(comps, total, rewards.names, len(cache))}
        result["images"]["checkpoint"] = images.cpu()
    out = Path(out_dir) if out_dir else results_dir(cfg, found)
    out.mkdir(parents=True, exist_ok=True)
    first = slice(0, len(cache))  # the first seed's image of every prompt: one row per prompt
    # An editing set's rows start with their source image (as the model saw it: at the sampling resolution).
    sources = [torch.stack([read_image(row_images(m)[0], cfg.sampling.resolution) for m in cache.metadata])
               ] if any(row_images(m) for m in cache.metadata) else []
    columns = [*sources, base_images[first], *([result["images"]["checkpoint"][first]] if found is not None else [])]
    grid = _side_by_side(*columns) if len(columns) > 1 else base_images[first]
    save_grid(grid, out / "grid.png", len(columns) if len(columns) > 1 else min(len(cache), 8))
    (out / "scores.json").write_text(json.dumps({k: v for k, v in result.items() if k != "images"}, indent=1))
    result["dir"] = str(out)
    line = (f"held-out reward over {len(cache)} prompts x {cfg.logging.eval_seeds} seeds: "
            f"base {result['base']['reward_mean']:.4f}")
    if found is not None:
        line += f" | {found.name} ({meta['weights']}) {result['checkpoint']['reward_mean']:.4f}"
    log.info("%s -> %s", line, out)
    return result


def config_tool(argv: list[str] | None, doc: str, keys: tuple[str, ...],
                body: Callable[[str, dict[str, str], list[str]], str]) -> int:
    """The command line of a tool `CONFIG [key=value ...]`: help, logging, then ``body(config, own, overrides)`` (own:
    {key: value} of the tool's own `keys`; overrides: the rest, for the preset) under run_command (exit 2, one line)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(doc)
        return 0 if argv else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    mine = tuple(f"{k}=" for k in keys)
    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv[1:] if a.startswith(mine)}
    return run_command(lambda: body(argv[0], own, [a for a in argv[1:] if not a.startswith(mine)]))


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.eval CONFIG [checkpoint=PATH] [weights=auto|ema|model] [out=DIR] [key=value ...]`."""
    def body(config: str, own: dict[str, str], overrides: list[str]) -> str:
        return evaluate_checkpoint(load_config(config, overrides), own.get("checkpoint") or None,
                                   own.get("weights", "auto"), own.get("out") or None)["dir"]

    return config_tool(argv, __doc__, ("checkpoint", "weights", "out"), body)


if __name__ == "__main__":
    sys.exit(main())
