"""Start-up checks of a preset against this machine, shared by the recipe and launch/*.sh.

Batch arithmetic for the world size, the model folder, the DeepSpeed JSON, rewards, prompt datasets and output_dir, each
failing with one line that names the setting and the fix. It imports no DeepSpeed, and diffusers only to check LoRA
targets against the transformer built on the meta device (no weights), so the launchers run it
(``python -m tools.check``) in a few seconds before torchrun: a bad setting costs no rank's imports.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from grpo import checkpoint, lock, lora_files, metrics, prompts
from grpo.config import RecipeConfig
from grpo.layout import Layout, derive_layout
from grpo.errors import ConfigError
from grpo.models import ModelFamily, family_of, index_file
from grpo.rewards import check_reward_metadata, check_rewards


@dataclass
class Inputs:
    layout: Layout
    model_path: str  # a local diffusers folder
    family: ModelFamily  # from its model_index.json
    ds_config: dict  # the DeepSpeed config with the batch fields filled


def resolve_model_path(path: str, revision: str | None = None) -> str:
    """Return a local folder for `path` (a local folder or a hub id), or raise a one-line ConfigError.

    Hub ids resolve through the local Hugging Face cache; with HF_HUB_OFFLINE=1 nothing is downloaded.
    """
    if Path(path).is_dir():
        if not index_file(path).is_file():
            raise ConfigError(
                f"model.path: {path} has no model_index.json (nor modular_model_index.json); point it at a diffusers "
                "FLUX folder "
                "(e.g. assets/tiny-flux or a downloaded black-forest-labs/FLUX.1-dev)"
            )
        family_of(path)  # a pipeline of no supported family is refused here, before any weight is read
        return path
    if path.count("/") != 1 or path.startswith((".", "/")):
        raise ConfigError(f"model.path: {path} is not a folder; give a local diffusers folder or a hub id such as "
                          "black-forest-labs/FLUX.1-dev")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    try:
        return snapshot_download(path, revision=revision, local_files_only=offline,
                                 allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except Exception as e:  # noqa: BLE001 -- any hub failure becomes one actionable line
        raise ConfigError(
            f"model.path: {path} is not a local folder and could not be found in the Hugging Face cache "
            f"({type(e).__name__}); run `hf download {path}` on a machine with access, "
            "or set model.path to a local folder"
        ) from None


_FILLED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


def load_ds_config(path: str, cfg: RecipeConfig, layout: Layout) -> dict:
    """Read a ds_configs/*.json file, check it, and fill the fields the recipe owns."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"deepspeed.config: {path} does not exist; use one of ds_configs/*.json")
    try:
        ds = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed.config: {path} is not valid JSON (line {e.lineno}); fix the syntax") from None
    stage = ds.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise ConfigError(f"deepspeed.config: {path} has zero_optimization.stage={stage}; these recipes need 3")
    clash = [k for k in _FILLED if k in ds]
    if clash:
        raise ConfigError(
            f"deepspeed.config: {path} sets {clash[0]}; remove it, the recipe derives it from batch.* and optim.*"
        )
    if "optimizer" in ds or "scheduler" in ds:
        raise ConfigError(f"deepspeed.config: {path} declares an optimizer/scheduler; remove it, set optim.* instead")
    ds.update(
        train_micro_batch_size_per_gpu=layout.micro_batch_size,
        gradient_accumulation_steps=layout.grad_accum_steps,
        train_batch_size=layout.ds_train_batch_size,
        gradient_clipping=cfg.optim.max_grad_norm,
    )
    if layout.world_size == 1:
        # Nothing to reduce on one process, yet ZeRO-3's coalesced reduce-scatter copies every gradient into an
        # interleaved buffer and through the backend's reduce-scatter each backward (1.6 s of a 10 s iteration on
        # the CPU, benchmarks/RESULTS.md); its contiguous all-reduce path works in place. Same gradients, bit for bit.
        ds["zero_optimization"].setdefault("reduce_scatter", False)
    return ds


def check_lora_targets(transformer, targets: list[str]) -> None:
    """Every lora.target_modules entry must name a module: PEFT skips an entry that matches nothing (a typo trains
    fewer layers than asked) and fails with a traceback only when none match. The error names the linear layers of
    the first double and single block, which differ between families (FLUX.2 fuses the single blocks' q/k/v/MLP)."""
    import torch

    names = [name for name, _ in transformer.named_modules()]
    for target in targets:
        if not any(n == target or n.endswith(f".{target}") for n in names):  # PEFT's rule for a list of names
            linear = [n for b in (transformer.transformer_blocks[0], transformer.single_transformer_blocks[0])
                      for n, m in b.named_modules() if isinstance(m, torch.nn.Linear)]
            raise ConfigError(f"lora.target_modules: {target!r} matches no module of the {type(transformer).__name__};"
                              f" use names of its blocks' linear layers: {', '.join(dict.fromkeys(linear))}")


def check_lora_targets_on_config(model_path: str, targets: list[str]) -> None:
    """:func:`check_lora_targets` on the transformer built from its config.json on the meta device (no weights)."""
    check_lora_targets(family_of(model_path).meta_transformer(model_path), targets)


def _guidance_embeds(model_path: str) -> bool:
    import inspect

    cls = family_of(model_path).transformer_class()
    # A config.json may omit it; a class without the argument (FLUX.3) has no guidance embedding.
    param = inspect.signature(cls.__init__).parameters.get("guidance_embeds")
    default = param is not None and param.default
    return bool(cls.load_config(Path(model_path) / "transformer").get("guidance_embeds", default))


def _step_distilled(model_path: str) -> bool:
    """model_index.json's is_distilled: the step-distilled FLUX.2 [klein] (true), not klein base (false)."""
    index = index_file(model_path)
    return index.is_file() and bool(json.loads(index.read_text()).get("is_distilled", False))


def check_guidance(model_path: str, guidance: float, true_cfg: bool = False) -> None:
    """A transformer without a guidance embedding (FLUX.2 [klein], FLUX.1-schnell) has no use for
    sampling.guidance, which would be silently ignored: refused instead (its guidance is true CFG,
    sampling.true_cfg). A transformer with one (FLUX.1-dev, Kontext, FLUX.2 [dev]) is guidance-distilled: true
    CFG on it is refused. Flux2Pipeline ([dev]) has no negative prompt at all; FluxPipeline and FluxKontextPipeline
    take a true_cfg_scale beside the embedding, which the recipe does not build (yet). The step-distilled klein
    (is_distilled: true) is refused true CFG too: Flux2KleinPipeline ignores guidance_scale on it, so a guided
    rollout would be a sampler no user runs."""
    if true_cfg and _step_distilled(model_path):
        raise ConfigError(f"sampling.true_cfg: {model_path} is step-distilled (model_index.json is_distilled: true) "
                          "and Flux2KleinPipeline ignores guidance on it; set sampling.true_cfg=null and "
                          "sampling.eval_cfg_scale=null, or train klein base (recipes/configs/flux2_klein_base/)")
    embeds = _guidance_embeds(model_path)
    if not embeds and guidance != 1.0:
        raise ConfigError(f"sampling.guidance: {guidance}, but {model_path} has no guidance embedding (its "
                          "classifier-free guidance is sampling.true_cfg); set sampling.guidance=1.0")
    if embeds and true_cfg:
        raise ConfigError(f"sampling.true_cfg: {model_path} is guidance-distilled (a guidance embedding, "
                          "sampling.guidance) and the recipe has no true CFG for it; set sampling.true_cfg=null "
                          "and sampling.eval_cfg_scale=null")


def check_prompt_sets(cfg: RecipeConfig, model_path: str) -> None:
    """The train and eval datasets read and checked row by row (grpo/prompt_sets.py), their rows' metadata against
    what the rewards read (after check_rewards, which validates the rewards' options), and their images against what
    the model folder's family takes (a source image a row for FLUX.1-Kontext, none for text to image)."""
    family = family_of(model_path)
    sources = {"data.train_prompts": cfg.data.train_prompts, "data.eval_prompts": cfg.data.eval_prompts}
    for setting, source in sources.items():
        if source:
            rows = prompts.read_prompt_set(source, setting)
            # the model's needs first: a row without the image the family edits is the dataset's first fault
            family.check_references(rows, setting, source, model_path)
            check_reward_metadata(cfg.rewards, rows, setting, source)


def check_output_dir(path: str) -> None:
    """output_dir can be created and written: no file in its way, a writable folder (probed, then removed)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir: {out} is a file; choose a folder")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"output_dir: {out} cannot be created: {parent} is a file; choose another output_dir")
    # A refused start must leave output_dir as it was, to its mtime, which the probe's entry changes: put it back.
    before = parent.stat()
    try:
        probe = tempfile.mkdtemp(prefix=lock.WRITE_PROBE, dir=parent)
        os.rmdir(probe)
        os.utime(parent, ns=(before.st_atime_ns, before.st_mtime_ns))
    except OSError as e:
        raise ConfigError(f"output_dir: {out} cannot be {'written' if parent == out else 'created'}: {parent} is "
                          f"not writable ({e.strerror}); choose a writable output_dir") from None


def check_inputs(cfg: RecipeConfig, world_size: int) -> Inputs:
    """The recipe's start-up checks that need no model weights, accelerator or process group.

    Batch arithmetic for `world_size`, the model folder (or hub cache), LoRA targets (against the model's config),
    the DeepSpeed JSON, rewards (names, options, model files), prompt datasets (every row, and the metadata the
    rewards read), wandb, output_dir (writable, no other
    job's lock, empty for a new run), and the resume checkpoint's structure (meta.json, files present; the ranks hash
    the files).
    """
    try:
        layout = derive_layout(cfg, world_size)
    except ConfigError:
        if cfg.checkpoint.resume is not None:  # a resumed run's batch is its checkpoint's: name the process counts
            checkpoint.resume_point(cfg, world_size, check=checkpoint.structure)
        raise
    model_path = resolve_model_path(cfg.model.path, cfg.model.revision)
    ds_config = load_ds_config(cfg.deepspeed.config, cfg, layout)
    if cfg.lora is not None:
        check_lora_targets_on_config(model_path, cfg.lora.target_modules)
    lora_files.check_formats(cfg.export.formats, cfg.lora, family_of(model_path))
    check_guidance(model_path, cfg.sampling.guidance, cfg.sampling.negative_prompt is not None)
    check_rewards(cfg.rewards)
    check_prompt_sets(cfg, model_path)
    metrics.check_wandb(cfg.logging.wandb)
    check_output_dir(cfg.output_dir)
    if not dist.is_initialized():  # the recipe's ranks: rank 0 takes the lock next (grpo/lock.py take), or fails alike
        lock.check_free(cfg.output_dir)
    # Structure only: hashing every checkpoint file takes minutes for FLUX.1-dev, a job the recipe's ranks share, and
    # `auto` may move a broken checkpoint aside, which a check must not do.
    fresh = checkpoint.resume_point(cfg, world_size, check=checkpoint.structure) is None
    if fresh and cfg.lora is not None and cfg.lora.init_from is not None:  # rank, alpha, targets on the meta model
        lora_files.check_init_lora_on_config(model_path, family_of(model_path), cfg.lora)
    return Inputs(layout, model_path, family_of(model_path), ds_config)
