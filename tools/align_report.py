"""Align dumps and their comparison: the safetensors file one side writes, the errors of A against B, the table.

Used by tools.align (``--compare A B`` and the A/B mode); imports neither the recipe nor DeepSpeed, so two dumps
can be compared on any machine with torch and safetensors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
# Train-step statistics compared as scalars (whatever the recipe's update returns is kept in the dump).
TRAIN_STATS = ("loss", "grad_norm", "approx_kl", "clip_frac", "ratio_mean", "ratio_max_dev", "kl")


class AlignError(RuntimeError):
    """A side failed to run, or two dumps cannot be compared."""


# ================================================================================================ dumps
def save_dump(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """One safetensors file: the tensors and ``meta`` as JSON under the header key ``align``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    own, seen = {}, set()
    for key, tensor in tensors.items():  # safetensors refuses tensors that share storage: copy the repeats
        tensor = tensor.detach().cpu().contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        own[key] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    save_file(own, str(path), metadata={"align": json.dumps(meta)})


@dataclass
class Dump:
    """One side, as read back from its file."""

    path: str
    tensors: dict[str, torch.Tensor]
    meta: dict

    def blocks(self) -> dict[tuple[int, str], list[torch.Tensor]]:
        """(step, module) -> its recorded outputs in order."""
        out: dict[tuple[int, str], list[tuple[int, torch.Tensor]]] = {}
        for key, tensor in self.tensors.items():
            if key.startswith("block/"):
                _, step, module, index = key.split("/")
                out.setdefault((int(step), module), []).append((int(index), tensor))
        return {k: [t for _, t in sorted(v, key=lambda item: item[0])] for k, v in out.items()}

    def weights(self, kind: str) -> dict[str, torch.Tensor]:
        prefix = f"weight_{kind}/"
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}


