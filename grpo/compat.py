"""Whether a checkpoint fits this run: the same world size, and the same value of every setting that shapes training.

The schema says which settings may change on resume (the "[may change on resume]" ones, grpo.config.resume_free);
a file or folder spelled differently (relative vs absolute) is not a change. grpo/checkpoint.py calls
:func:`check_compatible` before it resumes from a checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo.config import RecipeConfig, is_path, resume_free, to_dict
from grpo.errors import ConfigError


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
    keys = sorted(k for k in set(a) | set(b) if not resume_free(k) and not _same(k, a.get(k, "<unset>"),
                                                                            b.get(k, "<unset>")))
    return [f"{k}={a.get(k, '<unset>')!r} in the checkpoint, {b.get(k, '<unset>')!r} now" for k in keys]


def check_compatible(path: Path, meta: dict, cfg: RecipeConfig, world_size: int) -> None:
    """Refuse (ConfigError) a checkpoint of another preset or another world size."""
    if meta["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint.resume: {path} was written by {meta['world_size']} processes, this run has {world_size}; "
            f"relaunch on {meta['world_size']} processes (resharding a ZeRO-3 checkpoint is not supported)"
        )
    diff = config_differences(meta["config"], to_dict(cfg))
    if diff:
        more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
        raise ConfigError(
            f"checkpoint.resume: {path} belongs to another preset: {diff[0]}{more}; resume with the checkpoint's "
            "settings (its config is in meta.json) or start a new output_dir"
        )
