"""open_clip models for the CLIP-family rewards (HPS v2, CLIP score, the aesthetic predictor's backbone).

Where the weights come from (`pretrained` option):
- an open_clip tag of `model` (e.g. ViT-H-14 + laion2b_s32b_b79k, ViT-L-14 + openai): the tag's hub repo, with the
  tag's QuickGELU flag and preprocessing (mean/std, resize mode);
- "hf-hub:org/name" or a local folder laid out like an open_clip hub repo: open_clip_config.json (which names the
  architecture; `model` is then ignored) + open_clip_model.safetensors or open_clip_pytorch_model.bin;
- a local checkpoint file for `model`: the QuickGELU flag and preprocessing of the open_clip tag it holds, found in
  open_clip's pretrained table (`pretrained_tag`, else the tag whose download file has this file's name, else the
  settings all tags of `model` share); `quick_gelu` overrides the flag; an ambiguous file is a ConfigError.

The model is built without weights, then the checkpoint is loaded strictly (safetensors, or torch.load with
weights_only=True, through open_clip.load_checkpoint).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo.errors import ConfigError
from grpo.rewards.base import ModelReward, unique_prompts
from grpo.rewards.hub import FileRef, is_local, locate
from grpo.rewards.preprocess import normalize, resize_longest_pad, resize_shortest_center_crop, squash

__all__ = ["OpenClipPlan", "OpenClipReward", "check_arch", "plan_open_clip", "register_model_config", "load_open_clip",
           "clip_preprocess", "first_line", "pil_transform"]

logger = logging.getLogger(__name__)

CONFIG_NAME = "open_clip_config.json"
WEIGHT_NAMES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
HF_PREFIX = "hf-hub:"


@dataclass(frozen=True)
class OpenClipPlan:
    """How to build one open_clip model, decided without loading anything.

    Attributes:
        model: open_clip architecture name (unused when `config` is set).
        weights: the checkpoint file.
        config: open_clip_config.json of a hub repo or folder, which names the architecture, or None.
        quick_gelu: force QuickGELU (OpenAI and DFN weights were trained with it).
        preprocess: preprocessing overrides (mean, std, interpolation, resize_mode) from the pretrained tag.
    """

    model: str
    weights: FileRef
    config: FileRef | None = None
    quick_gelu: bool = False
    preprocess: dict[str, Any] = field(default_factory=dict)

    def files(self) -> list[FileRef]:
        return [self.config, self.weights] if self.config is not None else [self.weights]


def register_model_config(path: str | None, model: str, setting: str) -> None:
    """Registers an open_clip model-config JSON (an architecture not shipped with open_clip, e.g. a tiny test one).

    The architecture is registered under the file's stem, which must equal `model`.
    """
    if path is None:
        return
    import open_clip

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{setting}.model_config: file {p} not found; give an open_clip model-config JSON")
    if p.stem != model:
        raise ConfigError(f"{setting}.model_config: registers architecture {p.stem!r} but {setting}.model is "
                          f"{model!r}; set {setting}.model: {p.stem}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{setting}.model_config: {p} is not valid JSON ({err})") from err
    if not all(k in cfg for k in ("embed_dim", "vision_cfg", "text_cfg")):
        raise ConfigError(f"{setting}.model_config: {p} lacks embed_dim/vision_cfg/text_cfg; not an open_clip config")
    if model not in open_clip.list_models():
        open_clip.add_model_config(p)


def check_arch(model: str, setting: str) -> None:
    import open_clip

    if model not in open_clip.list_models():
        raise ConfigError(f"{setting}.model: unknown open_clip architecture {model!r}; use a name from "
                          f"open_clip.list_models() (e.g. ViT-H-14, ViT-L-14) or register one with "
                          f"{setting}.model_config")


def _tag_settings(cfg: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    return bool(cfg.get("quick_gelu", False)), {k: cfg[k] for k in ("mean", "std", "interpolation", "resize_mode")
                                                 if k in cfg}


def _file_names(cfg: dict[str, Any]) -> set[str]:
    """The file names a tag's checkpoint is downloaded as (URL and hub file; not the generic hub names)."""
    names = {cfg.get("url", "").rsplit("/", 1)[-1]}
    hub = cfg.get("hf_hub", "")
    if hub and not hub.endswith("/"):
        names.add(hub.rsplit("/", 1)[1])
    return names - {"", *WEIGHT_NAMES}


