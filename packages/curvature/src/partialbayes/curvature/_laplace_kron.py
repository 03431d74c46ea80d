"""Kronecker-factored Laplace posterior (KFAC / S-KFAC blocks) over a Kronecker-structured `Subset`."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from partialbayes.curvature._hooks import Run
from partialbayes.curvature._kfac import (
    LowRankFactor,
    block_key,
    kron_factors,
    kron_targets,
    lowrank_log_det,
    precision_eigenvalues,
    scale_in_basis,
    truncated,
    whole_factor,
)
from partialbayes.curvature._laplace import LaplaceBase, MapLoss
from partialbayes.curvature._laplace_projected import KronBlocks, kron_predictive
from partialbayes.curvature._likelihood import CurvatureOptions, Outputs, check_list
from partialbayes.curvature._memory import MemoryEstimate, batch_estimate
from partialbayes.predictive.internal import (
    PosteriorFile,
    check_generator,
    check_number,
    prefixed,
)
from partialbayes.selection import Subset


class KronLaplace(LaplaceBase):
    """Laplace posterior with one Kronecker-factored block per linear map of the subset.

    Each block covers ``vec(W[R][:, C] | b[R])`` (row-major, bias as the last column) with precision
    ``P = (G ⊗ A) / T + δ_m I``, ``G = G[R, R]`` summed over the data and ``A = A[C, C]`` averaged (KFAC on
    whole modules, S-KFAC on row / column blocks). Only the eigendecompositions of ``G`` and ``A`` are stored:
    the prior is added exactly in their eigenbasis, and no dense covariance is ever formed. Prior precision:
    scalar or one per module (keys: module names of ``subset.kron_modules()``).

    Args:
        model: The fine-tuned model.
        subset: A Kronecker-structured subset (``KronBlock`` blocks on linear maps).
        sharing: Weight sharing over tokens, ``"reduce"`` or ``"expand"``; ``None`` (default): chosen by `fit`
            (``"expand"`` for token-level logits ``[B, T, C]``, else ``"reduce"``) and recorded.
        bias: ``"fold"`` (bias folded into ``A``, ``x̃ = (x, 1)``) or ``"separate"`` (its own block
            ``G ⊗ A_bias``: ``A`` becomes ``blockdiag(A, A_bias)``, no weight–bias cross terms). Saved.
        predictive_rtol: ``0`` (default): the exact linearised predictive. ``ε > 0``: eigendirection pairs with
            curvature at most ``ε · δ`` count at their prior variance, so only the leading eigenvectors are
            rotated; each term is then overestimated by a factor of at most ``1 + ε``. Saved.
        max_rank: Keep a factor side larger than this as its ``max_rank`` leading eigenpairs plus an isotropic
            remainder (a streamed Nyström sketch, never ``n × n``); ``None`` (default): every factor whole; one not
            below any factor's size warns. Saved.
        **kwargs: See `LaplaceBase` (likelihood, prior_precision, temperature, sigma_noise, fisher, ...).

    Raises:
        TypeError: If the subset holds elementwise ``MaskBlock`` blocks (use `DiagLaplace` or `DenseLaplace`).
    """

    _SAVED: ClassVar[tuple[str, ...]] = ("sharing", "bias", "predictive_rtol", "max_rank")

    def __init__(
        self,
        model: nn.Module,
        subset: Subset,
        *,
        sharing: str | None = None,
        bias: str = "fold",
        predictive_rtol: float = 0.0,
        max_rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.predictive_rtol = check_number("predictive_rtol", predictive_rtol, "[0, 1)")
        self._eig: dict[str, tuple[LowRankFactor, LowRankFactor]] = {}  # (G, A) per module
        self._memo: tuple[Any, KronBlocks] | None = None  # the last `_blocks` (one per prior grid)
        # per module: its ``1/E`` stacks by priors, shared with the posteriors of one `fit_many` that hold
        # the same block; and `fit_many`'s ``{id(factors): (factors, (G, A), stacks)}`` while it fits
        self._stacks: dict[str, weakref.WeakValueDictionary[Any, Tensor]] = {}
        self._fit_memo: dict[int, Any] | None = None
        super().__init__(model, subset, **kwargs)
        self._options: CurvatureOptions = replace(
            self._options, sharing=sharing, bias=bias, max_rank=max_rank
        )
        # per module: ``(r, c_w, c)`` (``c = c_w + 1`` with a bias), a separate bias, the factor sizes
        self._dims: dict[str, tuple[int, int, int]] = {}
        self._separate: set[str] = set()
        self._sides: dict[str, dict[str, int]] = {}
        for m, km in self._kmods.items():
            r, cw, c = km.n_rows, km.n_cols, km.n_cols + (km.bias_name is not None)
            self._dims[m] = (r, cw, c)
            if c > cw and self._options.bias == "separate":
                self._separate.add(m)
            self._sides[m] = {"G": r, "A": cw if m in self._separate else c}
        sizes = {f"{s} of {m!r} ({n})": n for m in self.modules for s, n in self._sides[m].items()}
        if max_rank is not None and max(sizes.values()) <= max_rank:
            largest = max(sizes, key=sizes.__getitem__)
            warnings.warn(
                f"max_rank={max_rank} is not below the size of any factor (the largest: {largest}): "
                "every factor is kept whole",
                stacklevel=2,
            )

    @property
    def sharing(self) -> str | None:
        """KFAC weight sharing, ``"reduce"`` or ``"expand"`` (``None`` until `fit` chooses it)."""
        return self._options.sharing

    @property
    def bias(self) -> str:
        """``"fold"`` or ``"separate"``: how the bias enters its block."""
        return self._options.bias

    @property
    def max_rank(self) -> int | None:
        """Factor sides larger than this are kept low-rank (``None``: all whole)."""
        return self._options.max_rank

    # ------------------------------------------------------------------ the blocks
    def _groups(self) -> dict[str, str]:
        """Resolve the Kronecker modules once (`fit` and the predictive reuse them); one prior per module."""
        self._targets = kron_targets(self.model, self.subset, "KronLaplace")
        self._kmods = self._targets.kmods
        return {
            n: m
            for m, km in self._kmods.items()
            for n in (km.weight_name, km.bias_name)
            if n is not None
        }

    def _rank(self, n: int) -> int:
        """The rank a factor side of size ``n`` is kept at."""
        max_rank = self._options.max_rank
        return n if max_rank is None else min(n, max_rank)

    def block_to_params(self, module: str, block: Tensor) -> dict[str, Tensor]:
        """Split block matrices ``[..., r, c]`` (bias column last) into the module's parameters.

        Returns:
            ``{weight name: [..., r·c_w], bias name: [..., r]}`` in ``subset.gather`` order (a Conv1D's weight
            part transposed to its ``n_in x n_out`` storage).
        """
        km = self._kmods[module]
        _, cw, _ = self._dims[module]
        w = block[..., :cw]
        if km.transposed:
            w = w.transpose(-1, -2)
        out = {km.weight_name: w.reshape(*block.shape[:-2], -1)}
        if km.bias_name is not None:
            out[km.bias_name] = block[..., cw]
        return out

    def params_to_block(self, module: str, values: Mapping[str, Tensor]) -> Tensor:
        """Inverse of `block_to_params`: ``{param: [..., k]}`` -> ``[..., r, c]``."""
        km = self._kmods[module]
        r, cw, _ = self._dims[module]
        w = values[km.weight_name]
        lead = w.shape[:-1]
        w = w.reshape(*lead, cw, r).transpose(-1, -2) if km.transposed else w.reshape(*lead, r, cw)
        if km.bias_name is None:
            return w
        return torch.cat([w, values[km.bias_name].unsqueeze(-1)], dim=-1)

    # ------------------------------------------------------------------ curvature
    def _compute_curvature(self, loader: Iterable[Any], run: Run) -> Any:
        return kron_factors(self.model, loader, [self._targets], self._options, run)[0]

    @classmethod
    def fit_many(
        cls,
        model: nn.Module,
        subsets: Sequence[Subset],
        loader: Iterable[Any],
        *,
        progress: bool = False,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> list[KronLaplace]:
        """One posterior per subset, all fitted in ONE pass over ``loader`` (an S-KFAC ramp, module ramps).

        Equals ``[KronLaplace(model, s, **kwargs).fit(loader, progress=..., generator=...) for s in subsets]`` bit
        for bit (`kfac_many`); ``kwargs`` are the constructor settings shared by every posterior. A block (map, rows,
        columns) that several subsets hold is accumulated and eigendecomposed once, and its share of a predictive is
        computed once per prior (`logit_mean_cov_many`, `grid_val_nll_many`): module ramps that reuse maps cost about
        what their union costs. Memory: the distinct blocks' factor sums during the pass, then one eigendecomposition
        at a time; checked against ``max_memory`` (or the free memory) before the first batch's backward passes.

        Returns:
            The fitted posteriors, in the order of ``subsets``.

        Raises:
            TypeError, ValueError: Not a non-empty list of subsets; what the constructor and `fit` refuse.
        """
        if "previous" in kwargs:  # a fit argument: say so, not __init__'s raw TypeError
            raise TypeError("fit_many takes no previous=: fit(loader, previous=...) each posterior")
        posteriors = [cls(model, s, **kwargs) for s in check_list(subsets, "subsets", Subset)]
        first = posteriors[0]
        loss = MapLoss(first.likelihood)
        run = Run(check_generator(generator), progress, loss)

        targets = [p._targets for p in posteriors]
        blocks = {block_key(m, k): k for t in targets for m, k in t.kmods.items()}
        kmods = {f"{key[0]} ({i})": k for i, (key, k) in enumerate(blocks.items())}
        run.preflight = lambda f, keep, mask: batch_estimate(
            f, keep, mask, first._options, 0, kmods=kmods
        ).check(first.max_memory)
        factors = kron_factors(model, loader, targets, first._options, run)
        total, n, n_out = loss.result(first.device)
        run.finish(model)
        memo: dict[int, Any] = {}
        for p in posteriors:
            p._fit_memo = memo
            try:
                p.fit_curvature(factors.pop(0), map_loss=total, n_data=n, n_outputs=n_out)
            finally:
                p._fit_memo = None
        return posteriors

    def _set_curvature(self, curvature: Mapping[str, Any]) -> None:
        """Check and store ``{module: factors}``, adopting or matching their ``sharing``."""
        missing = [m for m in self.modules if m not in curvature]
        extra = [m for m in curvature if m not in self.modules]
        if missing or extra:
            raise ValueError(f"factors do not match the subset: missing {missing}, unknown {extra}")
        eig, stacks, memo = {}, {}, self._fit_memo
        dtype, max_rank = self._options.dtype, self._options.max_rank
        for m in self.modules:
            if memo is not None and id(curvature[m]) in memo:  # checked for another subset
                _, eig[m], stacks[m] = memo[id(curvature[m])]
                continue
            separate, sides = m in self._separate, self._sides[m]
            G, A = curvature[m].G, curvature[m].A
            A_bias = getattr(curvature[m], "A_bias", None)
            if separate != (A_bias is not None):
                kind = "fold the bias into A" if separate else "keep the bias separate (A_bias)"
                raise ValueError(
                    f"factors of module {m!r} {kind} but the posterior has bias={self.bias!r}: compute "
                    f"them with kfac(..., bias={self.bias!r}), or build KronLaplace with their bias"
                )
            shapes = [
                (f.U.shape[0],) * 2 if isinstance(f, LowRankFactor) else f.shape for f in (G, A)
            ]
            if [tuple(t) for t in shapes] != [(n, n) for n in sides.values()]:
                raise ValueError(
                    f"factors of module {m!r} have G {tuple(shapes[0])} and A {tuple(shapes[1])}, "
                    f"expected {(sides['G'],) * 2} and {(sides['A'],) * 2} for its block"
                )
            factors = []  # as stored: eigenpairs (at most max_rank), the posterior's dtype and device
            with prefixed(f"curvature of module {m!r}"):
                for what, f in zip(sides, (G, A), strict=True):
                    if isinstance(f, LowRankFactor):
                        parts = (t.to(self.device, dtype) for t in (f.U, f.s, f.rest))
                        factors.append(LowRankFactor(*parts))
                    else:
                        whole = whole_factor(f, dtype, self.device, what)
                        factors.append(whole if max_rank is None else truncated(whole, max_rank))
                g, a = factors
                if A_bias is not None:  # separate (checked above)
                    a = _with_separate_bias(a, A_bias.to(a.U))
            eig[m], stacks[m] = (g, a), weakref.WeakValueDictionary()
            if memo is not None:
                memo[id(curvature[m])] = (curvature[m], eig[m], stacks[m])
        shared = {str(s) for m in self.modules if (s := getattr(curvature[m], "sharing", None))}
        sharing = self._options.sharing
        if len(shared) > 1 or (sharing is not None and shared - {sharing}):
            raise ValueError(
                f"factors computed with sharing {sorted(shared)} do not fit this posterior "
                f"(sharing={sharing!r})"
            )
        if sharing is None and shared:
            self._options = replace(self._options, sharing=shared.pop())
        self._eig, self._stacks = eig, stacks

    def _eigenvalues(self, i: int, m: str, prior: Tensor, scale: Tensor | float) -> Tensor:
        """``E`` on the extended grid ``[r_G + 1, r_A + 1]`` (`_kfac`; ``[:-1, :-1]`` for whole factors)."""
        g, a = self._eig[m]
        return precision_eigenvalues(g, a, prior[i], self.temperature, scale)

    def _log_det(self, prior: Tensor, scale: Tensor | float) -> Tensor:
        dets = [
            lowrank_log_det(self._eigenvalues(i, m, prior, scale), *self._eig[m])
            for i, m in enumerate(self.modules)
        ]
        return torch.stack(dets).sum()

    def _sample(self, n: int, generator: torch.Generator | None) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for i, m in enumerate(self.modules):
            r, _, c = self._dims[m]
            w = self._eigenvalues(i, m, self._prior, self._scale(None)).rsqrt()
            eps = self._noise((n, r, c), generator)
            out.update(self.block_to_params(m, scale_in_basis(eps, *self._eig[m], w)))
        return out

    def _whole(self, m: str) -> tuple[LowRankFactor, LowRankFactor]:
        g, a = self._eig[m]
        if not (g.full and a.full):
            raise ValueError(
                f"module {m!r} keeps a low-rank factor (max_rank={self.max_rank}): continual learning "
                "(previous=, penalty) needs whole factors"
            )
        return g, a

    def _accumulate(
        self, curvature: Mapping[str, Any], previous: Any, n_data: int
    ) -> dict[str, Any]:
        """``G`` summed and ``A`` averaged over both episodes' examples: the factors of KFAC on their union."""
        w = previous.n_seen / (previous.n_seen + n_data)
        out = {}
        for m in self.modules:
            new = curvature[m]
            if isinstance(new.G, LowRankFactor) or isinstance(new.A, LowRankFactor):
                raise ValueError(f"{m!r}: continual learning needs whole factors (max_rank=None)")
            g, a = (f.U * f.s @ f.U.T for f in previous._whole(m))
            cw = new.A.shape[0]
            mix = lambda t, old: (1 - w) * t.to(self.device, self.dtype) + w * old  # noqa: E731
            out[m] = replace(
                new,
                G=new.G.to(self.device, self.dtype) + g,
                A=mix(new.A, a[:cw, :cw]),
                A_bias=None if new.A_bias is None else mix(new.A_bias, a[cw:, cw:]),
            )
        return out

    def _quad(self, delta: Mapping[str, Tensor], prior: Tensor, scale: Tensor | float) -> Tensor:
        """``Σ_m Σ_ij E_ij (U_Gᵀ Δ_m U_A)_ij²`` over the blocks ``Δ_m [r, c]`` (`params_to_block`)."""
        terms = []
        for i, m in enumerate(self.modules):
            g, a = self._whole(m)
            z = g.U.T @ self.params_to_block(m, delta) @ a.U
            terms.append((self._eigenvalues(i, m, prior, scale)[:-1, :-1] * z**2).sum())
        return torch.stack(terms).sum()

    def _estimate(
        self, logits: Tensor, keep: Tensor | None, mask: Tensor | None, k_out: int
    ) -> MemoryEstimate:
        return batch_estimate(logits, keep, mask, self._options, k_out, kmods=self._kmods)

    # ------------------------------------------------------------------ predictive
    def _covariances(
        self,
        inputs: Tensor | Mapping[str, Any],
        outputs: Outputs,
        priors: Sequence[Tensor],
        scale: Tensor | float,
    ) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        """Streamed: each module's ``Σ_ij M_k M_l / E`` is added as soon as its gradients exist (`_blocks`)."""
        logits, keep, (covs,) = kron_predictive(
            self.model, inputs, outputs, [self._blocks(priors, scale)]
        )
        return logits, keep, [c.to(self.dtype) for c in covs]

    @classmethod
    def _covariances_of(
        cls,
        posteriors: Sequence[LaplaceBase],
        inputs: Tensor | Mapping[str, Any],
        outputs: Outputs,
        priors: Sequence[Sequence[Tensor]],
    ) -> tuple[Tensor, Tensor | None, list[list[Tensor]]]:
        """One forward pass and one backward pass per class for all the posteriors (`kron_predictive`)."""
        posts = [p for p in posteriors if isinstance(p, KronLaplace)]
        if len(posts) < len(posteriors):  # a mix of structures: each runs its own passes
            return super()._covariances_of(posteriors, inputs, outputs, priors)
        parts = [p._blocks(pr, p._scale(None)) for p, pr in zip(posts, priors, strict=True)]
        logits, keep, covs = kron_predictive(posts[0].model, inputs, outputs, parts)
        covs = [[c.to(p._options.dtype) for c in cs] for p, cs in zip(posts, covs, strict=True)]
        return logits, keep, covs

    def _blocks(self, priors: Sequence[Tensor], scale: Tensor | float) -> KronBlocks:
        """This posterior's `KronBlocks` for ``priors`` (memoised; truncated by ``predictive_rtol``)."""
        key = (
            self._eig,
            self.temperature,
            [prior.tolist() for prior in priors],
            scale.tolist() if isinstance(scale, Tensor) else scale,
            self.predictive_rtol,
        )
        memo = self._memo
        if memo is not None and memo[0][0] is self._eig and memo[0][1:] == key[1:]:
            return memo[1]
        lowrank = {m: (g, a) for m, (g, a) in self._eig.items() if not (g.full and a.full)}
        exact = self.predictive_rtol == 0
        cut = {m: slice(None) if m in lowrank else slice(None, -1) for m in self.modules}
        stacked: dict[str, Tensor] = {}  # [r, c, n_priors], contiguous: for `stacked_covariances`
        for i, m in enumerate(self.modules):
            if exact or m in lowrank:
                stacks: MutableMapping[Any, Tensor] = self._stacks.get(m, {})
                at = (tuple(float(pr[i]) for pr in priors), key[1], str(key[3]))
                st = stacks.get(at)
                if st is None:
                    st = stacks[at] = torch.stack(
                        [self._eigenvalues(i, m, pr, scale)[cut[m], cut[m]] for pr in priors], -1
                    ).reciprocal_()
                stacked[m] = st
        inv = [{m: st[..., p] for m, st in stacked.items()} for p in range(len(priors))]
        f64 = torch.float64
        bases = {m: (g.U, a.U) for m, (g, a) in self._eig.items()}
        residual: list[dict[str, float]] | None = None if exact else [{} for _ in priors]
        for i, m in enumerate(self.modules):
            if residual is None or m in lowrank:  # exact (stacked, lowrank_covariance)
                continue
            g, a = self._eig[m]
            deltas = [float(prior[i]) for prior in priors]
            eigs = [self._eigenvalues(i, m, prior, scale)[:-1, :-1].to(f64) for prior in priors]
            k = min(range(len(priors)), key=deltas.__getitem__)
            curv = eigs[k] - deltas[k]  # [r, c], the curvature part s·λG·λA (prior-free)
            big = curv > self.predictive_rtol * deltas[k]
            rows = big.any(dim=1).nonzero().squeeze(1)
            cols = big.any(dim=0).nonzero().squeeze(1)
            bases[m] = (g.U.index_select(1, rows), a.U.index_select(1, cols))
            for p, (e, delta) in enumerate(zip(eigs, deltas, strict=True)):
                kept = e.index_select(0, rows).index_select(1, cols)
                inv[p][m] = kept.reciprocal() - 1.0 / delta
                residual[p][m] = 1.0 / delta
        dtype = self._options.dtype
        blocks = KronBlocks(self._targets, bases, inv, dtype, residual, f64, lowrank, stacked)
        self._memo = (key, blocks)
        return blocks

    # ------------------------------------------------------------------ state
    def _state(self) -> dict[str, Tensor]:
        """Eigenpairs per module (``eig_*``, ``q_*``, low-rank ``rest_*``; a separate bias's last)."""
        state = {}
        for m, (g, a) in self._eig.items():
            qa = a.U[:-1, :-1] if m in self._separate else a.U
            state.update({f"{m}:eig_g": g.s, f"{m}:q_g": g.U, f"{m}:eig_a": a.s, f"{m}:q_a": qa})
            state.update({f"{m}:rest_{k}": f.rest for k, f in (("g", g), ("a", a)) if not f.full})
        return state

    def _load_state(self, file: PosteriorFile) -> None:
        """Inverse of `_state`; shapes are checked against the blocks, the bias mode and ``max_rank``."""
        eig = {}
        for m in self.modules:

            def read(key: str, shape: tuple[int, ...] | None, m: str = m) -> Tensor:
                return file.tensor(f"curv:{m}:{key}", shape).to(self.device, self.dtype)

            factors = []
            for key, n in self._sides[m].items():
                k, s = self._rank(n), key.lower()
                extra = int(m in self._separate and key == "A")  # the separate bias's eigenvalue
                rest = read(f"rest_{s}", ()) if k < n else read(f"eig_{s}", None).new_zeros(())
                factors.append(
                    LowRankFactor(read(f"q_{s}", (n, k)), read(f"eig_{s}", (k + extra,))[:k], rest)
                )
            g, a = factors
            if m in self._separate:
                a = _with_separate_bias(a, read("eig_a", None)[-1:].reshape(1, 1))
            eig[m] = (g, a)
        self._eig, self._stacks = eig, {}

    def _summary_rows(self) -> list[tuple[str, str, int]]:
        rows = []
        for m in self.modules:
            text, floats = [], 0
            for key, n in self._sides[m].items():
                k = self._rank(n)
                text.append(f"{key} {n}x{n}" + (f" rank {k}" if k < n else ""))
                floats += n * k + k + (k < n)
            sep = m in self._separate  # the separate bias's eigenvalue: one float more
            rows.append((m, " ⊗ ".join(text) + (", bias G ⊗ [1]" if sep else ""), floats + sep))
        return rows


def _with_separate_bias(a: LowRankFactor, a_bias: Tensor) -> LowRankFactor:
    """``blockdiag(A, A_bias)`` from ``A``'s eigenpairs; refuses an ``A_bias`` that is not a finite ``[1, 1]``."""
    if a_bias.shape != (1, 1) or not bool(torch.isfinite(a_bias).all()):
        raise ValueError(f"A_bias must be a finite [1, 1] tensor, got {a_bias.tolist()}")
    one = torch.ones(1, 1, dtype=a.U.dtype, device=a.U.device)
    s = torch.cat([a.s, a_bias.reshape(1).clamp(min=0.0)])
    return LowRankFactor(torch.block_diag(a.U, one), s, a.rest)
