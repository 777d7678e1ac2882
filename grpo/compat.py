"""Whether a checkpoint fits this run: a world size its global batch splits over, and the same value of every setting
that shapes training.

The schema says which settings may change on resume (the "[may change on resume]" ones, grpo.config.resume_free);
a file or folder spelled differently (relative vs absolute) is not a change. grpo/checkpoint/ calls
:func:`check_compatible` before it resumes from a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo.config import RecipeConfig, is_path, resume_free, to_dict
from grpo.errors import ConfigError
from grpo.layout import valid_world_sizes


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _same(key: str, x: Any, y: Any) -> bool:
    if x == y:
        return True
    # A file or folder spelled differently (relative vs absolute) is not a change.
    if is_path(key) and isinstance(x, str) and isinstance(y, str) and Path(x).exists() and Path(y).exists():
        return Path(x).resolve() == Path(y).resolve()
    return False


def config_differences(saved: dict, current: dict) -> list[str]:
    """`key: saved -> current` for every setting that shapes training and differs (the schema says which settings
    may change on resume: grpo.config.resume_free)."""
    a, b = _flatten(saved), _flatten(current)
    # A setting newer than the checkpoint and off now (null, e.g. sampling.candidates) trains as the run did.
    added_off = {k for k in b if k not in a and b[k] is None}
    keys = sorted(k for k in (set(a) | set(b)) - added_off
                  if not resume_free(k) and not _same(k, a.get(k, "<unset>"), b.get(k, "<unset>")))
    return [f"{k}={a.get(k, '<unset>')!r} in the checkpoint, {b.get(k, '<unset>')!r} now" for k in keys]


def _nvme_optimizer(ds_config_path: str) -> bool:
    try:
        ds = json.loads(Path(ds_config_path).read_text())
    except (OSError, ValueError):
        return False  # unreadable: grpo.inputs.load_ds_config names that
    return ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device") == "nvme"


def check_compatible(path: Path, meta: dict, cfg: RecipeConfig, world_size: int) -> None:
    """Refuse (ConfigError) a checkpoint of another preset, or of another world size that this one cannot continue:
    a global batch that does not split over `world_size` processes, or an optimizer offloaded to NVMe (DeepSpeed
    restores NVMe-swapped states only from the same ranks' folders, never through a universal checkpoint)."""
    written = meta["world_size"]
    diff = config_differences(meta["config"], to_dict(cfg))
    if diff:
        more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
        raise ConfigError(
            f"checkpoint.resume: {path} belongs to another preset: {diff[0]}{more}; resume with the checkpoint's "
            "settings (its config is in meta.json) or start a new output_dir"
        )
    if written == world_size:
        return
    # Checked after the settings: with the checkpoint's settings the batch is the checkpoint's, so the only fix left
    # is the process count.
    sizes = valid_world_sizes(cfg)
    if world_size not in sizes:
        n = cfg.batch.prompts_per_step * cfg.sampling.group_size
        raise ConfigError(
            f"checkpoint.resume: {path} was written by {written} processes; its global batch ({n} images per step, "
            f"fixed for a resumed run) does not split over {world_size}; relaunch on "
            f"{', '.join(map(str, sizes[:-1]))}{' or ' if len(sizes) > 1 else ''}{sizes[-1]} processes"
        )
    if _nvme_optimizer(cfg.deepspeed.config):
        raise ConfigError(
            f"checkpoint.resume: {path} was written by {written} processes and deepspeed.config offloads the "
            f"optimizer to NVMe, whose states only the same ranks can reload; relaunch on {written} processes"
        )