def _local_file_plan(model: str, path: Path, where: str, tag: str | None, quick_gelu: bool | None) -> OpenClipPlan:
    """QuickGELU and preprocessing of a local checkpoint file for `model`, from open_clip's pretrained table."""
    import open_clip

    setting = where.rsplit(".", 1)[0]
    ref = FileRef(where, str(path.parent), (path.name,))
    tags = {t: open_clip.get_pretrained_cfg(model, t) for t in open_clip.list_pretrained_tags_by_model(model)}
    if tag is not None:
        if tag not in tags:
            raise ConfigError(f"{setting}.pretrained_tag: {tag!r} is not an open_clip tag of {model} "
                              f"(tags: {', '.join(tags) or 'none'})")
        chosen = [tag]
    else:
        chosen = [t for t, cfg in tags.items() if path.name in _file_names(cfg)]
        if not chosen:
            chosen = [t for t, cfg in tags.items() if quick_gelu is None or _tag_settings(cfg)[0] == quick_gelu]
    settings = {repr(_tag_settings(tags[t])): _tag_settings(tags[t]) for t in chosen}
    if len(settings) > 1:
        raise ConfigError(f"{where}: local file {path.name} could hold the weights of open_clip tags of {model} with "
                          f"different QuickGELU/preprocessing ({', '.join(chosen)}); set {setting}.pretrained_tag "
                          f"to its tag (or {setting}.quick_gelu: true|false if that decides it)")
    gelu, preprocess = next(iter(settings.values())) if settings else (False, {})
    return OpenClipPlan(model, ref, quick_gelu=gelu if quick_gelu is None else quick_gelu, preprocess=preprocess)


def plan_open_clip(model: str, pretrained: str, setting: str, pretrained_tag: str | None = None,
                   quick_gelu: bool | None = None) -> OpenClipPlan:
    """Decides architecture, files and preprocessing for (`model`, `pretrained`); see the module docstring.

    Args:
        model: open_clip architecture name.
        pretrained: tag, "hf-hub:org/name", local folder or local checkpoint file.
        setting: e.g. "rewards.clip_score" (messages name `<setting>.pretrained`).
        pretrained_tag: for a local checkpoint file, the open_clip tag whose weights it holds.
        quick_gelu: force QuickGELU on or off (None: open_clip's table / the folder's config decides).

    Raises:
        ConfigError: unknown architecture or tag, a tag without a hub location, a local file matching tags of
            different settings.
    """
    import open_clip

    where = f"{setting}.pretrained"
    if pretrained.startswith(HF_PREFIX):
        repo = pretrained[len(HF_PREFIX):]
        return OpenClipPlan(model, FileRef(where, repo, WEIGHT_NAMES), FileRef(where, repo, (CONFIG_NAME,)),
                            quick_gelu=bool(quick_gelu))
    if is_local(pretrained):
        p = Path(pretrained).expanduser()
        if p.is_file():
            check_arch(model, setting)
            return _local_file_plan(model, p, where, pretrained_tag, quick_gelu)
        # A folder laid out like an open_clip hub repo (or a missing path, reported by the file check).
        return OpenClipPlan(model, FileRef(where, str(p), WEIGHT_NAMES), FileRef(where, str(p), (CONFIG_NAME,)),
                            quick_gelu=bool(quick_gelu))
    check_arch(model, setting)
    cfg = open_clip.get_pretrained_cfg(model, pretrained)
    if not cfg:
        tags = open_clip.list_pretrained_tags_by_model(model)
        raise ConfigError(f"{where}: {pretrained!r} is not an open_clip tag of {model} "
                          f"(tags: {', '.join(tags) or 'none'}), nor hf-hub:ORG/NAME, nor a local folder or file")
    hub = cfg.get("hf_hub", "")
    if not hub:
        raise ConfigError(f"{where}: tag {pretrained!r} of {model} has no Hugging Face location; download "
                          f"{cfg.get('url', 'the checkpoint')} and set {where} to the file")
    # open_clip's convention: "org/name/" = default file names, "org/name/file.pt" = that file.
    if hub.endswith("/"):
        repo, names = hub.rstrip("/"), WEIGHT_NAMES
    else:
        repo, filename = hub.rsplit("/", 1)
        safe = filename.rsplit(".", 1)[0] + ".safetensors"
        names = (safe, filename) if filename.endswith((".bin", ".pth")) else (filename,)
    gelu, preprocess = _tag_settings(cfg)
    return OpenClipPlan(model, FileRef(where, repo, names, hub_hint=repo),
                        quick_gelu=gelu if quick_gelu is None else quick_gelu, preprocess=preprocess)


def load_open_clip(plan: OpenClipPlan, cache_dir: str | None, setting: str) -> tuple[nn.Module, Any]:
    """Builds the model on the CPU in float32 with its weights, and its tokenizer.

    Returns:
        (model, tokenizer): model.visual.preprocess_cfg holds the preprocessing; tokenizer(list[str]) -> [n, ctx].
    """
    import open_clip

    weights = locate(plan.weights, cache_dir, download=True)
    if plan.config is not None:
        config = locate(plan.config, cache_dir, download=True)
        name = "local-dir:" + str(config.parent)
    else:
        name = plan.model
    # load_weights=False: the checkpoint is loaded below from the file located above (never a second download).
    model = open_clip.create_model(
        name,
        pretrained=None,
        load_weights=False,
        force_quick_gelu=plan.quick_gelu,
        force_preprocess_cfg=plan.preprocess or None,
        output_dict=True,
    )
    try:
        open_clip.load_checkpoint(model, str(weights), strict=True, weights_only=True)
    except (RuntimeError, KeyError, ValueError) as err:
        raise ConfigError(f"{setting}: checkpoint {weights} does not fit open_clip model {name} ({first_line(err)}); "
                          f"check {setting}.model") from err
    except Exception as err:  # pickle.UnpicklingError (weights_only), safetensors errors, OSError, EOFError, ...
        raise ConfigError(f"{plan.weights.setting}: cannot read checkpoint {weights} ({first_line(err)}); "
                          f"is it a complete PyTorch or safetensors file?") from err
    tokenizer = open_clip.get_tokenizer(name)
    logger.info("open_clip %s loaded from %s", name, weights)
    return model, tokenizer


