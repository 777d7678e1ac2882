"""Typed settings: dataclasses whose fields carry their own help and rules, built from YAML with one-line errors.

Both the recipe config (grpo/config.py) and each reward's options (grpo/rewards/options.py) are declared with
:func:`setting`, so a wrong reward option reads like a wrong recipe setting, and `--help` lists both from the same
metadata. A field without a default is required: a preset that leaves it out is refused, naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
import types
import typing
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import yaml

from grpo.errors import ConfigError

__all__ = ["setting", "build", "coerce", "fields_along", "describe", "annotated", "read_yaml", "read_preset", "merge",
           "parse_value", "set_dotted"]


def setting(default: Any = MISSING, *, help: str, resume: str = "fixed", path: bool = False,
            choices: tuple[Any, ...] | None = None, factory: Any = None) -> Any:
    """A schema field. No `default` (and no `factory`) = required.

    Args:
        help: one line, shown by --help and appended to errors about this setting.
        resume: "free" if the setting may differ when a checkpoint is resumed (it does not shape the training math).
        path: the value names a file or folder (the same place spelled differently is the same setting).
        choices: the accepted values, checked after the type.
        factory: builds the default of a section (a dataclass) or another mutable value.
    """
    if resume not in ("free", "fixed"):
        raise ValueError(f"resume must be free or fixed, got {resume!r}")
    meta = {"help": help, "resume": resume, "path": path, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _required(f: dataclasses.Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, accepts None) for `X | None`."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), type(None) in typing.get_args(tp)
    return tp, False


def _is_union(tp: Any) -> bool:
    return isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def type_label(tp: Any) -> str:
    inner, optional = _split_optional(tp)
    if _is_section(inner):
        label = "section"
    elif _is_union(inner):
        label = " or ".join(type_label(a) for a in typing.get_args(inner))
    elif typing.get_origin(inner) in (list, dict):
        label = f"{typing.get_origin(inner).__name__}[{', '.join(type_label(a) for a in typing.get_args(inner))}]"
    else:
        label = getattr(inner, "__name__", str(inner))
    return f"{label} or null" if optional else label


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def coerce(value: Any, tp: Any, key: str, hint: str = "") -> Any:
    """`value` (from YAML) as type `tp`, or ConfigError naming `key` (with `hint`, the setting's help, appended)."""
    why = f"; {hint}" if hint else ""
    inner, optional = _split_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: may not be null; give {_EXPECTED.get(inner, type_label(inner))}{why}")
    if _is_section(inner):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of settings, got {value!r}{why}")
        return build(inner, value, key)
    if _is_union(inner):
        for option in typing.get_args(inner):
            try:
                return coerce(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {type_label(inner)}, got {value!r}{why}")
    origin = typing.get_origin(inner)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}{why}")
        (item_tp,) = typing.get_args(inner)
        return [coerce(v, item_tp, f"{key}[{i}]", hint) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}{why}")
        return dict(value)
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}.get(inner)
    if ok is None:
        return value
    if inner is float and isinstance(value, str) and value.strip().lower().lstrip("+-.") in ("inf", "infinity", "nan"):
        raise ConfigError(f"{key}: must be a finite number, got {value}{why}")
    if not ok(value):
        raise ConfigError(f"{key}: expected {_EXPECTED[inner]}, got {value!r}{why}")
    if inner is float:
        value = float(value)
        if not math.isfinite(value):  # .inf/.nan in YAML: no setting means anything with them
            raise ConfigError(f"{key}: must be a finite number, got {value}{why}")
    return value


def build(cls: type, raw: dict[str, Any], prefix: str = "", source: str | None = None) -> Any:
    """An instance of the dataclass `cls` from `raw`: unknown, missing, mistyped and out-of-choice keys refused.

    `source` names the file in "missing" errors.
    """
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    unknown = [k for k in raw if k not in names]
    if unknown:
        where = f"{prefix}." if prefix else ""
        under = f" under {prefix}" if prefix else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown setting; valid keys{under}: {', '.join(names)}")
    kwargs = {}
    for f in fields:
        key = f"{prefix}.{f.name}" if prefix else f.name
        help_ = f.metadata.get("help", "")
        if f.name not in raw:
            if _required(f):
                raise ConfigError(f"{key}: missing from {source or 'the config'}; add it ({help_})")
            continue
        if _is_section(_split_optional(hints[f.name])[0]) and isinstance(raw[f.name], dict):
            kwargs[f.name] = build(_split_optional(hints[f.name])[0], raw[f.name], key, source)
            continue
        value = coerce(raw[f.name], hints[f.name], key, help_)
        choices = f.metadata.get("choices")
        if choices is not None and value is not None and value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}; {help_}")
        kwargs[f.name] = value
    return cls(**kwargs)


