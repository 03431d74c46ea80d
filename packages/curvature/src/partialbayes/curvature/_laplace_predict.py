"""The linearised predictive of a Laplace posterior from ``f_MAP`` and ``Σ_f = J Σ Jᵀ``: links and samples.

Pure functions of the logits as the model returns them (``[B, C]`` or ``[B, T, C]``), the kept positions of
token-level logits and one covariance ``[N, C, C]`` per output row. The formulas are
``partialbayes.predictive``'s (`probit`, `laplace_bridge`, `mc_predictive`, `sample_logits`,
`gaussian_predictive`); this module only places the results back at the model's output shape. Positions
that are not kept (attention mask 0, label -100) hold the MAP prediction: the softmax of the logits, the
logits themselves for samples, and the noise variance alone for regression. Nothing there is NaN.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from partialbayes.curvature._laplace_core import LaplaceCore
from partialbayes.curvature._outputs import output_rows, split_chunks
from partialbayes.predictive import (
    check_count,
    check_generator,
    gaussian_predictive,
    laplace_bridge,
    mc_predictive,
    probit,
    resolve_link,
    sample_logits,
)

#: The links every Laplace posterior offers; the first is the default.
LINKS = ("probit", "mc", "bridge")


def _rows(logits: Tensor, keep: Tensor | None, dtype: torch.dtype) -> Tensor:
    f = logits if keep is None else logits[keep]
    return f.to(dtype)


def _place(full: Tensor, keep: Tensor | None, rows: Tensor) -> Tensor:
    """``rows [..., N, C]`` at the kept positions of ``full [..., B, T, C]`` (or ``rows`` for ``keep=None``)."""
    if keep is None:
        return rows
    out = full.clone()
    out[..., keep, :] = rows
    return out


def classification_predictive(
    logits: Tensor,
    keep: Tensor | None,
    cov: Tensor,
    *,
    link: str,
    n_samples: int,
    generator: torch.Generator | None,
) -> Tensor:
    """Predictive probabilities of ``softmax(f)``, ``f ~ N(f_MAP, Σ_f)``, at the model's output shape.

    Args:
        logits: ``f_MAP`` as the model returns it, ``[B, C]`` or ``[B, T, C]``.
        keep: ``[B, T]`` kept positions of token-level logits (``None`` for ``[B, C]``).
        cov: ``Σ_f`` ``[N, C, C]``, one per kept output (row-major ``(b, t)`` order); its dtype is the
            dtype of the computation.
        link: ``"probit"`` (``softmax(κ ⊙ f)``, ``κ_c = (1 + π/8 Σ_cc)^(-1/2)``), ``"mc"`` (``n_samples``
            draws of ``f``, averaged softmax) or ``"bridge"`` (the Laplace bridge's Dirichlet mean).
        n_samples: Number of draws for ``"mc"``.
        generator: Source of randomness of ``"mc"`` (on the device of ``cov``).

    Returns:
        Probabilities with the shape and dtype of ``logits``; positions that are not kept hold
        ``softmax(f_MAP)``.
    """
    f = _rows(logits, keep, cov.dtype)
    if link == "probit":
        probs = probit(f, cov)
    elif link == "bridge":
        probs = laplace_bridge(f, cov)
    elif link == "mc":
        probs = mc_predictive(f, cov, n_samples, generator=generator)
    else:
        raise ValueError(f"link must be one of {LINKS}, got {link!r}")
    full = None if keep is None else torch.softmax(logits.to(cov.dtype), dim=-1)
    out = probs if full is None else _place(full, keep, probs)
    return out.to(logits.dtype)


def regression_predictive(
    logits: Tensor, keep: Tensor | None, cov: Tensor, noise_var: float
) -> tuple[Tensor, Tensor]:
    """Linearised Gaussian predictive ``N(f_MAP, diag Σ_f + σ²)`` at the model's output shape.

    The variance includes the observation noise ``σ²``: it is the variance of a new target, not of the
    function (subtract ``σ²`` for the latter). Every link gives this same closed form (the integral is
    Gaussian; the links approximate the softmax's).

    Args:
        logits: ``f_MAP``, ``[B, C]`` or ``[B, T, C]``.
        keep: ``[B, T]`` kept positions of token-level outputs (``None`` for ``[B, C]``).
        cov: ``Σ_f`` ``[N, C, C]``.
        noise_var: ``σ²``.

    Returns:
        ``(mean, variance)``, each with the shape and dtype of ``logits``; positions that are not kept hold
        ``(f_MAP, σ²)``.
    """
    f = _rows(logits, keep, cov.dtype)
    mean, var = gaussian_predictive(f, cov.diagonal(dim1=-2, dim2=-1), noise_var)
    if keep is not None:
        full = logits.to(cov.dtype)
        mean = _place(full, keep, mean)
        var = _place(torch.full_like(full, noise_var), keep, var)
    return mean.to(logits.dtype), var.to(logits.dtype)


def linearised_logit_samples(
    logits: Tensor,
    keep: Tensor | None,
    cov: Tensor,
    n: int,
    *,
    generator: torch.Generator | None,
) -> Tensor:
    """``n`` draws of the linearised logits ``f ~ N(f_MAP, Σ_f)``, ``[n, *logits.shape]``.

    Regression: draws of the function (no observation noise). Positions that are not kept hold ``f_MAP``.
    The draws of different outputs are independent (``Σ_f`` is per output; the covariance between two
    examples or positions is not modelled).

    Args:
        logits: ``f_MAP``, ``[B, C]`` or ``[B, T, C]``.
        keep: ``[B, T]`` kept positions (``None`` for ``[B, C]``).
        cov: ``Σ_f`` ``[N, C, C]``.
        n: Number of draws.
        generator: Source of randomness (on the device of ``cov``).

    Returns:
        ``[n, B, C]`` or ``[n, B, T, C]`` in the dtype of ``logits``.
    """
    f = _rows(logits, keep, cov.dtype)
    draws = sample_logits(f, cov, n, generator=generator)  # [n, N, C]
    if keep is not None:
        full = logits.to(cov.dtype).expand(n, *logits.shape)
        draws = _place(full, keep, draws)
    return draws.to(logits.dtype)


class LaplacePredictive(LaplaceCore):
    """The linearised predictive of a batch (part of `LaplaceBase`)."""

    def _linearised(
        self, batch: Any, chunk_size: int | None = None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """``(logits [B, C] | [B, T, C], keep [B, T] | None, Σ_f [N, C, C])`` of one batch at the prior."""
        self._require_fit()
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        inputs, outputs = self._read(batch)
        logits, keeps, covs = [], [], []
        for part, part_outputs in split_chunks(inputs, outputs, chunk_size):
            f, keep, (cov,) = self._mean_covs(part, part_outputs, [self._prior], self._scale(None))
            logits.append(f.detach())
            keeps.append(keep)
            covs.append(cov.to(self.dtype))
        keep_all = None if keeps[0] is None else torch.cat([k for k in keeps if k is not None])
        logits_all = torch.cat(logits)
        if not bool(torch.isfinite(output_rows(logits_all, keep_all)).all()):
            raise ValueError(
                "the model's logits for this batch are not finite (NaN or inf in the inputs?): "
                "no predictive is computed from them"
            )
        return logits_all, keep_all, torch.cat(covs)

    def logit_mean_cov(self, batch: Any, chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
        """Linearised predictive: ``f_MAP`` and the functional covariance ``J Σ Jᵀ`` per output.

        Args:
            batch: A tensor ``x``, a pair ``(inputs, labels)`` or a mapping batch (``dict``,
                ``BatchEncoding``). Label values are ignored; for token-level outputs labels of -100 (and
                an attention mask of 0) mark the positions that are skipped.
            chunk_size: Process at most this many examples at a time (bounds the memory of the recorded
                activations and output gradients); ``None`` = the whole batch at once.

        Returns:
            ``(f [N, C], Σ_f [N, C, C])`` in the dtype of the logits: ``N = B`` for ``[B, C]`` logits; for
            token-level logits ``[B, T, C]`` the ``N`` kept positions in row-major ``(b, t)`` order (as
            ``partialbayes.predictive.flatten_outputs`` orders them). Each kept position costs ``C``
            backward passes and a ``[C, C]`` covariance: with a large vocabulary, keep only the positions
            you need (labels -100 elsewhere) or use `predictive_samples` on few positions.

        Raises:
            TypeError: A batch of an unknown kind (the message names its type and the accepted ones).
            ValueError: Token-level logits with neither an attention mask nor labels; logits that are not
                finite.
        """
        logits, keep, cov = self._linearised(batch, chunk_size)
        f = output_rows(logits, keep)
        return f, cov.to(f.dtype)

    def predict(
        self,
        batch: Any,
        *,
        link: str | None = None,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The linearised predictive of a batch, at the model's output shape.

        The logits are linearised around the MAP, ``f ~ N(f_MAP, Σ_f)`` with ``Σ_f = J Σ Jᵀ`` (see
        `logit_mean_cov`), and integrated against the likelihood with
        ``partialbayes.predictive``'s approximations.

        Args:
            batch: A tensor ``x``, a pair ``(inputs, labels)`` or a mapping batch (``dict``,
                ``BatchEncoding``); label values are ignored (for token-level outputs, -100 marks a
                position to skip).
            link: Classification: ``"probit"`` (default; ``softmax(κ ⊙ f_MAP)`` with
                ``κ_c = (1 + π/8 Σ_f,cc)^(-1/2)``), ``"mc"`` (``n_samples`` draws of ``f``, averaged
                softmax) or ``"bridge"`` (the Laplace bridge). Regression: every link gives the closed-form
                Gaussian predictive.
            n_samples: Draws for ``link="mc"``.
            generator: Source of randomness for ``link="mc"`` (on the model's device); same seed, same
                result.

        Returns:
            Classification: probabilities with the logits' shape and dtype, ``[B, C]`` or ``[B, T, C]``.
            Regression: ``(mean, variance)`` of a new target, each ``[B, C]`` (or ``[B, T, C]``); the
            variance is ``diag Σ_f + σ²``, the observation noise included. Token-level positions that are
            skipped (attention mask 0, label -100) hold the MAP prediction: ``softmax(f_MAP)``, or
            ``(f_MAP, σ²)``; never NaN.

        Raises:
            ValueError: A link the posterior does not offer (the message lists `links`), a bad
                ``n_samples``, token-level logits with neither an attention mask nor labels, logits that
                are not finite.
            TypeError: A batch of an unknown kind, a ``generator`` that is not a ``torch.Generator``.
        """
        link = resolve_link(link, self.links, type(self).__name__)
        n_samples = check_count("n_samples", n_samples)
        check_generator(generator)
        logits, keep, cov = self._linearised(batch)
        if self.likelihood == "regression":
            return regression_predictive(logits, keep, cov, self.sigma_noise**2)
        return classification_predictive(
            logits, keep, cov, link=link, n_samples=n_samples, generator=generator
        )

    def predictive_samples(
        self, batch: Any, n: int, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """``n`` draws of the linearised logits ``f ~ N(f_MAP, Σ_f)`` for a batch.

        The input of ``partialbayes.predictive``'s uncertainty decomposition. Outputs are drawn
        independently of each other (``Σ_f`` is per output); regression draws the function, without the
        observation noise. Token-level positions that are skipped hold ``f_MAP``.

        Args:
            batch: Any accepted batch (label values are ignored).
            n: Number of draws.
            generator: Source of randomness (on the model's device).

        Returns:
            ``[n, B, C]`` (or ``[n, B, T, C]``) in the logits' dtype.
        """
        n = check_count("n", n)
        check_generator(generator)
        logits, keep, cov = self._linearised(batch)
        return linearised_logit_samples(logits, keep, cov, n, generator=generator)