def first_line(err: BaseException) -> str:
    """'Type: first line of the message' of an exception, for one-line ConfigErrors."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def clip_preprocess(images: Tensor, cfg: dict[str, Any]) -> Tensor:
    """open_clip's eval transform (`image_transform_v2`) on tensors, from model.visual.preprocess_cfg."""
    size = cfg["size"]
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    interp = cfg.get("interpolation", "bicubic")
    mode = cfg.get("resize_mode", "shortest")
    if mode == "squash":
        x = squash(images, (h, w), interp)
    elif mode == "longest":
        x = resize_longest_pad(images, max(h, w), interp, fill=cfg.get("fill_color", 0) / 255.0, clamp=True)
    else:
        if h != w:
            raise ValueError("open_clip 'shortest' resize with a non-square size is not supported")
        x = resize_shortest_center_crop(images, h, (h, w), interp, crop_rounding="torchvision", clamp=True)
    return normalize(x, cfg["mean"], cfg["std"])


def pil_transform(images: Tensor, transform: Any) -> Tensor:
    """`transform` (PIL image -> [3, h, w]) on the uint8 PIL images of [B, 3, H, W] in [0, 1], back on their device."""
    from PIL import Image

    u8 = (images.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return torch.stack([transform(Image.fromarray(a)) for a in u8]).to(images.device)


class OpenClipReward(ModelReward):
    """An open_clip-backed reward (HPS, CLIP score, the aesthetic predictor): plan, start-up checks, loading.

    Subclasses choose the options (OPTIONS) and may override `_plan` (which files, which architecture), `_extra_files`
    and `_load_extra` (more than the CLIP model), `modules` and `score`.
    """

    @classmethod
    def _plan(cls, options: dict[str, Any], setting: str) -> OpenClipPlan:
        register_model_config(options["model_config"], options["model"], setting)
        return plan_open_clip(options["model"], options["pretrained"], setting, options.get("pretrained_tag"),
                              options.get("quick_gelu"))

    @classmethod
    def _extra_files(cls, options: dict[str, Any], setting: str) -> list[FileRef]:
        return []

    @classmethod
    def validate(cls, options: dict[str, Any], setting: str) -> None:
        cls._plan(options, setting)

    @classmethod
    def files(cls, options: dict[str, Any], setting: str) -> list[FileRef]:
        return cls._plan(options, setting).files() + cls._extra_files(options, setting)

    def __init__(self, name: str, device: torch.device, options: dict[str, Any]) -> None:
        super().__init__(name, device, options)
        setting = f"rewards.{name}"
        self.model, self.tokenizer = load_open_clip(self._plan(options, setting), self.cache_dir, setting)
        self.preprocess_cfg = dict(self.model.visual.preprocess_cfg)
        self._load_extra(options, setting)
        self.place()

    def _load_extra(self, options: dict[str, Any], setting: str) -> None:
        """Reads what the reward needs besides the CLIP model (before `place`)."""

    def modules(self) -> list[nn.Module]:
        return [self.model]

    def preprocess(self, images: Tensor) -> Tensor:
        """This model's open_clip eval transform on [B, 3, H, W] in [0, 1].

        With `quantize` (default) open_clip's own transform runs on the uint8 PIL images, on the CPU, as upstream
        does (its PIL resize rounds to uint8 after each pass, which no tensor resize reproduces); without it, our
        tensor version runs on the scoring device.
        """
        if not self.quantize:
            return clip_preprocess(images.float(), self.preprocess_cfg)
        return pil_transform(images, self._transform())

    def _transform(self) -> Any:
        if getattr(self, "_pil_transform", None) is None:
            from open_clip.transform import PreprocessCfg, image_transform_v2

            self._pil_transform = image_transform_v2(PreprocessCfg(**self.preprocess_cfg), is_train=False)
        return self._pil_transform

    def cosine(self, pixels: Tensor, prompts: list[str], device: torch.device) -> Tensor:
        """Cosine of the L2-normalised image and prompt embeddings ([b]); each distinct prompt is encoded once."""
        texts, inverse = unique_prompts(prompts)
        tokens = self.tokenizer(texts).to(device)
        image_features = F.normalize(self.model.encode_image(pixels).float(), dim=-1)
        text_features = F.normalize(self.model.encode_text(tokens).float(), dim=-1)
        return (image_features * text_features[inverse.to(device)]).sum(-1)
