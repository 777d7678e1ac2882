"""GARDO's gated KL and reference refresh (grpo.gardo, grpo/gardo.py): the gate against a transcription of the
official script's ranks, percentile and RiskCompensator over many steps, the KL against its formula (times dt, the
mean over the gated samples), the refresh's two triggers and their timing, the state a checkpoint keeps, and the
one-line config errors."""

import numpy as np
import pytest
import torch

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.gardo import Gardo, ShareController, gate, ranks, uncertainty
from grpo.loss import grpo_loss
from tests import ROOT

PRESET = ROOT / "recipes/configs/tiny/grpo_lora.yaml"
GARDO = ["rewards={tiny_world: 1.0, jpeg_compressibility: 0.0}", "grpo.gardo.aux_rewards=[jpeg_compressibility]"]


# ------------------------------------------------------------------------------------------ the source


class _RiskCompensator:
    """tinnerhrhe/GARDO@1cc77fb scripts/train_flux_grpo_gardo.py:220-239, transcribed."""

    def __init__(self, base=0.1, beta=0.1):
        self.risk_buffer = []
        self.base = base
        self.alpha = 0.1
        self.beta = beta
        self.beta_min = 0.02
        self.beta_max = 0.2

    def update(self, pad_scores):
        if len(self.risk_buffer) == 0:
            self.beta = self.base
        elif np.mean(pad_scores) > max(self.risk_buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif np.mean(pad_scores) < min(self.risk_buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = np.clip(self.beta, self.beta_min, self.beta_max)
        self.risk_buffer.append(np.mean(pad_scores))
        if len(self.risk_buffer) > 20:
            self.risk_buffer = self.risk_buffer[-20:]


def _source_gate(rewards: dict, main: str, rc: _RiskCompensator) -> torch.Tensor:
    """The same script, lines 819-830 (the aesthetic and imagereward rewards, then the main one), transcribed."""
    reward_std = []
    for item in ["aesthetic", "imagereward", main]:
        _, indices = torch.sort(torch.tensor(rewards[item]), descending=True)
        rank = torch.empty_like(torch.tensor(rewards[item])).long()
        rank[indices] = torch.arange(1, len(rewards[item]) + 1)
        reward_std.append(rank.float())
    reward_std = reward_std[-1] - (reward_std[0] + reward_std[1]) / 2
    rc.update(np.array([p for p in reward_std.cpu().numpy() if p >= 0]))
    threshold = np.percentile(np.array([p for p in reward_std.cpu().numpy() if p >= 0]), 100 - rc.beta * 100)
    return reward_std > threshold


def _source_kl_loss(prev_sample_mean, prev_sample_mean_ref, std_dev_t, idx, beta):
    """The same script, lines 933-939: beta times the mean over the gated samples of (mean - ref)² / (2 std_dev_t²);
    std_dev_t is Flow-GRPO's SDE scale without sqrt(dt) ([B, 1, ...])."""
    kl_loss = torch.mean((torch.square(prev_sample_mean[idx] - prev_sample_mean_ref[idx])) / (2 * std_dev_t[idx] ** 2))
    return beta * torch.mean(kl_loss)


# ------------------------------------------------------------------------------------------ the gate


def test_ranks_are_descending_from_one_and_ties_keep_their_order():
    assert ranks(torch.tensor([0.3, 0.9, 0.1])).tolist() == [2.0, 1.0, 3.0]
    assert ranks(torch.tensor([0.5, 0.5, 0.7, 0.5])).tolist() == [2.0, 3.0, 1.0, 4.0]


def test_the_uncertainty_is_the_main_rank_minus_the_auxiliaries_mean_rank():
    main = torch.tensor([3.0, 2.0, 1.0])
    aux = torch.tensor([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0]])  # ranks [3, 2, 1] and [1, 2, 3]: mean 2 everywhere
    assert uncertainty(main, aux).tolist() == [-1.0, 0.0, 1.0]
    u = uncertainty(torch.randn(50, generator=torch.Generator().manual_seed(0)),
                    torch.randn(50, 2, generator=torch.Generator().manual_seed(1)))
    assert u.sum().item() == 0.0  # both sides are means of the ranks 1..N


@pytest.mark.parametrize("n", [8, 64, 96])
def test_the_gate_and_its_share_follow_the_source_step_by_step(n):
    """40 steps of rewards whose spread and disagreement drift, so the share grows, shrinks and hits its bounds."""
    g = torch.Generator().manual_seed(n)
    rc, ours = _RiskCompensator(), ShareController(0.1)
    shares = set()
    for step in range(40):
        main = torch.randn(n, generator=g, dtype=torch.float64)
        scale = 0.2 + 2.0 * abs(np.sin(step / 5))  # how far the auxiliaries disagree with the main reward
        aux = main[:, None] + scale * torch.randn(n, 2, generator=g, dtype=torch.float64)
        expected = _source_gate({"hps": main.numpy(), "aesthetic": aux[:, 0].numpy(),
                                 "imagereward": aux[:, 1].numpy()}, "hps", rc)
        got = gate(uncertainty(main, aux), ours)
        assert torch.equal(got, expected), step
        assert ours.share == pytest.approx(float(rc.beta), rel=1e-12), step
        assert ours.means == pytest.approx([float(m) for m in rc.risk_buffer], rel=1e-6)
        shares.add(round(ours.share, 6))
    assert len(shares) > 3  # the share did move


# ------------------------------------------------------------------------------------------ the KL


def _gardo(overrides=()) -> Gardo:
    cfg = load_config(PRESET, [*GARDO, *overrides])
    return Gardo(cfg.grpo.gardo, list(cfg.rewards))


def test_the_gated_kl_is_the_sources_mean_over_gated_samples_times_dt():
    """One micro-batch holding the whole step: grpo_loss's mean of the weighted per-sample KLs is the source's
    beta · mean over the gated samples of (mean - ref)² / (2 std_dev_t²), the step's std = std_dev_t·sqrt(dt)."""
    g = torch.Generator().manual_seed(3)
    n, dt = 64, 0.17
    gd = _gardo()
    components = torch.randn(n, 2, generator=g)
    gd.scored(None, 0, components, torch.tensor([1.0, 0.0]))
    assert 0 < int(gd.gated.sum()) < n
    mean = torch.randn(n, 4, 8, generator=g, requires_grad=True)
    ref = mean.detach() + 0.1 * torch.randn(n, 4, 8, generator=g)
    std_dev_t = 0.3 + torch.rand(n, generator=g)
    kl, logged = gd.kl(mean, ref, std_dev_t * dt**0.5, dt, list(range(n)))
    loss, _ = grpo_loss(torch.zeros(n), torch.zeros(n), torch.zeros(n), clip_range=1e-4, kl=kl, kl_coef=0.01)
    expected = _source_kl_loss(mean, ref, std_dev_t[:, None, None], gd.gated, 0.01)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(logged, expected / 0.01, rtol=1e-5, atol=0)
    loss.backward()
    rows = mean.grad.flatten(1).abs().sum(1) > 0
    assert torch.equal(rows, gd.gated)  # only the gated samples are pulled towards the reference


def test_split_over_micro_batches_the_step_mean_is_the_same():
    """The step's mean over its gated samples, whichever micro-batch (or rank) holds them: the weights are the
    step's, so a 1-process and a 2-process run add the same terms."""
    g = torch.Generator().manual_seed(4)
    n = 64
    gd = _gardo()
    gd.scored(None, 0, torch.randn(n, 2, generator=g), torch.tensor([1.0, 0.0]))
    assert 1 < int(gd.gated.sum()) < n
    mean, ref = torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g)
    whole, _ = gd.kl(mean, ref, 0.5, 0.1, list(range(n)))
    parts = [gd.kl(mean[i:i + 8], ref[i:i + 8], 0.5, 0.1, list(range(i, i + 8)))[0] for i in range(0, n, 8)]
    torch.testing.assert_close(torch.stack([p.mean() for p in parts]).mean(), whole.mean())


