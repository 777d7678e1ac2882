"""LoRA files other tools read and write: ComfyUI's native format (export), and an existing LoRA to start a run from.

**ComfyUI's format** is kohya sd-scripts' (``lora_unet_<BFL module, dots as underscores>.lora_down.weight`` /
``.lora_up.weight`` / ``.alpha``) on Black Forest Labs' module names, which ComfyUI's FLUX models use for FLUX.1,
Kontext and FLUX.2 alike: ComfyUI maps every ``diffusion_model.X.weight`` of the model to the LoRA key
``lora_unet_{X with . -> _}`` and scales by ``alpha / lora_down.shape[0]`` (comfyanonymous/ComfyUI@41444b5
comfy/lora.py, model_lora_keys_unet and load_lora). BFL's modules fuse what diffusers splits: a double block's
``img_attn.qkv`` is diffusers' to_q/to_k/to_v, FLUX.1's single-block ``linear1`` is to_q/to_k/to_v/proj_mlp.

The specification is the inverse of diffusers 0.42's own readers, which are also the test's reader
(diffusers/loaders/lora_conversion_utils.py): ``_convert_kohya_flux_lora_to_diffusers`` (FLUX.1, Kontext; line 380)
and ``_convert_kohya_flux2_lora_to_diffusers`` (FLUX.2; line 2596). A fused module is written block-diagonally:
lora_down = the parts' lora_A stacked along the rank (k*r rows), lora_up = block_diag(parts' lora_B) and
alpha = k * alpha, so alpha / rank stays alpha / r. The readers' ``_convert_to_ai_toolkit_cat`` (lines 402 and
2617; the sparse test at 437 and 2649) take the "sparse" branch exactly then (rank divisible by k and every
off-diagonal block of lora_up zero): lora_down is chunked into the k parts' lora_A, and lora_up's diagonal blocks
are the parts' lora_B, so the round trip is exact (only alpha / rank is folded into lora_A by the reader, a
multiplication). A part the run did not train (proj_mlp of
FLUX.1's linear1 when lora.target_modules leaves it out) is a zero block: its reconstructed adapter adds nothing.

diffusers' FLUX.1 reader splits linear1 with FLUX.1-dev's sizes written into it ([3072, 3072, 3072, 12288], line
552), so it reads a FLUX.1 file whose single blocks carry q/k/v only at the real model's width (ComfyUI reads any);
FLUX.2's reader sizes the split from the file. diffusers' FLUX.2 ``diffusion_model.`` reader
(``_convert_non_diffusers_flux2_lora_to_diffusers``, line 2434) copies one lora_A to q, k and v (ai-toolkit's shared
down projection), so it would read our separate q/k/v adapters only at rank 3r; the kohya names carry them at r.
FLUX.1's final_layer is left out: diffusers' reader drops its alpha ("TODO: alphas") and swaps its scale and shift.
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpo.errors import ConfigError

# beside diffusers' pytorch_lora_weights.safetensors, which load_lora_weights(folder) picks when a folder holds both
COMFYUI_FILE = "comfyui_lora.safetensors"



def _groups(transformer: torch.nn.Module, family) -> list[tuple[str, list[str]]]:
    """(kohya module name, the diffusers modules it fuses) for every BFL module of `transformer`, from its family's
    table (ModelFamily.comfyui_modules)."""
    table = family.comfyui_modules
    if table is None:
        raise ConfigError(f"export.formats: comfyui is not written for {family.name}; export diffusers only")
    blocks = {"double_blocks_{i}_": len(transformer.transformer_blocks),
              "single_blocks_{i}_": len(transformer.single_transformer_blocks), "": 1}
    return [("lora_unet_" + kohya.format(i=i) + name, [prefix.format(i=i) + p for p in parts])
            for kohya, (prefix, entries) in table.items() for i in range(blocks[kohya]) for name, parts in entries]


def to_comfyui(state: dict[str, torch.Tensor], transformer: torch.nn.Module, alpha: float,
               family) -> dict[str, torch.Tensor]:
    """PEFT-named adapter weights (`...to_q.lora_A.weight`) -> ComfyUI's kohya/BFL keys, fused modules block-diagonal.

    Args:
        state: adapter weights without the adapter name (grpo.engine.lora_state_dict, tools.export).
        transformer: the model (the meta-device one will do): its class picks the names, its layers' sizes fill the
            zero blocks of untrained parts of a fused module.
        alpha: lora.alpha (one for every adapter).
        family: the model family (grpo/models/), whose comfyui_modules name BFL's modules.
    """
    trained = {k.rsplit(".lora_", 1)[0] for k in state}
    out, placed = {}, set()
    for kohya, parts in _groups(transformer, family):
        if not trained.intersection(parts):
            continue
        like = state[f"{next(p for p in parts if p in trained)}.lora_A.weight"]
        rank = like.shape[0]
        downs, ups = [], []
        for p in parts:
            if p in trained:
                downs.append(state[f"{p}.lora_A.weight"])
                ups.append(state[f"{p}.lora_B.weight"])
            else:  # not trained: a zero block of the same rank, so the reader's split stays the sparse, exact one
                layer = transformer.get_submodule(p)
                downs.append(like.new_zeros(rank, layer.in_features))
                ups.append(like.new_zeros(layer.out_features, rank))
        if any(d.shape[0] != rank for d in downs):
            raise ConfigError(f"export.formats comfyui: {kohya} fuses {parts} of different ranks")
        out[f"{kohya}.lora_down.weight"] = torch.cat(downs).contiguous()
        out[f"{kohya}.lora_up.weight"] = torch.block_diag(*ups).contiguous()
        out[f"{kohya}.alpha"] = torch.tensor(float(alpha) * len(parts))  # fp32 whatever the weights' dtype
        placed.update(p for p in parts if p in trained)
    unplaced = sorted(trained - placed)
    if unplaced:
        raise ConfigError(f"export.formats comfyui: no ComfyUI name for the adapters of {unplaced[0]} (and "
                          f"{len(unplaced) - 1} more); drop it from lora.target_modules or export diffusers only")
    return out


def comfyui_metadata(lora: dict) -> dict[str, str]:
    """kohya sd-scripts' training metadata that LoRA tools show (network module, dim, alpha)."""
    return {"ss_network_module": "networks.lora_flux", "ss_network_dim": str(int(lora["rank"])),
            "ss_network_alpha": str(float(lora["alpha"]))}


