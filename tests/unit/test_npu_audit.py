"""The NPU op audit on small models: it must name float64 buffers, complex ops and rollout syncs, and stay quiet on
what would not reach an NPU (host tensors, diffusers' CPU-only float64 RoPE table). The audit command on the tiny
presets: tests/recipe/test_npu_audit.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo.errors import ConfigError
from tools import npu_audit
from tools.npu_audit import Auditor
from tests import TINY_FLUX3, tiny_flux_transformer

THIS = Path(__file__).name


class Scaler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, 4, dtype=torch.float64))

    def forward(self, x):
        return (x * self.table).float()  # promotes to float64 on the device


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.scaler = Scaler()

    def forward(self, x):
        return self.scaler(self.proj(x))


class ComplexRope(torch.nn.Module):
    """Rotary embedding written the complex way (Lumina style): what the NPU cannot run."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        angles = torch.arange(2, dtype=torch.float32) * h[..., :1]
        rot = torch.polar(torch.ones_like(angles), angles)
        return torch.view_as_real(torch.view_as_complex(h.reshape(*h.shape[:-1], 2, 2)) * rot).flatten(-2)


def _rows(auditor: Auditor, kind: str) -> list[npu_audit.Finding]:
    return [f for f in auditor.sorted_findings() if f.kind == kind]


def test_float64_buffer_is_caught_and_named():
    net, auditor = Net(), Auditor()
    with auditor, auditor.phase("rollout"):
        net(torch.randn(3, 4))
    assert not auditor.ok
    (param,) = _rows(auditor, "fp64-param")
    assert (param.op, param.detail, param.module) == ("table", "float64", "Net.scaler")
    assert "class Scaler" in param.site
    (op,) = _rows(auditor, "float64")
    assert op.module == "Net.scaler" and op.op.startswith("aten.mul.Tensor")
    assert op.site.startswith(f"tests/unit/{THIS}:") and op.site.endswith("in forward")
    assert op.phase == "rollout"


def test_complex_op_is_caught_and_named():
    auditor = Auditor()
    auditor.watch(model := ComplexRope(), "rope")
    with auditor:
        model(torch.randn(2, 3, 4))
    unsupported = {f.op for f in _rows(auditor, "unsupported-op")}
    assert {"aten.polar", "aten.view_as_complex", "aten.view_as_real"} <= unsupported
    assert all(f.module == "rope" for f in auditor.findings.values())
    assert _rows(auditor, "complex")
    assert "vllm-project/vllm-omni #4911" in auditor.format_table()


class TokenMask(torch.nn.Module):
    def forward(self, ids):
        return torch.isin(ids, torch.tensor([0, 3]))


def test_isin_is_not_a_cpu_fallback_on_torch_npu_2_12():
    """torch_npu 2.12 (requirements-npu.txt) has an NPU kernel for aten.isin; only torch_npu 2.1 fell back."""
    auditor = Auditor()
    auditor.watch(model := TokenMask(), "mask")
    with auditor, auditor.phase("train"):
        model(torch.arange(6))
    assert auditor.ok, auditor.format_table()


def test_clean_model_is_clean_and_hooks_are_removed():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    globals_before = len(torch.nn.modules.module._global_forward_pre_hooks)
    cpu_method = torch.Tensor.cpu
    auditor = Auditor()
    with auditor, auditor.phase("rollout"):
        net(torch.randn(5, 4)).sum()
    with auditor, auditor.phase("train"):
        net(torch.randn(5, 4)).pow(2).mean().backward()
    assert auditor.ok, auditor.format_table()
    assert auditor.format_table() == "npu_audit: no NPU-hostile ops found"
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == globals_before
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())
    assert torch.Tensor.cpu is cpu_method


def test_syncs_reported_in_rollout_only_and_on_device_tensors_only():
    net = torch.nn.Linear(4, 1)
    sigmas = torch.linspace(1, 0, 5, dtype=torch.float64)  # a host table: float64 and .item() cost nothing there
    auditor = Auditor()
    with auditor:
        with auditor.phase("rollout"):
            out = net(torch.randn(6, 4))
            float(sigmas[1])
            (sigmas * 2).sum()
            out.mean().item()  # device -> host
            kept = out[out > 0]  # boolean mask: nonzero
            out.cpu().sum().item()  # one sync (the copy); the .item() is on the host copy
            out.tolist()
        with auditor.phase("train"):
            net(torch.randn(6, 4)).sum().item()  # not the rollout loop: not reported
    syncs = _rows(auditor, "sync")
    assert {f.op for f in syncs} == {"aten._local_scalar_dense", "aten.index.Tensor", "Tensor.cpu", "Tensor.tolist"}
    assert all(f.phase == "rollout" and f.count == 1 for f in syncs), auditor.format_table()
    assert all(f.site.startswith(f"tests/unit/{THIS}:") for f in syncs)
    assert not _rows(auditor, "float64")
    assert kept.numel() >= 0

    everything = Auditor(device_view=False, sync_phases=None)
    with everything:
        float(sigmas[1])
    assert {f.kind for f in everything.findings.values()} == {"sync", "float64"}


