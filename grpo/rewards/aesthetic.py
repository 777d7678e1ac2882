"""LAION aesthetic predictor (christophschuhmann/improved-aesthetic-predictor, Apache-2.0).

An MLP on the L2-normalised OpenAI CLIP ViT-L/14 image embedding (prompt-free), as in its `simple_inference.py` and
Flow-GRPO's `aesthetic` reward: Linear(768, 1024) -> Dropout -> Linear(1024, 128) -> Dropout -> Linear(128, 64) ->
Dropout -> Linear(64, 16) -> Linear(16, 1), no activations in the linearMSE heads, state-dict keys
layers.{0,2,4,6,7}.{weight,bias}. The layer sizes are read from the file, so any head of this shape loads. Scores
are on the AVA 1-10 scale (about 4-7 for typical images).

The CLIP backbone is open_clip ViT-L-14 with the `openai` tag (the weights of `clip.load("ViT-L/14")`, QuickGELU),
preprocessed like OpenAI CLIP: shortest side to 224 bicubic, centre crop, OpenAI mean/std. The MLP stays float32
whatever `dtype` says (it is tiny and its inputs are normalised embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo.errors import ConfigError
from grpo.rewards.hub import FileRef, locate
from grpo.rewards.openclip_loader import OpenClipReward, first_line
from grpo.rewards.options import OpenClipOptions
from grpo.schema import setting

__all__ = ["AestheticReward", "AestheticOptions", "AestheticMLP", "MLP_KEYS"]

MLP_REPO = "camenduru/improved-aesthetic-predictor"
MLP_FILE = "sac+logos+ava1-l14-linearMSE.pth"
MLP_KEYS = tuple(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))


class AestheticMLP(nn.Module):
    """The predictor's MLP, sized from a state dict (Dropout p as in the original; inactive in eval mode)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        d0, d1, d2, d3, d4, d5 = sizes
        self.layers = nn.Sequential(
            nn.Linear(d0, d1), nn.Dropout(0.2), nn.Linear(d1, d2), nn.Dropout(0.2), nn.Linear(d2, d3),
            nn.Dropout(0.1), nn.Linear(d3, d4), nn.Linear(d4, d5),
        )

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor], source: str) -> AestheticMLP:
        missing = [k for k in MLP_KEYS if k not in state]
        extra = [k for k in state if k not in MLP_KEYS]
        if missing or extra:
            raise ConfigError(f"{source}: expected the linearMSE head keys layers.{{0,2,4,6,7}}.{{weight,bias}}, "
                              f"missing {missing[:4]}, unexpected {extra[:4]}")
        sizes = [state["layers.0.weight"].shape[1]] + [state[f"layers.{i}.weight"].shape[0] for i in (0, 2, 4, 6, 7)]
        mlp = cls(sizes)
        mlp.load_state_dict(state, strict=True)
        return mlp

    def forward(self, embeddings: Tensor) -> Tensor:
        return self.layers(embeddings)


@dataclass(kw_only=True)
class AestheticOptions(OpenClipOptions):
    model: str = setting("ViT-L-14", help="open_clip architecture of the CLIP backbone")
    pretrained: str = setting("openai", help="open_clip tag, hf-hub:ORG/NAME, local open_clip folder or file")
    mlp_repo: str = setting(MLP_REPO, help="hub id or local folder holding the MLP head")
    mlp_filename: str = setting(MLP_FILE, help="MLP head file (.pth state dict or .safetensors)")


class AestheticReward(OpenClipReward):
    """LAION aesthetic score (prompt-free) of each image."""

    DESCRIPTION = "LAION aesthetic MLP (sac+logos+ava1-l14-linearMSE) on normalised CLIP ViT-L/14 embeddings; ~1-10"
    OPTIONS = AestheticOptions

    @classmethod
    def _extra_files(cls, options: dict[str, Any], setting: str) -> list[FileRef]:
        return [FileRef(f"{setting}.mlp_repo", options["mlp_repo"], (options["mlp_filename"],), hub_hint=MLP_REPO)]

    def _load_extra(self, options: dict[str, Any], setting: str) -> None:
        path = locate(self._extra_files(options, setting)[0], self.cache_dir, download=True)
        try:
            if path.suffix == ".safetensors":
                from safetensors.torch import load_file

                state = load_file(str(path))
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle.UnpicklingError (weights_only), safetensors errors, OSError, EOFError, ...
            raise ConfigError(f"{setting}.mlp_filename: cannot read the MLP head {path} ({first_line(err)}); "
                              f"give the linearMSE head as a .pth state dict or .safetensors") from err
        if not isinstance(state, dict):
            raise ConfigError(f"{setting}.mlp_filename: {path} holds a {type(state).__name__}, not a state dict")
        self.mlp = AestheticMLP.from_state_dict(state, f"{setting}.mlp_filename ({path})")
        embed_dim = self.model.visual.output_dim
        if self.mlp.layers[0].in_features != embed_dim:
            raise ConfigError(f"{setting}: the MLP head takes {self.mlp.layers[0].in_features}-d embeddings but "
                              f"{options['model']} gives {embed_dim}-d; use the head trained on this CLIP")

    def modules(self) -> list[nn.Module]:
        return [self.model, self.mlp]

    def place(self) -> None:
        super().place()
        self.mlp.float()

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        embeddings = self.model.encode_image(self.preprocess(images).to(self.dtype)).float()
        return self.mlp(F.normalize(embeddings, dim=-1)).squeeze(-1)