def write_comfyui(state: dict[str, torch.Tensor], transformer: torch.nn.Module, lora: dict,
                  out_dir: str | Path, family) -> Path:
    """`out_dir`/comfyui_lora.safetensors: the adapters in ComfyUI's native format (ComfyUI/models/loras/)."""
    from safetensors.torch import save_file

    path = Path(out_dir) / COMFYUI_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(to_comfyui(state, transformer, lora["alpha"], family), str(path), metadata=comfyui_metadata(lora))
    return path


# ------------------------------------------------------------------------------------- starting from a LoRA
def _scale_of_kohya(raw: dict[str, torch.Tensor]) -> set[float]:
    """alpha / rank of every kohya module (alpha = rank when absent, as the readers assume)."""
    scales = set()
    for key, down in raw.items():
        if key.endswith(".lora_down.weight"):
            alpha = raw.get(key.removesuffix(".lora_down.weight") + ".alpha")
            scales.add(round((down.shape[0] if alpha is None else float(alpha)) / down.shape[0], 6))
    return scales


def read_lora(path: str | Path, family) -> tuple[dict[str, torch.Tensor], set[float]]:
    """An existing LoRA file (or a diffusers LoRA folder) as PEFT-named adapter weights (fp32), through diffusers'
    own readers (the family pipeline's lora_state_dict), and the alpha / rank scales it was trained with.

    ComfyUI/kohya files: their `.alpha` keys are read here and left out of what the reader sees, so that it folds no
    scale into lora_A and the tensors come back bit for bit (the fused modules through its exact "sparse" split).
    """
    from safetensors.torch import load_file

    p = Path(path)
    file = p / "pytorch_lora_weights.safetensors" if p.is_dir() else p
    if not file.is_file():
        raise ConfigError(f"lora.init_from: {path} is not a LoRA .safetensors file or a folder holding "
                          "pytorch_lora_weights.safetensors")
    raw = load_file(str(file))
    reader = family.pipeline_class()
    if any(k.endswith(".lora_down.weight") for k in raw):
        scales = _scale_of_kohya(raw)
        try:
            state = reader.lora_state_dict({k: v for k, v in raw.items() if not k.endswith(".alpha")})
        except (AssertionError, ValueError) as e:
            raise ConfigError(f"lora.init_from: {file} is not a {family.name} LoRA diffusers can read "
                              f"({type(e).__name__}: {str(e)[:120]})") from None
    else:
        state, adapter = reader.lora_state_dict(str(file.parent), weight_name=file.name, return_lora_metadata=True)
        # save_lora_weights prefixes the adapter's LoraConfig kwargs with the component ("transformer.lora_alpha");
        # without them diffusers builds the adapter with alpha = rank, a scale of 1
        adapter = adapter or {}
        alpha = adapter.get("transformer.lora_alpha", adapter.get("lora_alpha"))
        ranks = {v.shape[0] for k, v in state.items() if "lora_A" in k}
        scales = {round((r if alpha is None else float(alpha)) / r, 6) for r in ranks}
    state = {k.removeprefix("transformer."): v.float() for k, v in state.items()}
    # a zero lora_B adapts nothing: a fused module's untrained part (proj_mlp beside q/k/v) reads back as one
    modules = {k.rsplit(".lora_", 1)[0] for k in state}
    zero = {m for m in modules if not state[f"{m}.lora_B.weight"].any()}
    return {k: v for k, v in state.items() if k.rsplit(".lora_", 1)[0] not in zero}, scales