def test_emulated_accelerator_device_tracks_factories_and_moves():
    from grpo.device import accelerator, device_for_local_rank

    on_cpu = accelerator().device_name() == "cpu"
    with npu_audit.emulate_device_on_cpu() as dev:
        assert dev == torch.device("cpu", 0)
        if on_cpu:
            assert device_for_local_rank(0) == dev
        auditor = Auditor(accelerator_device=dev)
        with auditor, auditor.phase("rollout"):
            noise = torch.randn(4)  # host: drawn on the CPU on purpose
            x = noise.to(dev)  # host -> device: no sync
            noise.sum().item()
            torch.arange(3, dtype=torch.float64).sum()  # host float64: fine
            x.sum().item()  # sync
            torch.zeros(3, device=dev).double()  # float64 on the device
            x.to("cpu").sum().item()  # one sync, the copy
            x.to(noise.device)  # plain `cpu` of some tensor: not taken for a host copy
    if on_cpu:
        assert device_for_local_rank(0) == torch.device("cpu")
    rows = {(f.kind, f.op.split(",")[0]) for f in auditor.findings.values()}
    assert rows == {("sync", "aten._local_scalar_dense"), ("sync", "Tensor.to"), ("float64", "aten._to_copy")}
    assert all(f.count == 1 for f in auditor.findings.values()), auditor.format_table()


def test_backward_ops_are_attributed_to_autograd_nodes():
    net = Net()
    auditor = Auditor()
    x = torch.randn(3, 4)
    with auditor, auditor.phase("train"):
        net(x).sum().backward()
    backward = [f for f in _rows(auditor, "float64") if f.module.startswith("backward of ")]
    assert backward, auditor.format_table()


def _flux_inputs(batch: int = 2) -> dict:
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1)
    return dict(hidden_states=torch.randn(batch, 16, 4), encoder_hidden_states=torch.randn(batch, 8, 32),
                pooled_projections=torch.randn(batch, 32), timestep=torch.full((batch,), 0.5),
                img_ids=img_ids.reshape(16, 3), txt_ids=torch.zeros(8, 3))


def _flux1_call():
    """diffusers' tiny FluxTransformer2DModel and one call of it."""
    model, inputs = tiny_flux_transformer(), _flux_inputs()
    return model, lambda: model(**inputs).sample


def _flux3_call():
    """The tiny FLUX.3 transformer (assets/tiny-flux3) and one velocity call as the recipe makes it (its family's
    ids: 4 axes, the image's H and W scaled, the text along L)."""
    from grpo.models.flux3 import FLUX3

    model = FLUX3.load_transformer(str(TINY_FLUX3))
    torch.manual_seed(0)
    embeds = {"prompt_embeds": torch.randn(2, 8, model.config.joint_attention_dim)}
    cond = FLUX3.conditioning(embeds, 8, 1.0, False, torch.device("cpu"), torch.float32)
    latents, timestep = torch.randn(2, 16, model.config.in_channels), torch.full((2,), 0.5)
    return model, lambda: FLUX3.velocity(model, latents, timestep, cond)


@pytest.mark.parametrize("call", [_flux1_call, pytest.param(_flux3_call, marks=pytest.mark.skipif(
    not (TINY_FLUX3 / "modular_model_index.json").exists(), reason="tiny FLUX.3 not built"))], ids=["flux1", "flux3"])
def test_tiny_flux_is_clean_in_the_npu_view_and_rope_fp64_shows_in_the_cpu_view(call):
    """FLUX.1's and FLUX.3's RoPE tables are float64 on the CPU only (diffusers' maybe_adjust_dtype_for_device gives
    float32 on an NPU); nothing else of either reads float64 or complex, in the rollout or the backward."""
    from diffusers.utils.torch_utils import maybe_adjust_dtype_for_device

    model, forward = call()
    with torch.no_grad():
        reference = forward()

    npu_view = Auditor()
    with npu_view:
        with npu_view.phase("rollout"), torch.no_grad():
            assert maybe_adjust_dtype_for_device(torch.float64, torch.device("cpu")) == torch.float32
            emulated = forward()
        with npu_view.phase("train"):
            forward().pow(2).mean().backward()
    assert npu_view.ok, npu_view.format_table()
    assert maybe_adjust_dtype_for_device(torch.float64, torch.device("cpu")) == torch.float64  # restored
    # An fp32 RoPE table (what the NPU builds) moves the output by rounding only.
    torch.testing.assert_close(emulated, reference, rtol=1e-4, atol=1e-5)

    cpu_view = Auditor(device_view=False)
    with cpu_view, torch.no_grad():
        forward()
    rope = _rows(cpu_view, "float64")
    assert rope and all(f.module == f"{type(model).__name__}.pos_embed" for f in rope)
    assert all(f.site.startswith("diffusers/models/embeddings.py:") for f in rope)
    assert any("get_1d_rotary_pos_embed" in f.site for f in rope)


def test_main_exit_codes(monkeypatch, capsys):
    def dirty(config_path, overrides, auditor, recipe_path):
        assert (config_path, list(overrides)) == ("preset.yaml", ["max_steps=1"])
        with auditor, auditor.phase("rollout"):
            Net()(torch.randn(2, 4))

    def clean(config_path, overrides, auditor, recipe_path):
        with auditor, auditor.phase("rollout"):
            torch.nn.Linear(4, 4)(torch.randn(2, 4))

    def bad(config_path, overrides, auditor, recipe_path):
        raise ConfigError("sampling.num_steps: must be >= 2; raise it")

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(npu_audit, "run_recipe_step", dirty)
    assert npu_audit.main(["preset.yaml", "max_steps=1"]) == 1
    out = capsys.readouterr().out
    assert "fp64-param" in out and "Net.scaler" in out and "finding(s)" in out
    monkeypatch.setattr(npu_audit, "run_recipe_step", clean)
    assert npu_audit.main(["preset.yaml"]) == 0
    assert "no NPU-hostile ops found" in capsys.readouterr().out
    monkeypatch.setattr(npu_audit, "run_recipe_step", bad)
    assert npu_audit.main(["preset.yaml"]) == 2
    assert "error: sampling.num_steps" in capsys.readouterr().err