def fields_along(cls: type, dotted: str) -> list[dataclasses.Field]:
    """The schema fields a dotted key passes through (`sampling.eta` -> [sampling, eta]); stops where the schema does
    (a dict such as `rewards`, or an unknown key)."""
    out = []
    for part in dotted.split("."):
        if not _is_section(cls):
            break
        found = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        if found is None:
            break
        out.append(found)
        cls = _split_optional(typing.get_type_hints(cls)[part])[0]
    return out


def _default_text(f: dataclasses.Field) -> str:
    if _required(f):
        return "required"
    value = f.default if f.default is not MISSING else f.default_factory()
    if dataclasses.is_dataclass(value):
        return "may be left out"
    return "default " + yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("\n...")


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per setting of `cls` (sections recursed): `key (type; required|default X) help [may change on resume]`."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        inner, optional = _split_optional(hints[f.name])
        free = " [may change on resume]" if f.metadata.get("resume") == "free" else ""
        label = "section" if _is_section(inner) else type_label(hints[f.name])
        if f.metadata.get("choices"):
            label = " | ".join(map(str, f.metadata["choices"])) + (" or null" if optional else "")
        lines.append(f"  {key} ({label}; {_default_text(f)}): {f.metadata.get('help', '')}{free}")
        if _is_section(inner):
            lines += describe(inner, key)
    return lines


def _yaml_scalar(value: Any) -> str:
    """`value` (a scalar or a list) as YAML flow text that loads back to it."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip().removesuffix(
        "\n...").strip()


def annotated(obj: Any, order: list[str] | None = None, indent: int = 0, width: int = 118) -> list[str]:
    """The settings of the dataclass instance `obj` as YAML lines, each key under its help text as a comment (sections
    recursed), so that the text loads back to the same settings. A top-level section that is null by default and null
    here is left out, as a preset leaves it out (a section its settings do not use). `order`: the top-level keys in
    the order to print them (others after them)."""
    lines = []
    pad = "  " * indent
    hints = typing.get_type_hints(type(obj))
    fields = dataclasses.fields(obj)
    if order is not None:
        fields = sorted(fields, key=lambda f: order.index(f.name) if f.name in order else len(order))
    for f in fields:
        value = getattr(obj, f.name)
        inner, _ = _split_optional(hints[f.name])
        if indent == 0 and value is None and _is_section(inner) and f.default is None:
            continue
        note = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            note += "; one of " + " | ".join(map(str, f.metadata["choices"]))
        if f.metadata.get("resume") == "free":
            note += " [may change on resume]"
        if indent == 0 and (dataclasses.is_dataclass(value) or isinstance(value, dict) or value is None) and lines:
            lines.append("")  # a blank line between top-level sections, as in a preset
        lines += [f"{pad}# {text}" for text in textwrap.wrap(note, max(40, width - len(pad) - 2))]
        if dataclasses.is_dataclass(value):
            lines += [f"{pad}{f.name}:", *annotated(value, None, indent + 1, width)]
        elif isinstance(value, dict) and value:
            block = yaml.safe_dump(value, default_flow_style=False, width=10_000, sort_keys=False).splitlines()
            lines += [f"{pad}{f.name}:", *(f"{pad}  {line}" for line in block)]
        else:
            lines.append(f"{pad}{f.name}: {_yaml_scalar(value)}")
    return lines


# ------------------------------------------------------------------------------------------------------ YAML input


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(key, line, first)
        self.key, self.line, self.first = key, line, first


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML keeps the last silently) and reads 1e-4 as a number (YAML 1.1
    wants a dot: 1.0e-4), so a preset means what it looks like.

    Not ruamel.yaml: its YAML 1.2 reads yes/no/on/off as text, 010 as 10; its duplicate-key error lacks the first line.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, line, seen[key])
                seen[key] = line
            except TypeError:  # an unhashable key: SafeLoader reports it
                pass
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_value(text: str) -> Any:
    """An override's value as YAML (`1e-4` a number, `[2, 3]` a list); text that is not YAML stays text."""
    if text == "":
        return None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 -- a SafeLoader subclass
    except _DuplicateKey as e:
        raise ConfigError(f"override value {text!r}: key {e.key!r} given twice; keep one") from None
    except yaml.YAMLError:
        return text


