"""Model FLOPs utilisation (grpo/perf.py): the forward's FLOPs from torch's counter on the meta device against a
closed form of FLUX.1's transformer, the counter's attention term on every family, the per-phase arithmetic against
the rollout plan (true CFG's doubling included), the device peak table and its override."""

import json

import pytest

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.models import family_of
from grpo.perf import Throughput, forward_flops, peak_tflops
from grpo.rollout_plan import RolloutPlan
from tests import ROOT, TINY, TINY_FLUX2, TINY_FLUX3, TINY_KONTEXT


def flux1_closed_form(c: dict, image_tokens: int, text_tokens: int) -> int:
    """FLUX.1's transformer (diffusers' FluxTransformer2DModel) by hand: 2·in·out per row of every Linear (bias adds
    are not model FLOPs) and 2·T²·D for each of attention's two matmuls (scores, then values), written from the
    model's structure, not from the counter: the per-sample modulation and embedding Linears see one row, the
    double-stream blocks' image and text Linears their own tokens, the single-stream blocks every token."""
    d = c["num_attention_heads"] * c["attention_head_dim"]
    s, txt, t = image_tokens, text_tokens, image_tokens + text_tokens
    lin = lambda rows, i, o: 2 * rows * i * o  # noqa: E731
    attention = 4 * t * t * d
    embed = (lin(1, 256, d) + lin(1, d, d)) * (1 + bool(c["guidance_embeds"]))  # timestep (and guidance) embedders
    embed += lin(1, c["pooled_projection_dim"], d) + lin(1, d, d)  # the pooled CLIP projection
    embed += lin(txt, c["joint_attention_dim"], d) + lin(s, c["in_channels"], d)  # context and x embedders
    double = (2 * lin(1, d, 6 * d)  # norm1 and norm1_context: AdaLayerNormZero's modulation
              + 4 * lin(s, d, d) + 4 * lin(txt, d, d)  # q, k, v, out of each stream
              + 2 * (lin(s, d, 4 * d) + lin(txt, d, 4 * d))  # the two feed-forwards' up and down
              + attention)
    single = lin(1, d, 3 * d) + lin(t, d, 4 * d) + 3 * lin(t, d, d) + lin(t, 5 * d, d) + attention
    out = lin(1, d, 2 * d) + lin(s, d, c["patch_size"] ** 2 * (c["out_channels"] or c["in_channels"]))
    return embed + c["num_layers"] * double + c["num_single_layers"] * single + out


@pytest.mark.parametrize("image_tokens,text_tokens", [(64, 16), (256, 32), (2 * 256, 32)])
def test_counter_on_meta_equals_flux1_closed_form(image_tokens, text_tokens):
    config = json.loads((TINY / "transformer" / "config.json").read_text())
    assert forward_flops(family_of(TINY), TINY, image_tokens, text_tokens) == flux1_closed_form(config, image_tokens,
                                                                                                text_tokens)


@pytest.mark.parametrize("path", [TINY, TINY_KONTEXT, TINY_FLUX2, TINY_FLUX3], ids=["flux1", "kontext", "flux2",
                                                                                      "flux3"])
def test_counter_works_on_every_family_and_sees_its_attention(path):
    """Every family's transformer runs on the meta device under the counter, and its count grows with the tokens as
    attention does: the second difference in the image tokens is attention's alone, 2 matmuls x 2·d²·D per layer
    (every Linear is linear in the tokens and drops out)."""
    if not (path / "transformer" / "config.json").exists():
        pytest.skip(f"{path.name} not built")
    c = json.loads((path / "transformer" / "config.json").read_text())
    family, step = family_of(path), 16
    f = [forward_flops(family, path, 64 + k * step, 16) for k in range(3)]
    layers, width = c["num_layers"] + c["num_single_layers"], c["num_attention_heads"] * c["attention_head_dim"]
    assert f[2] - 2 * f[1] + f[0] == 2 * 4 * step**2 * width * layers
    assert f[0] > 0


def test_phases_split_the_plans_forwards_and_true_cfg_doubles_both():
    preset = ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml"
    off, on = RolloutPlan.of(load_config(preset)), RolloutPlan.of(load_config(preset, ["sampling.true_cfg.scale=4.0"]))
    for step in (0, 3):
        plain, guided = off.phase_forwards(step), on.phase_forwards(step)
        assert sum(plain.values()) == off.forwards_per_image(step)
        assert plain == {"rollout": off.rollout_calls(None), "update": off.trained_per_trajectory * 3}
        assert guided == {k: 2 * v for k, v in plain.items()}
    # nft: the update phase also runs the lagging policy's no-grad forward per trained point (+1), and with KL the
    # reference's (+1); the rollout samples with the lagging weights, once per step
    nft = ROOT / "recipes/configs/tiny/nft_lora.yaml"
    for kl, per_point in (("0.0", 4), ("1e-4", 5)):
        plan = RolloutPlan.of(load_config(nft, [f"nft.kl_coef={kl}"]))
        assert plan.phase_forwards(0) == {"rollout": plan.rollout_calls(None),
                                          "update": plan.trained_per_trajectory * per_point}


def test_throughput_metrics_are_flops_over_time_per_device_and_over_the_peak():
    t = Throughput(forward_flops=2 * 10**12, peak_tflops=100.0, world_size=4)
    m = t.metrics({"rollout": 8.0, "update": 6.0}, images=16, seconds={"rollout": 2.0, "update": 4.0})
    assert m == {"perf/tflops/rollout": 8 * 2 * 16 / 2 / 4, "perf/mfu/rollout": 0.32,
                 "perf/tflops/update": 6 * 2 * 16 / 4 / 4, "perf/mfu/update": 0.12}
    unknown = Throughput(forward_flops=2 * 10**12, peak_tflops=None, world_size=4)
    assert set(unknown.metrics({"rollout": 8.0}, 16, {"rollout": 2.0})) == {"perf/tflops/rollout"}


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5),
                                       ("NVIDIA H100 NVL", 835.5), ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.5),
                                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
                                       ("NVIDIA H20", 148.0), ("Ascend910B2C", 353.9), ("Ascend910B2", None),
                                       ("Ascend910B3", None), ("AMD EPYC 7763 64-Core Processor", None),
                                       ("Intel(R) Xeon(R) Platinum 8480+", None), ("NVIDIA GeForce RTX 4090", None)])
def test_peak_table(name, peak):
    found, source = peak_tflops(name)
    assert found == peak
    if peak is None:
        assert "perf.peak_tflops" in source and "\n" not in source


def test_override_wins_and_is_checked():
    assert peak_tflops("Intel(R) Xeon(R)", 1.5) == (1.5, "perf.peak_tflops")
    assert peak_tflops("NVIDIA H100 80GB HBM3", 500.0)[0] == 500.0
    assert load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", ["perf.peak_tflops=2.0"]).perf.peak_tflops == 2.0
    with pytest.raises(ConfigError, match=r"^perf.peak_tflops: must be > 0, got 0.0; .*$"):
        load_config(ROOT / "recipes/configs/tiny/grpo_lora.yaml", ["perf.peak_tflops=0"])