def load_dump(path: str | Path) -> Dump:
    """Reads a dump written by :func:`save_dump`.

    Raises:
        AlignError: The file is missing or is not an align dump.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise AlignError(f"{path}: no such dump; write one with `python -m tools.align CONFIG --dump {path}`")
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata() or {}
    if "align" not in header:
        raise AlignError(f"{path}: not an align dump (no 'align' metadata in its safetensors header)")
    meta = json.loads(header["align"])
    if meta.get("format") != FORMAT_VERSION:
        raise AlignError(f"{path}: dump format {meta.get('format')}, this tool reads {FORMAT_VERSION}; re-dump it")
    return Dump(str(path), load_file(str(path)), meta)


# ================================================================================================ comparison
@dataclass
class Err:
    """Error of A against B: rel = ||a - b|| / ||b||, max_abs = max |a - b| (computed in float64 on the host)."""

    rel: float
    max_abs: float

    @classmethod
    def of(cls, a: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | Sequence[torch.Tensor]) -> Err:
        a_list = [a] if isinstance(a, torch.Tensor) else list(a)
        b_list = [b] if isinstance(b, torch.Tensor) else list(b)
        if len(a_list) != len(b_list) or any(x.shape != y.shape for x, y in zip(a_list, b_list)):
            raise AlignError(f"shape mismatch: {[tuple(x.shape) for x in a_list]} vs {[tuple(y.shape) for y in b_list]}")
        diff2 = ref2 = 0.0
        max_abs = 0.0
        for x, y in zip(a_list, b_list):
            x, y = x.double(), y.double()
            d = x - y
            diff2 += float(d.pow(2).sum())
            ref2 += float(y.pow(2).sum())
            if d.numel():
                max_abs = max(max_abs, float(d.abs().max()))
        return cls(rel=_ratio(math.sqrt(diff2), math.sqrt(ref2)), max_abs=max_abs)


def _ratio(num: float, den: float) -> float:
    if num == 0:
        return 0.0
    return num / den if den > 0 else math.inf


@dataclass
class Comparison:
    """Everything the table shows, as plain data (``to_json``)."""

    a: dict
    b: dict
    differences: list[tuple[str, Any, Any]]
    record_steps: list[int]
    block_samples: list[int]
    num_samples: int
    blocks: dict[str, dict[int, Err]]  # module -> step -> error
    outputs: dict[str, Err]
    reward_mean: tuple[float, float, float]  # A, B, relative error of the mean
    images: dict[str, float]
    train: dict[str, tuple[float, float]]  # stat -> (A, B)
    weights: dict[str, Err] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        def err(e: Err) -> dict:
            return {"rel": e.rel, "max_abs": e.max_abs}

        return {
            "a": self.a, "b": self.b,
            "differences": [list(d) for d in self.differences],
            "record_steps": self.record_steps, "block_samples": self.block_samples, "num_samples": self.num_samples,
            "blocks": {m: {str(s): err(e) for s, e in by_step.items()} for m, by_step in self.blocks.items()},
            "outputs": {k: err(e) for k, e in self.outputs.items()},
            "reward_mean": {"a": self.reward_mean[0], "b": self.reward_mean[1], "rel": self.reward_mean[2]},
            "images": self.images,
            "train": {k: {"a": a, "b": b} for k, (a, b) in self.train.items()},
            "weights": {k: err(e) for k, e in self.weights.items()},
            "notes": self.notes,
        }


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def _side_summary(meta: dict, path: str) -> dict:
    return {"path": path, "device": meta["device"], "device_name": meta.get("device_name", ""),
            "world_size": meta["world_size"], "dtype": meta["dtype"], "attention_backend": meta["attention_backend"],
            "deepspeed_config": meta["config"]["deepspeed"]["config"], "host": meta.get("host", ""),
            "versions": meta.get("versions", {})}


def compare(a: Dump, b: Dump, pixel_tol: float = 1 / 255) -> Comparison:
    """Compares side A against side B (the reference).

    Args:
        a: One side.
        b: The reference side.
        pixel_tol: A pixel agrees when all its channels differ by at most this (images in [0, 1]).

    Raises:
        AlignError: The dumps hold different samples or shapes (different batch, resolution or step settings).
    """
    ma, mb = a.meta, b.meta
    if ma["num_samples"] != mb["num_samples"] or ma["samples_per_step"] != mb["samples_per_step"]:
        raise AlignError(
            f"A recorded {ma['num_samples']} of {ma['samples_per_step']} samples, B {mb['num_samples']} of "
            f"{mb['samples_per_step']}; run both sides with the same batch settings and --samples"
        )
    if ma["block_samples"] != mb["block_samples"]:
        raise AlignError(
            f"A recorded blocks of samples {ma['block_samples']}, B of {mb['block_samples']}; use the same "
            "batch.micro_batch_size on both sides"
        )
    fa, fb = _flatten(ma["config"]), _flatten(mb["config"])
    skip = {"output_dir"}
    differences = [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb))
                   if k not in skip and fa.get(k) != fb.get(k)]
    for key in ("device", "world_size", "dtype", "model_fingerprint"):
        if ma.get(key) != mb.get(key):
            differences.append((key, ma.get(key), mb.get(key)))
    notes = []
    if ma.get("model_fingerprint") != mb.get("model_fingerprint"):
        notes.append("the sides loaded different transformer weights (model_fingerprint): the errors measure the "
                     "weights, not the numerics")

    blocks_a, blocks_b = a.blocks(), b.blocks()
    steps = sorted({s for s, _ in blocks_a} & {s for s, _ in blocks_b})
    modules = [m for m in ma["modules"] if m in mb["modules"]]
    blocks: dict[str, dict[int, Err]] = {}
    for module in modules:
        for step in steps:
            if (step, module) in blocks_a and (step, module) in blocks_b:
                blocks.setdefault(module, {})[step] = Err.of(blocks_a[(step, module)], blocks_b[(step, module)])
    if set(ma["modules"]) != set(mb["modules"]):
        notes.append("the sides' transformers have different modules; only common ones are compared")

    ta, tb = a.tensors, b.tensors
    outputs = {
        "final latent x_T": Err.of(ta["latents"][:, -1], tb["latents"][:, -1]),
        "predicted x0 (decoded)": Err.of(ta["x0"], tb["x0"]),
        "latents x_1..x_T": Err.of(ta["latents"][:, 1:], tb["latents"][:, 1:]),
        "log-prob (rollout)": Err.of(ta["log_probs"], tb["log_probs"]),
        "reward (per sample)": Err.of(ta["rewards"], tb["rewards"]),
        "advantage": Err.of(ta["advantages"], tb["advantages"]),
        "image": Err.of(ta["images"], tb["images"]),
    }
    ra, rb = float(ta["rewards"].double().mean()), float(tb["rewards"].double().mean())
    reward_mean = (ra, rb, _ratio(abs(ra - rb), abs(rb)))

    ia, ib = ta["images"].double(), tb["images"].double()
    mse = float((ia - ib).pow(2).mean())
    within = float(((ia - ib).abs() <= pixel_tol + 1e-12).all(dim=1).double().mean())
    images = {"psnr_db": math.inf if mse == 0 else 10 * math.log10(1.0 / mse), "within_tol": within,
              "pixel_tol": pixel_tol, "max_abs": outputs["image"].max_abs}

    sa, sb = ma.get("stats", {}), mb.get("stats", {})
    train = {k: (sa[k], sb[k]) for k in TRAIN_STATS if k in sa and k in sb}

    weights: dict[str, Err] = {}
    before_a, before_b = a.weights("before"), b.weights("before")
    after_a, after_b = a.weights("after"), b.weights("after")
    common = sorted(set(before_a) & set(before_b) & set(after_a) & set(after_b))
    if common:
        weights["trainable weights before the step"] = Err.of([before_a[n] for n in common],
                                                             [before_b[n] for n in common])
        weights["weight update (after - before)"] = Err.of(
            [after_a[n].double() - before_a[n].double() for n in common],
            [after_b[n].double() - before_b[n].double() for n in common],
        )
        weights["trainable weights after the step"] = Err.of([after_a[n] for n in common],
                                                            [after_b[n] for n in common])
    else:
        notes.append(f"weights not compared (A: {ma.get('weights')}, B: {mb.get('weights')}, "
                     f"{len(common)} common names)")
    return Comparison(a=_side_summary(ma, a.path), b=_side_summary(mb, b.path), differences=differences,
                      record_steps=steps, block_samples=ma["block_samples"], num_samples=ma["num_samples"],
                      blocks=blocks, outputs=outputs,
                      reward_mean=reward_mean, images=images, train=train, weights=weights, notes=notes)


# ================================================================================================ table
def _num(x: float) -> str:
    if x == 0:
        return "0"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.3e}"


def _describe(side: dict) -> str:
    return (f"{side['device']} ({side['device_name']}), {side['world_size']} process(es), {side['dtype']}, "
            f"attention {side['attention_backend']}, {side['deepspeed_config']}  [{Path(side['path']).name}]")


def format_table(c: Comparison) -> str:
    """The comparison as a text table (what the CLI prints)."""
    lines = [f"A: {_describe(c.a)}", f"B: {_describe(c.b)}  <- reference"]
    if c.differences:
        lines.append("settings that differ: " + "; ".join(f"{k}: {va} | {vb}" for k, va, vb in c.differences))
    else:
        lines.append("settings that differ: none")
    lines.append("errors of A against B: rel = ||a-b|| / ||b||, max = max |a-b|")
    lines.append("")

    ids = c.block_samples
    lines.append(f"block outputs during the rollout, rank 0's first micro-batch (global samples {ids[0]}..{ids[-1]})")
    width = max([len("module")] + [len(m) for m in c.blocks])
    head = f"{'module':<{width}}" + "".join(f"  {f'step {s} rel':>12} {f'step {s} max':>12}" for s in c.record_steps)
    lines += [head, "-" * len(head)]
    for module, by_step in c.blocks.items():
        cells = "".join(
            f"  {_num(by_step[s].rel):>12} {_num(by_step[s].max_abs):>12}" if s in by_step else f"  {'-':>12} {'-':>12}"
            for s in c.record_steps
        )
        lines.append(f"{module:<{width}}{cells}")
    lines.append("")

    lines.append(f"the step: {c.num_samples} trajectories and images (all ranks), update, weights")
    width = max(len(k) for k in [*c.outputs, *c.weights, "quantity"])
    head = f"{'quantity':<{width}}  {'rel':>12} {'max':>12}"
    lines += [head, "-" * len(head)]
    for name, e in [*c.outputs.items(), *c.weights.items()]:
        lines.append(f"{name:<{width}}  {_num(e.rel):>12} {_num(e.max_abs):>12}")
    lines.append("")
    ra, rb, rel = c.reward_mean
    lines.append(f"reward relative error (step mean): {_num(rel)} = {100 * rel:.4f}%   (A {ra:.6f}, B {rb:.6f})")
    lines.append(f"reward relative error (per sample, ||a-b||/||b||): {_num(c.outputs['reward (per sample)'].rel)} = "
                 f"{100 * c.outputs['reward (per sample)'].rel:.4f}%")
    im = c.images
    psnr = "inf (identical)" if math.isinf(im["psnr_db"]) else f"{im['psnr_db']:.2f} dB"
    lines.append(f"images: PSNR {psnr}; {100 * im['within_tol']:.2f}% of pixels within {im['pixel_tol']:.4g} "
                 f"(max |a-b| {_num(im['max_abs'])})")
    if c.train:
        lines.append("train step: " + "; ".join(
            f"{k} A {va:.6g} B {vb:.6g}" for k, (va, vb) in c.train.items()))
    lines += [f"note: {n}" for n in c.notes]
    return "\n".join(lines)


