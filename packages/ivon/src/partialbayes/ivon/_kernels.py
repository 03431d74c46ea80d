"""In-place kernels around the pure functions of :mod:`partialbayes.ivon._math`.

Each kernel reads its tensors (all of one shape, or ``None``), computes with the pure functions and writes the
results back with ``copy_``. Run eagerly they cost one pass per torch operation (on small chunks, see
:mod:`partialbayes.ivon._blocked`); ``torch.compile`` turns each into one fused pass (see
:mod:`partialbayes.ivon._compiled`). The first argument(s) are the ones written.
"""

from __future__ import annotations

from torch import Tensor

from partialbayes.ivon._math import Hyper, Scalar, hess_statistic, ivon_update, weight_sample


def sample_(
    noise: Tensor, mean: Tensor, hess: Tensor, mask: Tensor | None, *, weight_decay: Scalar
) -> None:
    """Turn the noise ``z ~ N(0, 1/λ)`` in ``noise`` into the weight sample ``m + z/√(h+δ)``, in place."""
    noise.copy_(weight_sample(mean, hess, noise, mask, weight_decay=weight_decay))


def update_(
    mean: Tensor,
    momentum: Tensor,
    hess: Tensor,
    grad: Tensor,
    sample: Tensor | None,
    stat: Tensor | None,
    mask: Tensor | None,
    *,
    hyper: Hyper,
    hess_approx: str,
    learn_hess: bool,
) -> None:
    """:func:`~partialbayes.ivon._math.ivon_update` in place on ``mean``, ``momentum`` and ``hess``.

    The Hessian statistic is ``stat`` (averaged over several MC samples) or, with one sample, computed here
    from ``sample`` and ``grad`` (which saves a pass); ``learn_hess=False`` keeps ``h`` fixed.
    """
    if learn_hess and stat is None:
        stat = hess_statistic(grad, sample, mean, hess_approx=hess_approx)
    new = ivon_update(
        mean,
        momentum,
        hess,
        grad,
        stat if learn_hess else None,
        mask,
        hyper,
        hess_approx=hess_approx,
    )
    for dst, src in zip((mean, momentum, hess), new, strict=True):
        if src is not dst:
            dst.copy_(src)


def stat_(
    stat: Tensor, grad: Tensor, sample: Tensor | None, mean: Tensor, *, hess_approx: str, count: int
) -> None:
    """Fold the ``count``-th MC sample's statistic into the running mean ``stat`` (``count = 1``: set it)."""
    new = hess_statistic(grad, sample, mean, hess_approx=hess_approx)
    stat.copy_(new if count == 1 else stat + (new - stat) / count)
