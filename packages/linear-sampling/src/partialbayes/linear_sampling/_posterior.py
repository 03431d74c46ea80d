"""Sampling-based linearised Laplace over a subset of a network: a ``partialbayes.predictive.Posterior``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from partialbayes.linear_sampling._io import read_posterior, write_posterior
from partialbayes.linear_sampling._network import (
    _Chosen,
    _Operators,
    network_parameters,
    read_batches,
)
from partialbayes.linear_sampling._ops import check_memory
from partialbayes.linear_sampling._precision import NoisePrecision, Prior, softmax_hessian
from partialbayes.linear_sampling._sgd import SGDConfig, SolveInfo
from partialbayes.linear_sampling._solve import posterior_samples
from partialbayes.predictive import is_causal_lm, probit
from partialbayes.predictive.internal import (
    answer_index,
    answer_only,
    check_int,
    check_likelihood,
    check_number,
    eval_mode,
    resolve_link,
    rows,
    split_batch,
)
from partialbayes.selection import Subset
from partialbayes.selection.internal import check_subset


class SampledLaplace:
    """Linearised Laplace on a ``Subset`` of a network, represented by sample-then-optimise samples.

    `fit` reads the training batches: features ``J`` (the logits' Jacobian in the subset, as JVP / VJP
    operators), noise precision ``B`` (softmax Hessian at the MAP, or ``1/σ²``), prior ``A``, and ``k``
    samples ``z_j ~ N(0, H⁻¹)``, ``H = JᵀBJ + A``. Only the samples (``d·k`` floats) and the MAP entries are
    kept. As a ``partialbayes.predictive.Posterior``:

    * `sample` returns ``θ* + z_j`` for ``n`` distinct stored columns (more than ``k`` raises);
    * `predict` ``"mc"`` averages ``softmax(f(x; θ*) + J(x) z_j)`` (the linearised predictive); ``"probit"``
      uses the sample variances of ``J z_j``; regression returns ``(f, variance + σ²)``;
    * `swapped` / `sampled` write ``θ* + z_j`` into the network itself.

    Args:
        model: The network at its MAP.
        subset: A ``partialbayes.selection.Subset`` of ``model``.
        likelihood: ``"classification"`` or ``"regression"``.
        prior_precision: ``A``: a positive float, or a
            [`Prior`][partialbayes.linear_sampling.Prior] (per-group precisions over the ``d`` entries, in
            ``Subset.gather`` order).
        sigma_noise: Observation noise standard deviation σ (regression).
        jitter: Added to the softmax Hessian's diagonal (classification; it is singular along ``1``).

    Raises:
        TypeError: If ``subset`` is not a ``Subset`` or ``model`` not a module.
        ValueError: If the subset does not fit the model (or its parameters are on the ``meta``
            device), or a setting is out of range.
    """

    links: ClassVar[tuple[str, ...]] = ("mc", "probit")

    def __init__(
        self,
        model: nn.Module,
        subset: Subset,
        *,
        likelihood: str = "classification",
        prior_precision: float | Prior = 1.0,
        sigma_noise: float = 1.0,
        jitter: float = 1e-6,
    ) -> None:
        check_subset(subset, empty_ok=False)
        subset.parameters_of(model)
        self.sigma_noise = check_likelihood(likelihood, sigma_noise)
        if isinstance(prior_precision, Prior):
            self.prior = prior_precision
        else:
            self.prior = Prior(check_number("prior_precision", prior_precision))
        self.model = model
        self.subset = subset
        self.likelihood = likelihood
        self.jitter = check_number("jitter", jitter)
        self.samples: Tensor | None = None
        self.info: SolveInfo | None = None
        self._map: Tensor | None = None
        self._ops: _Operators | None = None

    # ------------------------------------------------------------------ state
    @property
    def num_entries(self) -> int:
        """Number ``d`` of stochastic entries."""
        return self.subset.num_entries()

    @property
    def n_stored(self) -> int:
        """Number ``k`` of stored samples."""
        return self._require_fit().shape[1]

    @property
    def num_floats(self) -> int:
        """Floats stored beyond the MAP weights: the ``d·k`` samples."""
        return self._require_fit().numel()

    def _require_fit(self) -> Tensor:
        if self.samples is None:
            raise ValueError("SampledLaplace is not fitted: call fit(batches) first")
        return self.samples

    def _operators(self) -> _Operators:
        if self._ops is None:
            self._ops = _Operators(self.model, _Chosen(self.model, self.subset), None)
        return self._ops

    # -------------------------------------------------------------------- fit
    def fit(
        self,
        batches: Iterable[Any],
        *,
        n_samples: int = 32,
        method: str = "cg",
        objective: str = "low_variance",
        tol: float = 1e-6,
        max_iter: int | None = None,
        sgd: SGDConfig | None = None,
        batch_size: int | None = None,
        generator: torch.Generator | None = None,
    ) -> SampledLaplace:
        """Draw ``n_samples`` posterior samples ``z_j ~ N(0, H⁻¹)`` from the training batches (eval mode).

        The batches are read once and held while sampling (`loader_features`); labels only decide which outputs
        count (-100 skips an output; a batch without any is skipped with a warning).

        Args:
            batches: Training batches of any kind (a ``DataLoader`` with ``DataCollatorWithPadding``,
                ``(inputs, labels)`` pairs, dicts).
            n_samples: ``k``, the number of samples kept (memory ``d·k``).
            method: ``"cg"`` (conjugate gradients on full-data products; exact to ``tol``, the default) or
                ``"sgd"`` (minibatch SGD, the paper's choice for very large ``n``).
            objective: ``"low_variance"`` or ``"standard"`` (see `posterior_samples`).
            tol: CG relative residual tolerance.
            max_iter: CG iteration cap (default ``2d + 10``).
            sgd: SGD settings.
            batch_size: Observations per operator call (CG) / SGD batch size.
            generator: CPU generator for the sample-then-optimise noise.

        Returns:
            ``self``.

        Raises:
            ValueError: If ``batches`` or a batch is empty (the batch is named), or no batch has a
                labelled output.

        Warns:
            RuntimeWarning: If the solver stops before its tolerance (the samples are then approximate).
        """
        k = check_int("n_samples", n_samples)
        with eval_mode(self.model):
            features, logits = read_batches(self._operators(), batches)
            if self.likelihood == "classification":
                noise = softmax_hessian(logits, jitter=self.jitter)
            else:
                noise = NoisePrecision(
                    torch.tensor(self.sigma_noise**-2, dtype=features.dtype, device=features.device)
                )
            result = posterior_samples(
                features,
                noise,
                self.prior,
                k,
                method=method,
                objective=objective,
                tol=tol,
                max_iter=2 * features.d + 10 if max_iter is None else max_iter,
                sgd=sgd,
                batch_size=batch_size,
                generator=generator,
            )
        self.samples = result.samples.detach()
        self.info = result.info
        self._map = network_parameters(self.model, self.subset)
        return self

    # ---------------------------------------------------------------- samples
    def _columns(self, n: int, generator: torch.Generator | None) -> Tensor:
        k = self.n_stored
        if n > k:
            raise ValueError(
                f"{n} samples asked for, but only k={k} posterior samples are stored: fit with "
                f"n_samples >= {n}"
            )
        device = generator.device if generator is not None else None
        return torch.randperm(k, generator=generator, device=device)[:n]

    def sample(self, n: int = 1, *, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """``n`` distinct stored samples ``θ* + z_j`` as ``{param name: [n, k]}``, chosen with ``generator``.

        Raises:
            ValueError: Before `fit`, or if ``n`` exceeds the stored samples.
        """
        check_int("n", n)
        z = self._require_fit()
        assert self._map is not None
        flat = (self._map.unsqueeze(1) + z[:, self._columns(n, generator).to(z.device)]).T
        sizes = [self.subset.num_entries(name) for name in self.subset.names]
        return dict(zip(self.subset.names, flat.split(sizes, dim=-1), strict=True))

    def swapped(self, sample: Mapping[str, Tensor]) -> AbstractContextManager[nn.Module]:
        """Write one sample ``{param name: [k]}`` into the model; restore what it found on exit, even on error.

        See ``partialbayes.selection.Subset.swapped``.
        """
        return self.subset.swapped(self.model, sample)

    def sampled(
        self, *, generator: torch.Generator | None = None
    ) -> AbstractContextManager[nn.Module]:
        """Swap one stored sample into the model (see `swapped`); yields the model."""
        return self.swapped(rows(self.sample(1, generator=generator), 0))

    # ------------------------------------------------------------- predictive
    def _linearised(
        self,
        batch: Any,
        cols: Tensor | None,
        each: Callable[[Tensor, Tensor], Tensor],
        *,
        cat: bool = False,
        result: tuple[Callable[[Tensor], int], str, str] | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``f(x; θ*)`` and ``each(f, J z_c)`` over the chosen columns ``z_c``, pushed forward a few at a time.

        ``result`` sizes the output so the call is refused up front if free memory cannot hold it; with
        ``target_ids`` ``f`` and ``J z`` are the ``[P, K]`` answer logits.
        """
        z = self._require_fit()
        z = z if cols is None else z[:, cols.to(z.device)]
        ops = self._operators()
        b = split_batch(batch, device=z.device)
        parts: list[Tensor] = []
        with eval_mode(self.model):
            f = ops.forward(b.inputs)
            numel, rows = f.numel(), None
            if answer_only(target_ids, self.likelihood == "regression"):
                causal = is_causal_lm(self.model)
                kw = {"labels": b.labels, "attention_mask": b.attention_mask, "causal_lm": causal}
                rows = answer_index(f, target_ids, **kw)
                f = f[rows]
            if result is not None:
                per, what, instead = result
                nbytes = f.numel() * per(f) * max(f.element_size(), z.element_size())
                check_memory(nbytes, f.device, f"{what} of outputs {tuple(f.shape)}", instead)
            for jz in ops.jvp(b.inputs, z, numel, rows):
                part = each(f, jz.reshape(*f.shape, jz.shape[-1]))
                parts = [*parts, part] if cat or not parts else [parts[0] + part]
        return f, torch.cat(parts) if cat else parts[0]

    def predictive_samples(
        self,
        batch: Any,
        n: int,
        *,
        generator: torch.Generator | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor:
        """``n`` linearised logit samples ``f(x; θ*) + J(x) z_j``, ``[n, B, C]`` (``[n, P, K]`` with ``target_ids``).

        The ``z_j`` are ``n`` distinct stored samples chosen with ``generator`` (as in `sample`).

        Raises:
            ValueError: If ``n`` exceeds the stored samples, or the result would not fit in the free memory.
        """
        check_int("n", n)

        def draws(f: Tensor, jz: Tensor) -> Tensor:
            return f.unsqueeze(0) + jz.movedim(-1, 0)

        instead = "draw fewer samples, or pass fewer examples"
        size = (lambda f: n, f"predictive_samples(n={n})", instead)
        cols = self._columns(n, generator)
        return self._linearised(batch, cols, draws, cat=True, result=size, target_ids=target_ids)[1]

    def logit_mean_cov(
        self, batch: Any, *, target_ids: Sequence[int] | Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(f [..., C], cov [..., C, C])``: ``f(x; θ*)`` and the sample covariance ``(1/k) Σ_j (J z_j)(J z_j)ᵀ``.

        An unbiased estimate of ``J H⁻¹ Jᵀ`` from all ``k`` stored samples; ``target_ids``: of the ``[P, K]``
        answer logits only.

        Raises:
            ValueError: If the covariances would not fit in the free memory (10 GB per output at a 50,257-token
                vocabulary): `predict` and `predictive_samples` form no ``C x C`` blocks.
        """
        k = self.n_stored

        def outer(f: Tensor, jz: Tensor) -> Tensor:
            return jz @ jz.transpose(-1, -2) / k

        instead = "use predict or predictive_samples, which form no C x C blocks"
        size = (lambda f: f.shape[-1], "logit_mean_cov", instead)
        return self._linearised(batch, None, outer, result=size, target_ids=target_ids)

    def predict(
        self,
        batch: Any,
        *,
        link: str | None = None,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        target_ids: Sequence[int] | Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The linearised predictive for a batch, samples pushed forward a few at a time.

        Args:
            batch: Any batch kind (labels only mark the answers of ``target_ids``).
            link: ``"mc"`` (default: average softmax over ``min(n_samples, k)`` stored samples, chosen
                with ``generator`` when fewer than ``k``) or ``"probit"`` (probit approximation with the
                sample variances of all ``k`` samples; ``n_samples`` unused).
            n_samples: Linearised samples to average (``"mc"``), at most the ``k`` stored.
            generator: Chooses the samples for ``"mc"``.
            target_ids: Answer-only (classification): the ``K`` answer tokens' distribution at the answer
                positions, renormalised over them; the JVPs keep only those logits.

        Returns:
            Probabilities of the logits' shape (``[P, K]`` with ``target_ids``); regression:
            ``(f, variance + σ²)``.
        """
        link = resolve_link(link, self.links, "SampledLaplace")
        check_int("n_samples", n_samples)
        k = self.n_stored
        mc = link == "mc" and self.likelihood == "classification"
        cols = None if not mc or n_samples >= k else self._columns(n_samples, generator)
        s = k if cols is None else n_samples

        def moment(f: Tensor, jz: Tensor) -> Tensor:
            acc = torch.promote_types(f.dtype, torch.float32)
            if mc:
                return torch.softmax(f.to(acc).unsqueeze(-1) + jz.to(acc), dim=-2).sum(-1) / s
            return jz.to(acc).square().sum(-1) / k

        f, out = self._linearised(batch, cols, moment, target_ids=target_ids)
        f = f.to(out.dtype)
        if self.likelihood == "regression":
            return f, out + self.sigma_noise**2
        return out if mc else probit(f, out)

    # ------------------------------------------------------------------ io
    def save(self, path: str | os.PathLike[str]) -> None:
        """Save a fitted posterior to ``path``: one safetensors file, JSON metadata in its header.

        Tensors ``samples`` ``[d, k]``, ``map`` ``[d]``, ``prior_alpha`` (and ``prior_groups``); metadata: the
        subset, the model's structure, the likelihood, ``sigma_noise``, ``jitter`` and the solver's info.

        Raises:
            ValueError: If the posterior is not fitted.
        """
        write_posterior(self, path)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], model: nn.Module, *, check_weights: bool = True
    ) -> SampledLaplace:
        """Load a posterior saved by `save` onto ``model`` (its device and dtype).

        A model whose subset values differ from the saved MAP is refused unless ``check_weights=False`` (the
        predictive then linearises at its current weights).

        Raises:
            ValueError: If the file is not a saved `SampledLaplace`, or ``model``'s structure or weights do
                not match.
        """
        return read_posterior(path, model, cls, check_weights)
