"""The memory planner (tools/plan.py) against closed forms, and the memory levers it plans: every-k activation
checkpointing, the VAE's offload. Against a measurement, its command line and ZeRO-3 CPU offload run in processes:
tests/recipe/test_plan.py."""

import pytest
import torch

from benchmarks._common import build_transformer, transformer_config
from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.layout import derive_layout
from grpo.models.blocks import checkpointed_blocks, enable_checkpointing
from tools import plan as P
from tests import ROOT

TINY_LORA = str(ROOT / "recipes/configs/tiny/grpo_lora.yaml")


# ------------------------------------------------------------------------------------------------- model states
def test_model_states_closed_form():
    zero = {**P._ZERO_DEFAULTS, "stage3_param_persistence_threshold": 10}
    params = [(101, True), (10, True), (50, False)]  # 10 elements: persistent (whole on every rank)
    s = P.model_states(params, devices=2, b=2, zero=zero)
    parts_all, parts_train = 51 + 5 + 25, 51 + 5
    assert s["weights"] == parts_all * 2 + 10 * 2
    assert s["gradients"] == parts_train * 2
    assert s["master"] == parts_train * 4
    assert s["optimizer"] == parts_train * 8
    fp32 = P.model_states(params, devices=1, b=4, zero=zero)
    assert fp32["master"] == 4 * 111  # DeepSpeed keeps a separate fp32 master copy even in fp32 (measured)
    ref = P.model_states(params, devices=2, b=2, zero=zero, optimizer=False)
    assert ref["gradients"] == ref["optimizer"] == 0 and ref["weights"] == s["weights"]


