"""Finding reward-model files in a local folder or a Hugging Face hub repo, offline-aware.

A `source` is either a local folder laid out like the hub repo (the files at the same relative paths) or a hub id
"org/name". Files of a hub id are taken from the Hugging Face cache (`cache_dir` or HF_HUB_CACHE); they are
downloaded only when HF_HUB_OFFLINE is unset. A file that cannot be found raises ConfigError naming the file, where
it was looked for and the command that fetches it, so a run fails at start-up instead of after its first rollout.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from grpo.errors import ConfigError

__all__ = ["FileRef", "hub_offline", "is_local", "locate", "cache_location"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileRef:
    """A file a reward needs.

    Attributes:
        setting: the option that names the source, e.g. "rewards.hpsv2.repo" (used in messages).
        source: local folder or hub id.
        filenames: acceptable file names relative to the source, preferred first (e.g. safetensors before .bin).
        hub_hint: the canonical hub repo of this file, for the "how to get it" hint when `source` is a folder.
    """

    setting: str
    source: str
    filenames: tuple[str, ...]
    hub_hint: str | None = None


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set; read at call time (huggingface_hub reads it once, at import)."""
    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().upper() in ("1", "ON", "YES", "TRUE")
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def is_local(source: str) -> bool:
    """A source is local when it exists on disk or is written as a path; otherwise it is a hub id ("org/name")."""
    if os.path.exists(os.path.expanduser(source)):
        return True
    return source.startswith(("/", "./", "../", "~", ".\\")) or source.count("/") > 1 or "\\" in source


def cache_location(cache_dir: str | None) -> str:
    """The hub cache folder files are looked up in."""
    if cache_dir:
        return str(Path(cache_dir).expanduser())
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _names(ref: FileRef) -> str:
    return " or ".join(ref.filenames)


def _from_cache(repo: str, names: tuple[str, ...], cache_dir: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    for name in names:
        found = try_to_load_from_cache(repo, name, cache_dir=cache_dir)
        if isinstance(found, str) and os.path.isfile(found):
            return Path(found)
    return None


def locate(ref: FileRef, cache_dir: str | None = None, *, download: bool) -> Path | None:
    """Finds the file of `ref`.

    Args:
        ref: what to find.
        cache_dir: hub cache folder (None = HF_HUB_CACHE).
        download: False for start-up checks (never touches the network); True when loading.

    Returns:
        The path of the first name that exists. None only when download=False and the file of a hub id is not
        cached yet but may be downloaded at load time (HF_HUB_OFFLINE unset).

    Raises:
        ConfigError: the file is missing from a local folder, or from the cache while offline, or its download failed.
    """
    if is_local(ref.source):
        folder = Path(ref.source).expanduser()
        for name in ref.filenames:
            if (folder / name).is_file():
                return folder / name
        hint = ref.hub_hint or "ORG/NAME"
        raise ConfigError(
            f"{ref.setting}: {_names(ref)} not found in local folder {folder}; get it with "
            f"`hf download {hint} {ref.filenames[0]} --local-dir {folder}`"
        )
    found = _from_cache(ref.source, ref.filenames, cache_dir)
    if found is not None:
        return found
    where = cache_location(cache_dir)
    fetch = f"`hf download {ref.source} {ref.filenames[0]}" + (f" --cache-dir {where}`" if cache_dir else "`")
    if hub_offline():
        raise ConfigError(
            f"{ref.setting}: {_names(ref)} of hub repo {ref.source} is not in the Hugging Face cache {where} and "
            f"HF_HUB_OFFLINE is set; get it with {fetch} (or `hf download {ref.source} {ref.filenames[0]} "
            f"--local-dir DIR` and set {ref.setting}: DIR), or unset HF_HUB_OFFLINE"
        )
    if not download:
        logger.info("%s: %s of %s is not cached in %s yet; it will be downloaded at load time",
                    ref.setting, _names(ref), ref.source, where)
        return None
    from huggingface_hub import hf_hub_download

    errors = []
    for name in ref.filenames:
        try:
            return Path(hf_hub_download(ref.source, name, cache_dir=cache_dir))
        except Exception as err:  # noqa: BLE001 - the next alternative may exist; all failures are reported below
            errors.append(f"{name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    raise ConfigError(
        f"{ref.setting}: could not download {_names(ref)} from hub repo {ref.source} into {where} "
        f"({'; '.join(errors)}); download it with {fetch} or point {ref.setting} at a local folder"
    )