def read_yaml(path: Path) -> Any:
    """The YAML document in `path`; one-line ConfigError for a non-UTF-8 file, bad syntax or a duplicate key."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config: {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 -- a SafeLoader subclass
    except _DuplicateKey as e:
        raise ConfigError(f"config: {path} line {e.line}: key {e.key!r} is already set at line {e.first}; "
                          "keep one") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"config: {path} is not valid YAML{where}; fix the syntax") from None


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """`overlay` deep-merged over `base` (neither is changed): mappings merge key by key; anything else (a scalar, a
    list, null) replaces, so `lora: null` drops a whole section and `target_modules: [...]` replaces the list."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_preset(path: Path, swap: dict[Path, Path] | None = None) -> dict[str, Any]:
    """The settings of the preset in `path` with its `extends:` resolved, deep-merged by :func:`merge`.

    `extends:` names one file (`extends: base.yaml`) or an ordered list (`extends: [base.yaml,
    ../objectives/grpo.yaml]`), each a path relative to the file, each of which may extend others. The files are
    merged depth-first: a list's first entry (with what it extends) first, later ones over it, the file itself last.
    A file reached twice through different entries (two objective files over one shared.yaml, a diamond) is merged
    once, where it is first reached: merged again it would undo what the entries between set over it.

    `swap` ({file: replacement}, compared resolved): wherever the chain reaches a file of `swap`, its replacement is
    read instead, so that a preset is resolved on another model base (tiny/mixgrpo_lora.yaml with tiny_flux2/base.yaml
    for tiny/base.yaml is MixGRPO on the tiny FLUX.2 world).

    Each file is read by :func:`read_yaml` (duplicate keys refused per file). A cycle (a file reached again along one
    chain of extends), a missing or non-mapping file, or an `extends` entry that is not a path is a one-line
    ConfigError naming the file and the fix.
    """
    swap = {Path(k).resolve(): Path(v) for k, v in (swap or {}).items()}
    layers: list[dict[str, Any]] = []
    merged: set[Path] = set()  # the files merged so far, resolved

    def visit(current: Path, named_by: Path | None, named_as: str | None, chain: list[tuple[Path, str]]) -> None:
        """Merge `current`'s bases, then `current`; `chain`: the files (resolved, as named) whose extends led here."""
        current = swap.get(current.resolve(), current)
        if not current.is_file():
            if named_by is None:
                raise ConfigError(f"config: {current} does not exist; pass a preset such as "
                                  "recipes/configs/tiny/grpo_lora.yaml")
            raise ConfigError(f"config: {named_by}: extends: {named_as} does not exist ({current}); give the path of "
                              f"a preset relative to {named_by.parent}")
        resolved = current.resolve()
        if any(resolved == seen for seen, _ in chain):
            loop = " -> ".join([*(name for _, name in chain), str(current)])
            raise ConfigError(f"config: {named_by}: extends makes a cycle ({loop}); remove the extends that closes "
                              "the loop")
        if resolved in merged:
            return
        loaded = read_yaml(current)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            if named_by is None:
                raise ConfigError(f"config: {current} must be a mapping of settings at the top level")
            raise ConfigError(f"config: {current} (extended by {named_by}) must be a mapping of settings at the top "
                              "level; point extends at a preset")
        bases = loaded.pop("extends", None)
        for base in [] if bases is None else bases if isinstance(bases, list) and bases else [bases]:
            if not isinstance(base, str) or not base.strip():
                raise ConfigError(f"config: {current}: extends: expected the path of a preset relative to the file, "
                                  f"or a list of them (e.g. extends: [base.yaml, ../objectives/grpo.yaml]), got "
                                  f"{base!r}")
            visit(current.parent / base, current, base, [*chain, (resolved, str(current))])
        merged.add(resolved)
        layers.append(loaded)

    visit(Path(path), None, None, [])
    raw: dict[str, Any] = {}
    for layer in layers:  # depth-first: the farthest base first, the file itself last
        raw = merge(raw, layer)
    return raw


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = {}
            node[part] = child
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{part}' is not a section, so it has no sub-keys")
        node = child
    node[parts[-1]] = value