def test_at_the_reference_the_kl_is_exactly_zero():
    gd = _gardo()
    gd.scored(None, 0, torch.randn(8, 2, generator=torch.Generator().manual_seed(5)), torch.tensor([1.0, 0.0]))
    mean = torch.randn(8, 3, 5)
    kl, logged = gd.kl(mean, mean.clone(), 0.4, 0.2, list(range(8)))
    assert (kl == 0).all() and logged.item() == 0.0


# ------------------------------------------------------------------------------------------ the refresh


class _Lagging:
    def __init__(self):
        self.copies = []

    def update(self, decay=None):
        assert decay == 0.0  # a copy of the policy, not an average
        self.copies.append(decay)


class _Models:
    def __init__(self):
        self.lagging = _Lagging()


def _step(gd: Gardo, models, step: int, kl: float) -> dict:
    """One step: scored (gate, refresh if due), one micro-batch's KL at `kl` per element, remember."""
    g = torch.Generator().manual_seed(100 + step)
    stats = gd.scored(models, step, torch.randn(64, 2, generator=g), torch.tensor([1.0, 0.0]))
    assert gd.gated.any()
    ref = torch.zeros(64, 4)
    gd.kl(ref + (2 * kl) ** 0.5, ref, 1.0, 1.0, list(range(64)))  # (d²/2)·dt = kl
    gd.remember()
    return stats


