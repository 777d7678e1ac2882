"""Prompt datasets: what `data.train_prompts` and `data.eval_prompts` name, read into prompts and per-sample metadata.

The path picks the format:

    *.jsonl      one JSON object a line: "prompt" (required), "image" or "images" (optional paths, relative to the
                 file, checked to be readable images and carried as absolute paths), any other field is metadata
    *.parquet    a table of the same columns (pyarrow, which `datasets` installs)
    a folder     what `datasets`' save_to_disk wrote (a Dataset, or a DatasetDict of one split)
    owner/name   a hub dataset's train split (owner/name:split for another), only with the hub online
    anything else, e.g. *.txt: one prompt per line, blank lines and lines starting with '#' skipped; no metadata

Row i's metadata (its fields other than the prompt) travels with prompt i, by global sample index, to the rewards
(grpo/rewards/base.py `Reward.score_samples`). It is re-read from the dataset at every start and never stored in the
embedding cache, which is keyed by the prompts alone: metadata does not change an embedding, so a .txt and a .jsonl
of the same prompts share one cache, and an edited metadata field can never be read stale from an old cache.

Every bad row fails at start-up, before any model loads, with one line naming the setting, the file, the row and the
fix: rows are "line N" (1-based, as an editor shows them) in text and JSON Lines files, "row N" (0-based, as
`dataset[N]` reads it) in tables.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["PromptSet", "read_prompt_set", "read_prompt_file", "row_images", "read_image", "IMAGE_FIELDS"]

IMAGE_FIELDS = ("image", "images")  # reference images of a row: paths, checked and made absolute
FORMATS = "a text file (one prompt per line), a .jsonl or .parquet file, a datasets save_to_disk folder or a hub id"


@dataclass
class PromptSet:
    """A dataset's prompts, each row's metadata (a JSON-able dict, {} for a text file) and its name in errors."""

    prompts: list[str]
    metadata: list[dict[str, Any]]
    rows: list[str]  # "line 3", "row 2": where each prompt came from, for start-up errors

    def __len__(self) -> int:
        return len(self.prompts)


Row = tuple[str, Any]  # (where, the parsed record)


def row_images(metadata: dict[str, Any]) -> list[str]:
    """The absolute image paths of a row's metadata: its "image" then its "images" (the reference or source images
    an image-conditioned family encodes, grpo/references.py)."""
    out: list[str] = []
    for field in IMAGE_FIELDS:
        value = metadata.get(field)
        out += [] if value is None else value if isinstance(value, list) else [value]
    return out


def read_image(path: str, size: int | None = None) -> torch.Tensor:
    """A row's image as float32 [3, H, W] in [0, 1] (RGB, as diffusers' load_image converts it), resized to
    size x size (bicubic, as the pipelines' image processors resize) when given."""
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        if size is not None and image.size != (size, size):
            image = image.resize((size, size), Image.BICUBIC)
        pixels = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


def read_prompt_file(path: str | Path, setting: str = "data.train_prompts") -> list[str]:
    """The prompts of a text file: one per line; blank lines and lines starting with '#' are skipped."""
    return _text(Path(path), setting).prompts


def read_prompt_set(source: str | Path, setting: str = "data.train_prompts") -> PromptSet:
    """Read and check `source` (see the module docstring for the formats); ConfigError names the first bad row."""
    path = Path(source)
    if path.is_dir():
        return _records(path, setting, _folder_rows(path, setting), base=path)
    reader = _TABLES.get(path.suffix.lower())
    if reader is None and not path.exists() and _looks_like_hub_id(str(source)):
        return _records(path, setting, _hub_rows(str(source), setting), base=Path.cwd())
    if reader is None:
        return _text(path, setting)
    if not path.is_file():
        raise ConfigError(f"{setting}: {path} does not exist; give {FORMATS}")
    return _records(path, setting, reader(path, setting), base=path.parent)


def _text(path: Path, setting: str) -> PromptSet:
    if not path.is_file():
        raise ConfigError(f"{setting}: {path} does not exist; give {FORMATS}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{setting}: {path} is not UTF-8 text; save it as UTF-8 with one prompt per line") from None
    if "\x00" in text:
        raise ConfigError(f"{setting}: {path} looks binary (NUL bytes); give a text file with one prompt per line")
    kept = [(f"line {n}", line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    kept = [(where, p) for where, p in kept if p and not p.startswith("#")]
    if not kept:
        raise ConfigError(f"{setting}: {path} holds no prompts; write one prompt per line")
    return PromptSet([p for _, p in kept], [{} for _ in kept], [where for where, _ in kept])


# --- the record formats: each yields (where, record); _records checks the records alike ---------------------------

def _jsonl_rows(path: Path, setting: str) -> Iterable[Row]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{setting}: {path} is not UTF-8 text; save it as UTF-8, one JSON object a line") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue  # a trailing newline or a spacer line holds no row
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{setting}: {path} line {n} is not valid JSON ({e.msg}); write one JSON object a "
                              f"line, e.g. {{\"prompt\": \"a red circle\"}}") from None


def _table_rows(columns: list[str], records: list[dict], path: Path, setting: str) -> Iterable[Row]:
    if "prompt" not in columns:
        raise ConfigError(f"{setting}: {path} has no 'prompt' column (columns: {', '.join(columns)}); name the "
                          f"prompt column 'prompt'")
    return ((f"row {i}", record) for i, record in enumerate(records))


def _parquet_rows(path: Path, setting: str) -> Iterable[Row]:
    # pyarrow (datasets' own reader) rather than Dataset.from_parquet, which converts the file into ~/.cache first,
    # one copy per process, with progress bars in every rank's log
    import pyarrow.parquet

    try:
        table = pyarrow.parquet.read_table(str(path))
    except Exception as e:  # noqa: BLE001 -- pyarrow's and datasets' errors alike become one line
        raise ConfigError(f"{setting}: {path} cannot be read as Parquet ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160] if str(e) else ''}); write it with pandas' or datasets' "
                          f"to_parquet") from None
    return _table_rows(table.column_names, table.to_pylist(), path, setting)


def _folder_rows(path: Path, setting: str) -> Iterable[Row]:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as e:  # noqa: BLE001 -- not a datasets folder, or a damaged one
        raise ConfigError(f"{setting}: {path} is a folder but not a datasets save_to_disk folder ({type(e).__name__});"
                          f" give {FORMATS}") from None
    if isinstance(dataset, datasets.DatasetDict):
        if len(dataset) != 1:
            raise ConfigError(f"{setting}: {path} holds the splits {', '.join(dataset)}; save the one to use alone, "
                              f"e.g. dataset['train'].save_to_disk(...)")
        dataset = next(iter(dataset.values()))
    return _table_rows(dataset.column_names, dataset.to_list(), path, setting)


def _looks_like_hub_id(text: str) -> bool:
    # A missing "prompts/train.txt" is a mistyped file, not a hub id
    name = text.split(":", 1)[0]
    return (name.count("/") == 1 and not name.startswith((".", "/")) and all(name.split("/"))
            and Path(name).suffix.lower() != ".txt")


def _hub_rows(source: str, setting: str) -> Iterable[Row]:
    name, _, split = source.partition(":")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise ConfigError(f"{setting}: {source} is no local file or folder, and HF_HUB_OFFLINE is set, so it is not "
                          f"read from the hub; save it locally (datasets' save_to_disk) or unset HF_HUB_OFFLINE")
    import datasets

    try:
        dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # noqa: BLE001 -- any hub failure becomes one actionable line
        raise ConfigError(f"{setting}: {source} is no local file or folder and could not be loaded from the hub "
                          f"({type(e).__name__}); check the id and split, or give {FORMATS}") from None
    return _table_rows(dataset.column_names, dataset.to_list(), Path(source), setting)


_TABLES: dict[str, Callable[[Path, str], Iterable[Row]]] = {".jsonl": _jsonl_rows, ".parquet": _parquet_rows}


# --- checks shared by the record formats ----------------------------------------------------------------------------

def _records(path: Path, setting: str, rows: Iterable[Row], base: Path) -> PromptSet:
    prompts, metadata, wheres = [], [], []
    for where, record in rows:
        at = f"{setting}: {path} {where}"
        if not isinstance(record, dict):
            raise ConfigError(f"{at} is not a JSON object; write {{\"prompt\": \"...\", ...}}")
        prompt = record.get("prompt")
        if prompt is None:
            raise ConfigError(f"{at} has no \"prompt\"; give every row its prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{at} has an empty prompt ({prompt!r}); give every row a non-empty text prompt")
        meta = {k: v for k, v in record.items() if k != "prompt"}
        for field in IMAGE_FIELDS:
            if meta.get(field) is not None:  # a table's null: this row has no image
                meta[field] = _images(meta[field], field, base, at)
        try:
            json.dumps(meta, allow_nan=False)  # metadata crosses to reward servers as JSON
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{at}: its metadata is not plain JSON data ({e}); keep to strings, numbers, "
                              f"booleans, lists and maps") from None
        prompts.append(prompt.strip())
        metadata.append(meta)
        wheres.append(where)
    if not prompts:
        raise ConfigError(f"{setting}: {path} holds no rows; give at least one row with a prompt")
    return PromptSet(prompts, metadata, wheres)


def _images(value: Any, field: str, base: Path, at: str) -> str | list[str]:
    """The row's image path(s) made absolute, each checked to open as an image (header and integrity, not decoded)."""
    paths = value if isinstance(value, list) else [value]
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise ConfigError(f"{at}: {field} must be a path or a list of paths relative to the dataset, got {value!r}; "
                          f"embedded images are not supported")
    resolved = [str((base / p).resolve()) for p in paths]
    for given, full in zip(paths, resolved):
        _check_image(given, full, at)
    return resolved if isinstance(value, list) else resolved[0]


def _check_image(given: str, full: str, at: str) -> None:
    from PIL import Image

    if not Path(full).is_file():
        raise ConfigError(f"{at}: image {given} does not exist ({full}); fix the path (relative to the dataset)")
    try:
        with Image.open(full) as image:
            image.verify()
    except Exception as e:  # noqa: BLE001 -- PIL's errors for unreadable or truncated files
        raise ConfigError(f"{at}: image {given} cannot be read as an image ({type(e).__name__}); replace the file "
                          f"or fix the path") from None
