"""Temperature scaling (Guo et al., 2017) fitted on validation logits."""

from __future__ import annotations

import torch
from torch import Tensor

from partialbayes.predictive._validate import (
    check_int,
    check_labels,
    check_number,
    check_same_device,
    check_tensor,
)


def _logits_labels(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    z = check_tensor("logits", logits)
    if z.ndim != 2 or z.shape[0] == 0 or z.shape[1] < 2:
        raise ValueError(f"logits must have shape [N, C] with N >= 1, C >= 2, got {tuple(z.shape)}")
    y = check_labels("labels", labels, z.shape[0], z.shape[1])
    check_same_device(logits=z, labels=y)
    return z, y


def fit_temperature(
    logits: Tensor, labels: Tensor, *, init: float = 1.0, max_iter: int = 100
) -> Tensor:
    """Fit the temperature ``T`` minimising the NLL of ``softmax(logits / T)`` on validation data.

    L-BFGS (strong-Wolfe) on ``log T`` in float64 from ``init`` for at most ``max_iter`` iterations; the
    objective is convex in ``1/T``. ``logits`` are ``[N, C]``, ``labels`` ``[N]``. Returns a 0-dim tensor in
    the dtype and on the device of ``logits``.

    Raises:
        ValueError: On invalid inputs, or when no finite optimum exists (every validation
            example correct with a margin, or logits no better than uniform).
    """
    z, y = _logits_labels(logits, labels)
    init = _check_temperature("init", init)
    check_int("max_iter", max_iter)
    z64 = z.detach().to(torch.float64)
    # The mean NLL is convex in β = 1/T. It has no finite minimiser when every example is
    # classified correctly with a margin (NLL → 0 as β → ∞), or when its slope at β = 0,
    # mean(mean_c z_c − z_y), is non-negative (optimum at β ≤ 0, i.e. T = ∞ or negative).
    z_y = z64.gather(1, y[:, None])
    others = z64.scatter(1, y[:, None], -torch.inf)
    separable = bool((others.amax(1, keepdim=True) < z_y).all())
    if separable or float((z64.mean(1, keepdim=True) - z_y).mean()) >= 0:
        raise ValueError(
            "temperature scaling has no finite optimum: "
            + (
                "every validation example is classified correctly (separable logits), so the NLL "
                "keeps falling as T -> 0"
                if separable
                else "the logits carry no information about the labels (the NLL decreases as "
                "T -> infinity)"
            )
        )
    log_t = torch.tensor(float(torch.tensor(init).log()), dtype=torch.float64, device=z.device)
    log_t.requires_grad_(True)
    opt = torch.optim.LBFGS(
        [log_t],
        lr=1.0,
        max_iter=max_iter,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-12,
        tolerance_change=1e-14,
    )

    def closure() -> Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(z64 * torch.exp(-log_t), y)
        loss.backward()
        return loss

    opt.step(closure)
    value = float(log_t.detach())
    if not -20.0 < value < 20.0:
        raise ValueError(
            f"temperature scaling diverged (log T = {value:.3g}); the validation logits may be "
            "perfectly separable or constant"
        )
    return torch.tensor(value, dtype=torch.float64).exp().to(dtype=z.dtype, device=z.device)


def _check_temperature(name: str, value: object) -> float:
    """A finite, positive temperature from a number or a one-element real tensor."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a number or a one-element real tensor, got a {value.dtype} "
                f"tensor of shape {tuple(value.shape)}"
            )
        value = float(value)
    return check_number(name, value)


def apply_temperature(logits: Tensor, temperature: Tensor | float) -> Tensor:
    """Scale logits ``[..., C]`` by ``1 / T`` for ``T`` a finite float or 0-dim tensor ``> 0``.

    Raises:
        TypeError: If ``logits`` is not a floating tensor or ``temperature`` not a number.
        ValueError: If ``logits`` holds NaN/inf or ``T`` is not finite and positive.
    """
    z = check_tensor("logits", logits)
    t = _check_temperature("temperature", temperature)
    return z / t