def test_flux1_dev_config_is_shipped_and_has_12b_parameters():
    tcfg, vae = P.model_configs("black-forest-labs/FLUX.1-dev")
    model = P.meta_transformer(tcfg, torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 11_901_408_320
    assert vae["latent_channels"] == 16
    with pytest.raises(ConfigError, match="model.path"):
        P.model_configs("nobody/no-such-model")


@pytest.mark.parametrize("size", ["4B", "9B"])
def test_klein_base_ships_kleins_configs_and_family(size):
    """FLUX.2 [klein] base is the model klein was step-distilled from: the same transformer and VAE (the shipped
    configs; a downloaded folder's own are read first), the same family (Flux2KleinPipeline)."""
    from grpo.models.flux2 import FLUX2_KLEIN

    base = f"black-forest-labs/FLUX.2-klein-base-{size}"
    assert P.model_configs(base) == P.model_configs(f"black-forest-labs/FLUX.2-klein-{size}")
    assert P.model_family(base, P.model_configs(base)[0]) is FLUX2_KLEIN


def test_flux3_klein_base_config_is_shipped_with_the_real_parameter_count(tmp_path, monkeypatch):
    """FLUX 3 Image Klein base: diffusers 0.42.1's Flux3Transformer2DModel defaults, 5.54 B parameters on the meta
    device; its family from the shipped _pipeline offline, and from the modular pipeline's index (a FLUX.3 folder has
    no model_index.json) once the configs are in the Hugging Face cache."""
    import json

    import huggingface_hub.constants

    from grpo.models.flux2 import FLUX2_KLEIN
    from grpo.models.flux3 import FLUX3

    repo = "black-forest-labs/flux-3-image-klein-base"
    tcfg, vae = P.model_configs(repo)
    assert sum(p.numel() for p in P.meta_transformer(tcfg, torch.bfloat16).parameters()) == 5_538_458_368
    assert vae["_class_name"] == "AutoencoderKLFlux2" and vae["latent_channels"] == 32
    assert P.model_family(repo, tcfg) is FLUX3
    # in the hub cache: the family is read from modular_model_index.json, not the shipped entry
    snapshot = tmp_path / ("models--" + repo.replace("/", "--")) / "snapshots" / ("0" * 40)
    (snapshot.parent.parent / "refs").mkdir(parents=True)
    (snapshot.parent.parent / "refs/main").write_text("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "modular_model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert P.model_family(repo, tcfg) is FLUX2_KLEIN  # the cached index wins (a deliberately other class)


def test_parse_bytes():
    assert P.parse_bytes("64GB") == 64 * 2**30
    assert P.parse_bytes("80 GiB") == 80 * 2**30
    assert P.parse_bytes("512M") == 512 * 2**20
    with pytest.raises(ConfigError, match="--device-memory"):
        P.parse_bytes("lots")


# -------------------------------------------------------------------------------------------------- activations
def test_checkpointing_lowers_the_planned_activations():
    spec = load_config(TINY_LORA).lora
    t = P.transformer_trace(transformer_config("small"), torch.float32, spec, 2, 256, 32)
    none, every2, every1 = (t.update_bytes(k)[0] for k in (False, 2, True))
    assert every1 < every2 < none


def test_block_fetch_puts_the_largest_block_in_flight():
    """deepspeed.fetch_blocks: ZeRO-3 gathers a whole block where it gathered one module: the update's in-flight
    weights grow by (largest block - largest module) elements, nothing else changes."""
    off, on = (P.plan(load_config(TINY_LORA, [f"deepspeed.fetch_blocks={v}"]), 2) for v in ("false", "true"))
    t = P.transformer_trace(transformer_config("tiny"), torch.float32, load_config(TINY_LORA).lora, 1, 16, 8)
    block = sum(p.numel() for p in t.model.transformer_blocks[0].parameters())  # a double block, with its LoRA
    assert t.largest_block == block > 5 * t.largest_module
    grown = on.phases["update"]["params in flight"] - off.phases["update"]["params in flight"]
    assert grown == (t.largest_block - t.largest_module) * 4 > 0  # fp32
    assert on.resident == off.resident


# --------------------------------------------------------------------------------------------------- levers
def _grads(model, inputs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**inputs)[0].square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("every", [True, 2, 4])
def test_every_k_checkpointing_gives_the_same_gradients(every):
    tcfg = transformer_config("tiny")
    model = build_transformer(tcfg).train()
    inputs = P.transformer_inputs(tcfg, 2, 16, 8, torch.float32, device="cpu")
    plain = _grads(model, inputs)
    enable_checkpointing(model, every)
    recomputed = {id(b) for b in checkpointed_blocks(model, every)}
    calls = []
    for b in [*model.transformer_blocks, *model.single_transformer_blocks]:
        b.register_forward_pre_hook(lambda m, a: calls.append(id(m)))  # recompute may stop before the end
    ckpt = _grads(model, inputs)
    n_blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    assert len(recomputed) == -(-n_blocks // int(every))
    assert len(calls) == n_blocks + len(recomputed)  # the chosen blocks ran twice: forward and recompute
    assert plain.keys() == ckpt.keys()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=0, atol=0, msg=n)


class _StubVAE(torch.nn.Module):
    """Records where decode() sends it; decodes to an image-shaped tensor on the latents' device."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"scaling_factor": 1.0, "shift_factor": 0.0})()
        self.dtype = torch.float32
        self.moves = []

    def to(self, device):
        self.moves.append(torch.device(device))
        return self

    def decode(self, z, return_dict=False):
        return (torch.zeros(z.shape[0], 3, z.shape[2] * 4, z.shape[3] * 4, device=z.device),)


def test_an_offloaded_vae_visits_the_latents_device_only_while_decoding():
    from grpo.models.flux1 import FLUX1

    vae = _StubVAE()
    FLUX1.decode(vae, torch.zeros(2, 16, 16), 32, 4)  # home device: nothing moves
    assert vae.moves == []
    image = FLUX1.decode(vae, torch.zeros(2, 16, 16, device="meta"), 32, 4)  # latents elsewhere: there and back
    assert vae.moves == [torch.device("meta"), torch.device("cpu")]
    assert image.shape == (2, 3, 32, 32)


def test_the_replay_buffer_is_counted_in_host_memory_and_its_block_in_the_update():
    """grpo.replay keeps `size` entries of float32 latents x_0 .. x_L and L log-probs on every rank (grpo/replay.py),
    and the replay block's share of them visits the device during the update."""
    preset = ROOT / "recipes/configs/experimental/tiny_opgrpo_lora.yaml"
    cfg = load_config(preset)
    p, off = P.plan(cfg, 2), P.plan(load_config(preset, ["grpo.replay=null"]), 2)
    r, latent = cfg.grpo.replay, 16 * 64 * 4  # the tiny world: 64 px -> 16 tokens of 64 channels, float32
    entry = (r.truncate + 1) * latent + r.truncate * 4
    assert p.host == {"replay buffer (every rank)": r.size * entry} and off.host == {}
    assert p.phase_total("update") - off.phase_total("update") == 16 * entry  # 32 images a block over 2 ranks


@pytest.mark.parametrize("setting", ["grpo.trust_region={kl_threshold: 1.0e-5}", "grpo.ratio_norm=true"])
def test_the_rollout_batch_counts_the_sde_means_that_flow_dppo_and_ratio_norm_keep(setting):
    """Flow-DPPO's KL and GRPO-Guard's RatioNorm compare the policy's SDE means with the rollout's: the rollout keeps
    one float32 mean per step and sample until the update, as many bytes as the latents after each step."""
    preset = str(ROOT / "recipes/configs/tiny/grpo_lora.yaml")
    extra = ["sampling.sde=flow"] if "ratio_norm" in setting else []  # RatioNorm is Flow-SDE's
    off, on = (P.plan(load_config(preset, [*extra, *o]), 2) for o in ([], [setting]))
    cfg = load_config(preset)
    channels = P.model_configs(str(ROOT / "assets/tiny-flux"))[0]["in_channels"]
    per_rank = derive_layout(cfg, 2).samples_per_rank
    means = per_rank * cfg.sampling.num_steps * on.image_tokens * channels * 4
    for phase in ("rollout", "decode", "reward", "update"):
        assert on.phases[phase]["rollout batch"] - off.phases[phase]["rollout batch"] == means > 0


# ------------------------------------------------------------------------------------------------------- true CFG
TINY_FLUX2 = str(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml")
CFG = "sampling.true_cfg={scale: 4.0}"


def test_true_cfg_doubles_the_updates_activations_when_it_trains_the_guided_velocity():
    """grpo trains the guided transition: the conditional and the negative call's graphs are both alive until the
    backward, so the update's activations are exactly twice one call's; the backward frees one graph before the
    other, so its working set is unchanged. Without grad (rollout, reference) the calls run in sequence: one call's
    peak plus the conditional output [r, S, C] in float32."""
    off, on = (P.plan(load_config(TINY_FLUX2, ["sampling.eval_cfg_scale=1.0", *o]), 2) for o in ([], [CFG]))
    assert P.update_calls(load_config(TINY_FLUX2, [CFG])) == 2
    assert on.phases["update"]["activations"] == 2 * off.phases["update"]["activations"] > 0
    assert on.phases["update"]["backward working set"] == off.phases["update"]["backward working set"]
    channels = P.model_configs(str(ROOT / "assets/tiny-flux2"))[0]["in_channels"]
    r = load_config(TINY_FLUX2).batch.rollout_micro_batch
    assert on.phases["rollout"]["CFG conditional output"] == r * on.image_tokens * channels * 4  # float32
    assert on.phases["rollout"]["rollout activations"] == off.phases["rollout"]["rollout activations"]
    assert "CFG conditional output" not in off.phases["rollout"]
    assert on.resident == off.resident


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_true_cfg_on_the_forward_process_objectives_counts_what_the_update_trains(objective):
    """nft and awm with train: guided keep both calls' activations (x2); with train: conditional the update is one
    call, as without CFG (its rollouts still guide: the kept conditional output is there either way)."""
    preset = str(ROOT / f"recipes/configs/tiny_flux2/{objective}_lora.yaml")
    off = P.plan(load_config(preset, ["sampling.true_cfg=null", "sampling.eval_cfg_scale=1.0"]), 2)
    guided, conditional = (P.plan(load_config(preset, [f"sampling.true_cfg={{scale: 4.0, train: {t}}}"]), 2)
                           for t in ("guided", "conditional"))
    assert guided.phases["update"]["activations"] == 2 * off.phases["update"]["activations"] > 0
    assert conditional.phases["update"]["activations"] == off.phases["update"]["activations"]
    assert guided.phases["rollout"]["CFG conditional output"] == conditional.phases["rollout"]["CFG conditional output"]
    assert guided.phases["update"]["backward working set"] == conditional.phases["update"]["backward working set"]


def test_evals_with_cfg_alone_count_the_kept_conditional_output():
    """sampling.eval_cfg_scale above 1 without true CFG in the rollouts (Flow-DPPO's klein-base setting): the evals
    guide, so a no-grad phase holds the kept conditional output; the update is one call."""
    off, evals = (P.plan(load_config(TINY_FLUX2, [o]), 2) for o in ("sampling.eval_cfg_scale=1.0",
                                                                     "sampling.eval_cfg_scale=4.0"))
    assert evals.phases["rollout"]["CFG conditional output"] > 0
    assert evals.phases["update"]["activations"] == off.phases["update"]["activations"]
