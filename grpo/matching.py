"""Forward-process objectives: DiffusionNFT and AWM train the velocity on noised clean samples, with no SDE, no
transition log-prob and no backward pass through the sampler.

Conventions as in grpo/sde.py: x_t = (1 - t)·x0 + t·eps, the model predicts v = eps - x0, x̂0 = x_t - t·v; errors
are averaged over the non-batch elements (mean_D). Everything is float32: the sources use float64 for DiffusionNFT's
x0-space weights w^± (train_nft_sd3.py:939-955, ``.double()``) and for AWM's whole matching error and its Huber
weighting (train_sd3_awm.py:237-249, ``noise_pred.double()``), which the NPU lacks; float32 means of squares lose
nothing that matters at these magnitudes (tests/unit/test_matching.py compares against float64 transcriptions).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.sde import _bcast

__all__ = ["awm_loss", "decay", "forward_noise", "nft_loss", "norm_guard", "optimality_weight", "velocity_mse",
           "velocity_norm", "drift_stats"]


def _mean_d(x: Tensor) -> Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


def forward_noise(x0: Tensor, eps: Tensor, t: Tensor) -> Tensor:
    """x_t = (1 - t)·x0 + t·eps, the flow-matching forward process at noise level t ([B])."""
    tb = _bcast(t.float(), x0.ndim)
    return (1 - tb) * x0.float() + tb * eps.float()


def optimality_weight(advantages: Tensor, adv_max: float) -> Tensor:
    """DiffusionNFT's optimality probability r = clip(A / (2·A_max) + 1/2, 0, 1) from clipped group advantages.

    Source: NVlabs/DiffusionNFT@24af555 scripts/train_nft_sd3.py:908-972 (``r = torch.clamp(adv / adv_clip_max / 2
    + 0.5, 0, 1)`` after clamping A to ±adv_clip_max); paper arXiv 2509.16117 §3 (optimality reward).
    """
    a = advantages.float().clamp(-adv_max, adv_max)
    return (a / adv_max / 2 + 0.5).clamp(0, 1)


def nft_loss(v_theta: Tensor, v_old: Tensor, x_t: Tensor, x0: Tensor, t: Tensor, r: Tensor, beta: float,
             adv_max: float) -> tuple[Tensor, dict[str, Tensor]]:
    """DiffusionNFT's loss on the implicit positive and negative policies, for one noise level per sample.

    v⁺ = β·v_θ + (1 - β)·v_old, v⁻ = (1 + β)·v_old - β·v_θ; x̂0^± = x_t - t·v^±;
    L^± = mean_D (x̂0^± - x0)² / w^±, w^± = max(mean_D |x̂0^± - x0|, 1e-5) (detached, self-normalising);
    loss = A_max · mean_B[(r·L⁺ + (1 - r)·L⁻) / β].

    Source: DiffusionNFT@24af555 scripts/train_nft_sd3.py:862-972 (predictions and loss); paper §3 (implicit
    positive/negative policies, Eq. for the NFT objective). At r = 1/2 for every sample (equal rewards) the two terms
    pull v_θ towards v_old from both sides: the gradient at v_θ = v_old is zero.

    Args:
        v_theta: [B, ...] the policy's velocity at (x_t, t), with graph.
        v_old: [B, ...] the old policy's velocity at (x_t, t) (constant).
        x_t, x0: [B, ...] the noised and the clean latent. t: [B] noise levels. r: [B] optimality weights.
        beta: the mixing strength (not a KL coefficient; DiffusionNFT: 1.0, or 0.1 for OCR).
        adv_max: A_max (5).

    Returns:
        loss (scalar, with graph) and detached stats: loss_pos, loss_neg (batch means of L^±).
    """
    tb = _bcast(t.float(), x_t.ndim)
    v_theta, v_old, x_t, x0 = v_theta.float(), v_old.float().detach(), x_t.float(), x0.float()
    pos = beta * v_theta + (1 - beta) * v_old
    neg = (1 + beta) * v_old - beta * v_theta
    x0_pos, x0_neg = x_t - tb * pos, x_t - tb * neg
    w_pos = _mean_d((x0_pos - x0).abs()).clamp(min=1e-5).detach()
    w_neg = _mean_d((x0_neg - x0).abs()).clamp(min=1e-5).detach()
    l_pos = _mean_d((x0_pos - x0) ** 2) / w_pos
    l_neg = _mean_d((x0_neg - x0) ** 2) / w_neg
    r = r.float().detach()
    loss = adv_max * ((r * l_pos + (1 - r) * l_neg) / beta).mean()
    return loss, {"loss_pos": l_pos.detach().mean(), "loss_neg": l_neg.detach().mean()}


def awm_loss(v_theta: Tensor, x0: Tensor, eps: Tensor, t: Tensor, advantages: Tensor,
             p: float) -> tuple[Tensor, dict[str, Tensor]]:
    """AWM's advantage-weighted flow matching with its generalised-Huber weighting, for one noise level per sample.

    e = mean_D (v_θ(x_t, t) - (eps - x0))²; "log-prob" ℓ = -(t/p)·((e + 1e-10)^p - (1e-10)^p); the source's
    PPO-clip (ε = 1, ℓ_old = ℓ.detach(), one on-policy step, so the ratio is exactly 1 and never clipped) has the
    value -mean_B A and the gradient of the surrogate mean_B(-A·ℓ) = mean_B A·(t/p)·((e + 1e-10)^p - (1e-10)^p),
    which this returns (same gradient; the value differs from the source's logged policy_loss).

    Source: scxue/advantage_weighted_matching@be51372 advantage_weighted_matching/scripts/train_sd3_awm.py:210-252
    (weighted matching "log-prob"), :1262-1360 (loss); paper arXiv 2509.25050 (AWM objective, Theorem 1). A zero
    advantage gives a zero loss and gradient.

    Args:
        v_theta: [B, ...] with graph. x0, eps: [B, ...]. t: [B]. advantages: [B] (AWM scales them to ±1).
        p: the Huber exponent (0.25).

    Returns:
        loss (scalar, with graph) and detached stats: matching_error (mean e).
    """
    target = eps.float() - x0.float()
    e = _mean_d((v_theta.float() - target) ** 2)
    log_p = -(t.float() / p) * ((e + 1e-10) ** p - 1e-10**p)
    loss = -(advantages.float().detach() * log_p).mean()
    return loss, {"matching_error": e.detach().mean()}


def velocity_mse(v_a: Tensor, v_b: Tensor) -> Tensor:
    """mean_D (v_a - v_b)² per sample ([B]): the KL-to-reference and EMA-anchor terms of NFT and AWM ("uniform"
    weighting, no 1/(2σ²))."""
    return _mean_d((v_a.float() - v_b.float().detach()) ** 2)


def velocity_norm(v: Tensor) -> Tensor:
    """[B] the per-sample L2 norm of a velocity over all its non-batch elements (one sample at one step), float32."""
    return v.float().flatten(1).norm(dim=1)


def drift_stats(v: Tensor, ref_norm: Tensor | None) -> dict[str, Tensor]:
    """The velocity's drift, logged by every objective from the forwards it makes anyway (detached scalars):
    drift/vnorm = mean_B ||v|| / sqrt(D) (its RMS, comparable across steps and resolutions) and, given the [B] norms
    of a comparison velocity at the same inputs, drift/vnorm_ratio = mean_B ||v|| / ||v_ref||: NormGuard's signature
    of drift (arXiv 2606.27771: NFT, AWM and DPO raise it 5-15% over the reference's)."""
    norm = velocity_norm(v.detach())
    stats = {"drift/vnorm": norm.mean() / v[0].numel() ** 0.5}
    if ref_norm is not None:
        stats["drift/vnorm_ratio"] = (norm / ref_norm.detach().float()).mean()
    return stats


def norm_guard(v_theta: Tensor, v_ref: Tensor, margin: float) -> Tensor:
    """[B] NormGuard's one-sided hinge on the velocity's norm, relative to the reference's:
    h = max(0, ||v_θ|| / ||v_ref|| - (1 + margin)), ||·|| the L2 norm over one sample's elements at one step.

    Paper: arXiv 2606.27771 (NormGuard; no official code found): "a hinge penalty that activates only when ||v_θ||
    exceeds ||v_ref||, added to any velocity-local base loss". Our reading (docs/strategies.md, "NormGuard"): per
    sample and step, linear hinge (max(0, ·), constant pull once active), relative to the reference's norm (the
    margin is a share, as the paper reports its 5-15%, and the weight means the same at every noise level, whose
    velocity norms differ), v_ref a constant (no gradient). Below the threshold it is 0 with a zero gradient; above,
    its gradient is v_θ / (||v_θ||·||v_ref||): descent shrinks v_θ along itself, its direction untouched. With
    v_θ == v_ref bit for bit (the first pass) it is exactly 0 for any margin >= 0, gradient included.
    """
    ratio = velocity_norm(v_theta) / velocity_norm(v_ref.detach())
    return torch.relu(ratio - (1.0 + margin))


def decay(k: int, rate: float, max_decay: float, start: int = 0) -> float:
    """A soft-update decay that grows with the optimizer steps k: 0 before `start`, then min(rate·(k - start), max).

    DiffusionNFT's old policy (train_nft_sd3.py:169-189, ``return_decay``): type 0 = (0, 0, 0) (plain copy),
    type 1 = (0.001, 0.5, 0), type 2 = (0.0075, 0.999, 75); AWM's EMA anchor (train_sd3_awm.py:1409-1419,
    kl_ema_decay_type 'linear', kl_ema_decay 0.3): (0.001, 0.3, 0). θ_old ← d·θ_old + (1 - d)·θ after each epoch
    (train_nft_sd3.py:1033-1039, train_sd3_awm.py:1419), k = optimizer steps so far.
    """
    if k < start:
        return 0.0
    return min(rate * (k - start), max_decay)