def expected_adapter(transformer: torch.nn.Module) -> dict[str, torch.Size]:
    """The adapter's weights in PEFT naming (no adapter name) and their shapes."""
    return {n.replace(".default", ""): p.shape for n, p in transformer.named_parameters() if "lora_" in n}


def check_init_lora(state: dict[str, torch.Tensor], scales: set[float], expected: dict[str, torch.Size],
                    lora, path: str) -> None:
    """lora.init_from must be an adapter of the same targets, rank and alpha: one line when it is not."""
    where = f"lora.init_from: {path}"
    want = round(lora.alpha / lora.rank, 6)
    if scales != {want}:
        raise ConfigError(f"{where} scales by alpha/rank {sorted(scales)}, but lora.alpha/lora.rank is {want}; "
                          "set lora.alpha and lora.rank to the file's")
    missing = sorted({k.rsplit(".lora_", 1)[0] for k in set(expected) - set(state)})
    extra = sorted({k.rsplit(".lora_", 1)[0] for k in set(state) - set(expected)})
    if missing or extra:
        name = (missing or extra)[0]
        what = "has no adapter for" if missing else "adapts a module lora.target_modules leaves out:"
        raise ConfigError(f"{where} {what} {name} ({len(missing)} missing, {len(extra)} extra); set "
                          "lora.target_modules to the file's")
    for k, shape in expected.items():
        if state[k].shape != shape:
            rank = state[k].shape[0] if "lora_A" in k else state[k].shape[1]
            raise ConfigError(f"{where} has rank {rank} at {k.rsplit('.lora_', 1)[0]}, but lora.rank is "
                              f"{lora.rank}")


def init_lora_state(path: str, family, transformer: torch.nn.Module, lora) -> dict[str, torch.Tensor]:
    """The checked weights of lora.init_from for `transformer` (whose adapter is added; the meta model will do)."""
    state, scales = read_lora(path, family)
    check_init_lora(state, scales, expected_adapter(transformer), lora, path)
    return state


def _meta_with_adapter(model_path: str, family, lora) -> torch.nn.Module:
    from peft import LoraConfig as PeftLoraConfig

    transformer = family.meta_transformer(model_path)
    transformer.add_adapter(PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, init_lora_weights=lora.init,
                                           target_modules=lora.target_modules))
    return transformer


def check_init_lora_on_config(model_path: str, family, lora) -> None:
    """Before any weight is loaded: lora.init_from read and checked against the adapter on the meta model."""
    init_lora_state(lora.init_from, family, _meta_with_adapter(model_path, family, lora), lora)


def load_init_lora(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into the transformer's adapter (before deepspeed.initialize, so that ZeRO-3's fp32 master
    partitions start from it; GatheredParameters gathers adapters already partitioned by zero.Init, and every rank
    copies the same file, so rank 0's broadcast changes nothing)."""
    import deepspeed

    params = {n.replace(".default", ""): p for n, p in transformer.named_parameters() if "lora_" in n}
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
        for k, v in state.items():
            params[k].copy_(v.to(params[k].dtype))


def check_formats(formats: list[str], lora, family) -> None:
    unknown = [f for f in formats if f not in ("diffusers", "comfyui")]
    if unknown or not formats:
        raise ConfigError(f"export.formats: {formats}; use a list of diffusers and comfyui")
    if "comfyui" in formats and lora is None:
        raise ConfigError("export.formats: comfyui is a LoRA format, and this run is a full fine-tune (lora: null)")
    if "comfyui" in formats and family.comfyui_modules is None:
        raise ConfigError(f"export.formats: comfyui is not written for {family.name}; export diffusers only")