def test_a_kl_above_the_threshold_refreshes_before_the_next_update():
    gd, models = _gardo(["grpo.gardo.kl_threshold=1e-3"]), _Models()
    assert _step(gd, models, 0, kl=5e-4)["gardo/refreshed"] == 0.0 and not gd.refresh_due
    assert _step(gd, models, 1, kl=2e-3)["gardo/refreshed"] == 0.0 and gd.refresh_due
    assert _step(gd, models, 2, kl=5e-4)["gardo/refreshed"] == 1.0 and gd.refreshed_at == 2
    assert _step(gd, models, 3, kl=5e-4)["gardo/refreshed"] == 0.0 and len(models.lagging.copies) == 1


def test_without_a_trigger_the_reference_is_refreshed_every_refresh_every_steps():
    """The source's `epoch - prev_epoch > 15` from the initial copy at epoch 0: epochs 16, 32, ..."""
    gd, models = _gardo(), _Models()
    refreshed = [s for s in range(40) if _step(gd, models, s, kl=0.0)["gardo/refreshed"]]
    assert refreshed == [16, 32]


def test_the_checkpointed_state_continues_exactly():
    """Resumed from its state after 7 steps, the gate, share and refreshes of the next ones are the same."""
    a, b = _gardo(["grpo.gardo.kl_threshold=1e-3"]), _gardo(["grpo.gardo.kl_threshold=1e-3"])
    ma, mb = _Models(), _Models()
    for s in range(7):
        _step(a, ma, s, kl=2e-3 if s == 6 else 0.0)
    b.load({k: v.clone() for k, v in a.state().items()})
    for s in range(7, 30):
        sa, sb = _step(a, ma, s, kl=0.0), _step(b, mb, s, kl=0.0)
        assert sa == sb and torch.equal(a.gated, b.gated), s
    assert len(ma.lagging.copies) == len(mb.lagging.copies) == 2  # at step 7 (the trigger of 6) and 23
    with pytest.raises(ValueError, match="no GARDO state"):
        b.load({})


# ------------------------------------------------------------------------------------------ settings


def test_gardo_is_off_by_default_and_when_on_keeps_a_reference_copy_of_the_policy():
    from grpo.objectives.grpo import GRPO

    off = GRPO(load_config(PRESET))
    assert off.settings.gardo is None and not off.uses_lagging and off.forwards_per_point() == 3
    on = GRPO(load_config(PRESET, GARDO))
    s = on.settings.gardo
    assert (s.share, s.kl_coef, s.kl_threshold, s.refresh_every) == (0.1, 0.01, 3e-4, 16)  # GARDO's hps_flux
    assert on.uses_lagging and on.lagging_decay(5) == 1.0 and on.forwards_per_point() == 4
    terms = on.plan_terms()
    assert terms.lagging_average and terms.reference_phase


@pytest.mark.parametrize("overrides,match", [
    (["grpo.kl_coef=0.1"], "grpo.kl_coef: 0.1 with grpo.gardo: GARDO's gated KL"),
    (["grpo.gardo.aux_rewards=[aesthetic]"], r"grpo.gardo.aux_rewards: \['aesthetic'\] must name one or more"),
    (["grpo.gardo.aux_rewards=[]"], r"grpo.gardo.aux_rewards: \[\] must name one or more"),
    (["grpo.gardo.share=0.5"], r"grpo.gardo.share: 0.5 must be in \[0.02, 0.2\]"),
    (["grpo.gardo.kl_coef=0"], "grpo.gardo.kl_coef: 0.0 must be > 0"),
    (["grpo.gardo.kl_threshold=-1"], "grpo.gardo.kl_threshold: -1.0 must be > 0"),
    (["grpo.gardo.refresh_every=0"], "grpo.gardo.refresh_every: 0 must be >= 1"),
    (["preset=recipes/configs/tiny/branchgrpo_lora.yaml"], "grpo.gardo: not with sampling.branch or grpo.replay"),
    (["preset=recipes/configs/experimental/tiny_opgrpo_lora.yaml"], "grpo.gardo: not with sampling.branch or "
                                                                      "grpo.replay"),
])
def test_bad_gardo_settings_are_one_line(overrides, match):
    preset = [ROOT / o.removeprefix("preset=") for o in overrides if o.startswith("preset=")] or [PRESET]
    with pytest.raises(ConfigError, match=match) as e:
        load_config(preset[0], [*GARDO, *(o for o in overrides if not o.startswith("preset="))])
    assert "\n" not in str(e.value)
