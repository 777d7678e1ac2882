"""Loading the Flux transformer straight into ZeRO-3 shards: one host copy per node, not one per process.

`from_pretrained` on every rank makes each process hold the whole transformer in host memory before
`deepspeed.initialize` partitions it: FLUX.1-dev in bf16 is ~24 GB, so 8 ranks need ~190 GB of host RAM just to
start. Here the model is built inside `deepspeed.zero.Init` (every parameter is partitioned the moment its module is
constructed, and random initialisation is skipped), then filled module by module: all ranks enter
`GatheredParameters(module params, modifier_rank=0)`, rank 0 copies the module's tensors in from the safetensors shards,
read lazily with `safe_open` (only that module's bytes are touched), and on exit DeepSpeed broadcasts rank 0's values
and re-partitions. A node's memory therefore peaks at the ranks' partitions (one copy in all) plus one module per
rank, and the result is bit-identical to `from_pretrained(..., dtype=dtype)` (same tensors, same cast).

Parameters built outside zero.Init (LoRA adapters added afterwards) are converted by `deepspeed.initialize`,
which broadcasts them from rank 0, so `add_adapter` keeps working on a model loaded here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from grpo.errors import ConfigError

log = logging.getLogger(__name__)

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"


def checkpoint_files(folder: str | Path) -> dict[str, Path]:
    """Map every tensor name of a diffusers model folder to the safetensors file that holds it.

    Args:
        folder: the model's folder (e.g. `<pipeline>/transformer`), single-file or sharded with an index json.

    Raises:
        ConfigError: no safetensors weights in the folder.
    """
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(folder / WEIGHTS, framework="pt") as f:
            return {name: folder / WEIGHTS for name in f.keys()}
    raise ConfigError(
        f"model.path: {folder} has neither {WEIGHTS} nor {INDEX}; convert the weights to safetensors or set "
        "model.zero_init=false to load them with from_pretrained on every process"
    )


def _fill_units(model: nn.Module) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """(full name, parameter) groups filled under one gather: each module's own parameters. The largest FLUX.1-dev
    module (a 3072 x 12288 MLP projection, 75 MB in bf16) bounds the transient memory of the fill."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        unit = [(prefix + n, p) for n, p in module.named_parameters(recurse=False)]
        if unit:
            yield unit


def _read(files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """Read `names` from their shards; each file is opened (memory-mapped) only for the duration of the read so
    that the touched pages do not stay resident."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    out = {}
    for file, keys in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for k in keys:
                out[k] = f.get_tensor(k)
    return out


def _check_shapes(files: dict[str, Path], shapes: dict[str, tuple[int, ...]], folder: Path) -> None:
    """Every rank checks the shapes from the safetensors headers first: an error raised by rank 0 alone inside a
    gather would leave the other ranks waiting in the collective."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for n in shapes:
        by_file.setdefault(files[n], []).append(n)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for n in names:
                shape = tuple(f.get_slice(n).get_shape())
                if shape != shapes[n]:
                    raise ConfigError(f"model.path: {n} has shape {shape} in {folder} but {shapes[n]} in its "
                                      "config.json; the checkpoint does not match its config")


@torch.no_grad()
def fill_from_safetensors(model: nn.Module, folder: str | Path) -> None:
    """Copy the checkpoint in `folder` into a model built under `deepspeed.zero.Init` (collective: all ranks).

    Raises:
        ConfigError: the checkpoint misses a parameter of the model or has a different shape for it (raised on
            every rank, before any collective).
    """
    import deepspeed
    import torch.distributed as dist

    files = checkpoint_files(folder)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(files))
    if missing:
        raise ConfigError(f"model.path: {folder} lacks {len(missing)} transformer weight(s), e.g. {missing[0]}; "
                          "the checkpoint does not match its config.json")
    unexpected = sorted(set(files) - set(params) - {n for n, _ in model.named_buffers()})
    if unexpected:
        log.warning("%s: %d checkpoint tensor(s) not used by the model, e.g. %s", folder, len(unexpected),
                    unexpected[0])
    _check_shapes(files, {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in params.items()}, folder)
    rank0 = dist.get_rank() == 0
    for unit in _fill_units(model):
        with deepspeed.zero.GatheredParameters([p for _, p in unit], modifier_rank=0):
            if rank0:  # the other ranks take rank 0's values in the broadcast on exit
                tensors = _read(files, [n for n, _ in unit])
                for n, p in unit:
                    p.copy_(tensors[n])
                del tensors
    buffers = [n for n, _ in model.named_buffers() if n in files]  # not partitioned by ZeRO: every rank reads them
    for n, t in _read(files, buffers).items():
        model.get_buffer(n).copy_(t)


def load_transformer_zero3(path: str, dtype: torch.dtype, ds_config: dict):
    """The family's transformer from `<path>/transformer`, partitioned by ZeRO-3 as it is built (collective).

    Args:
        path: a local diffusers pipeline folder (see grpo.inputs.resolve_model_path).
        dtype: the precision of `ds_config` (zero.Init takes the dtype from the config; they must agree).
        ds_config: the filled DeepSpeed config (grpo.inputs.load_ds_config), stage 3.

    Returns:
        The model in eval mode, as from_pretrained returns it; its parameters are ZeRO-3 partitions.
    """
    import deepspeed
    from diffusers.models.modeling_utils import no_init_weights

    from grpo.engine import precision
    from grpo.models import family_of

    if precision(ds_config) != dtype:
        raise ValueError(f"dtype {dtype} differs from the DeepSpeed precision {precision(ds_config)}")
    folder = Path(path) / "transformer"
    cls = family_of(path).transformer_class()
    config = cls.load_config(folder)
    # no_init_weights: the random init would be overwritten anyway (and costs minutes at 12B on a CPU).
    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=ds_config, mem_efficient_linear=False):
        model = cls.from_config(config)
    fill_from_safetensors(model, folder)
    return model.eval()


def transformer_loader(zero_init: bool, ds_config: dict) -> Callable[[str, torch.dtype], nn.Module]:
    """The recipe's transformer loader: sharded (zero.Init + safetensors) or from_pretrained on every rank."""
    if zero_init:
        return lambda path, dtype: load_transformer_zero3(path, dtype, ds_config)
    from grpo.models import family_of

    return lambda path, dtype: family_of(path).load_transformer(path, dtype)
