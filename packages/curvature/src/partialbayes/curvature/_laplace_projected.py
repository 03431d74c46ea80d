"""Kronecker ``J Σ Jᵀ`` in the eigenbases, ``M = Q_Gᵀ J Q_A`` contracted module by module, never forming ``J``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from partialbayes.curvature._hooks import in_row_order, output_passes
from partialbayes.curvature._kfac import KronTargets, LowRankFactor, lowrank_covariance
from partialbayes.curvature._likelihood import Outputs
from partialbayes.predictive.internal import available_memory

# Entries of ``1/E`` (all priors) one step of `stacked_covariances` reads: its rows stay in cache.
ROWS_IN_CACHE = 1 << 18


def rotate_inputs(x: Tensor, q_a: Tensor, bias: bool) -> Tensor:
    """``x̃ Q_A`` ``[N, c]`` for ``x [N, c_w]``, ``x̃ = (x | 1)`` when the block has the bias (no concatenation)."""
    if not bias:
        return x @ q_a
    return torch.addmm(q_a[-1], x, q_a[:-1])


def frobenius_products(x: Tensor, d: Tensor, bias: bool) -> Tensor:
    """``[C, C]`` ``<J_k, J_l>_F`` of one example, by Gram matrices or ``J``, the cheaper."""
    n_cls, n, r = d.shape
    c = x.shape[1] + bias
    if (n_cls * n) ** 2 * r + n * n * c <= n_cls * n * r * c + n_cls * n_cls * r * c:
        gx = x @ x.T
        if bias:
            gx = gx + 1
        flat = d.reshape(n_cls * n, r)
        gd = (flat @ flat.T).reshape(n_cls, n, n_cls, n)
        return torch.einsum("ktls,ts->kl", gd, gx)
    xt = torch.cat([x, torch.ones_like(x[:, :1])], dim=1) if bias else x
    jac = (d.transpose(1, 2) @ xt).reshape(n_cls, -1)  # [C, r c]
    return jac @ jac.T


def unshared_covariances(xq: Tensor, dq: Tensor, inv_eigenvalues: Sequence[Tensor]) -> list[Tensor]:
    """``J Σ Jᵀ`` ``[B, C, C]`` per prior of rank-1 Jacobians (``xq [B, c]``, ``dq [C, B, r]``)."""
    x2 = xq * xq
    d = dq.permute(1, 0, 2)  # [B, C, r]
    return [(d * (x2 @ inv_e.T)[:, None, :]) @ d.transpose(1, 2) for inv_e in inv_eigenvalues]


def active_tokens(x: Tensor, d: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, list[int]]:
    """``(x [N, c_w], d [C, N, r], counts per example)``: the tokens whose ``δ`` is non-zero for some class."""
    n_cls, b, t, r = d.shape
    active = d.ne(0).any(dim=3).any(dim=0)  # [B, T]
    idx = active.reshape(-1).nonzero().squeeze(1)
    xp = x.reshape(b * t, -1).index_select(0, idx).to(dtype)
    dp = d.reshape(n_cls, b * t, r).index_select(1, idx).to(dtype)
    return xp, dp, active.sum(1).tolist()


def shared_covariances(
    x: Tensor,
    d: Tensor,
    q_g: Tensor,
    q_a: Tensor,
    bias: bool,
    inv_eigenvalues: Sequence[Tensor],
    dtype: torch.dtype,
    stacked: Tensor | None = None,
    each: bool = False,
) -> list[Tensor]:
    """``J Σ Jᵀ`` ``[B, C, C]`` per prior of sequences, one ``M`` at a time (priors: `stacked_covariances`).

    ``each``: every prior of ``inv_eigenvalues`` as if alone (the single-prior path, bit for bit), each ``M``
    formed once for all of them.
    """
    n_cls, b, _, r = d.shape
    xp, dp, counts = active_tokens(x, d, dtype)  # [N, c_w], [C, N, r]
    many = len(inv_eigenvalues) > 1 and not each
    x_first = many or xp.shape[0] <= b * n_cls * r
    d_first = many or xp.shape[0] <= b * q_a.shape[0]
    if x_first:
        xp = rotate_inputs(xp, q_a, bias)
    elif bias:
        xp = torch.cat([xp, torch.ones_like(xp[:, :1])], dim=1)
    if d_first:
        dp = dp @ q_g
    if many:
        every = torch.stack(list(inv_eigenvalues), -1) if stacked is None else stacked
        return stacked_covariances(xp, dp, counts, every)
    out = torch.zeros(len(inv_eigenvalues), b, n_cls, n_cls, dtype=dtype, device=d.device)
    inv_sqrt = [e.sqrt().reshape(-1) for e in inv_eigenvalues]
    start = 0
    for i, n in enumerate(counts):
        if n == 0:
            continue
        m = dp[:, start : start + n].transpose(1, 2) @ xp[start : start + n]  # [C, r, c]
        start += n
        if not d_first:
            m = q_g.T @ m
        if not x_first:
            m = m @ q_a
        flat = m.reshape(n_cls, -1)
        for k, w in enumerate(
            inv_sqrt
        ):  # M scaled by 1/√E (the last in place): one pass over M each
            scaled = flat.mul_(w) if k == len(inv_sqrt) - 1 else flat * w
            torch.mm(scaled, scaled.T, out=out[k, i])
    return list(out)


def stacked_covariances(xq: Tensor, dq: Tensor, counts: list[int], stacked: Tensor) -> list[Tensor]:
    """``J Σ Jᵀ`` ``[B, C, C]`` for every prior of ``stacked`` (``1/E [r, c, P]``) from rotated tokens.

    ``M``'s rows are formed a few at a time for every example, so that ``1/E`` of those rows stays in cache
    while one small GEMM gives ``Σ_ij M_k,ij M_l,ij / E_ij`` of every pair ``k ≤ l`` and every prior.
    """
    n_cls, _, r = dq.shape
    n_p = stacked.shape[-1]
    iu = torch.triu_indices(n_cls, n_cls, device=dq.device)
    covs = dq.new_zeros(n_p, len(counts), n_cls, n_cls)  # upper triangles, mirrored at the end
    ends = torch.tensor(counts).cumsum(0).tolist()
    rows = max(1, ROWS_IN_CACHE // (xq.shape[1] * n_p))
    for s in range(0, r, rows):
        inv = stacked[s : s + rows].reshape(-1, n_p)
        d_rows = dq[:, :, s : s + rows].transpose(1, 2)  # [C, rows, N]
        for i, (n, end) in enumerate(zip(counts, ends, strict=True)):
            if n:
                m = (d_rows[:, :, end - n : end] @ xq[end - n : end]).reshape(n_cls, -1)
                covs[:, i, iu[0], iu[1]] += ((m[iu[0]] * m[iu[1]]) @ inv).T
    return list(covs + covs.transpose(-1, -2).tril(-1))


def residual_covariances(
    x: Tensor,
    d: Tensor,
    q_g: Tensor,
    q_a: Tensor,
    bias: bool,
    weights: Sequence[Tensor],
    inv_priors: Sequence[float],
    dtype: torch.dtype,
    combine_dtype: torch.dtype = torch.float64,
) -> list[Tensor]:
    """``J Σ Jᵀ`` per prior with truncated bases (``x [B, T, c_w]``): ``‖J‖²/δ`` plus the kept directions' part."""
    n_cls, b = d.shape[0], d.shape[1]
    xp, dp, counts = active_tokens(x, d, dtype)  # [N, c_w], [C, N, r]
    xq = rotate_inputs(xp, q_a.to(dtype), bias)  # [N, |J|]
    dq = dp @ q_g.to(dtype)  # [C, N, |I|]
    neg = [(-w).reshape(-1).to(combine_dtype) for w in weights]
    out = [torch.zeros(b, n_cls, n_cls, dtype=combine_dtype, device=d.device) for _ in weights]
    start = 0
    for i, n in enumerate(counts):
        if n == 0:
            continue
        sl = slice(start, start + n)
        start += n
        fro = frobenius_products(xp[sl], dp[:, sl], bias).to(combine_dtype)
        # M on I × J
        flat = (dq[:, sl].transpose(1, 2) @ xq[sl]).reshape(n_cls, -1).to(combine_dtype)
        for cov, w, inv_prior in zip(out, neg, inv_priors, strict=True):
            cov[i] = fro * inv_prior - (flat * w) @ flat.T
    return out


@dataclass(frozen=True)
class KronBlocks:
    """One Kronecker posterior's share of `kron_predictive`: bases, ``1/E`` per prior, residual and low-rank blocks."""

    targets: KronTargets
    bases: Mapping[str, tuple[Tensor, Tensor]]
    inv_eigenvalues: Sequence[Mapping[str, Tensor]]
    dtype: torch.dtype
    residual: Sequence[Mapping[str, float]] | None = None
    combine_dtype: torch.dtype = torch.float64
    lowrank: Mapping[str, tuple[LowRankFactor, LowRankFactor]] = field(default_factory=dict)
    stacked: Mapping[str, Tensor] = field(default_factory=dict)


def union_index(indices: Sequence[Tensor | None]) -> tuple[Tensor | None, list[Tensor | None]]:
    """The union ``U`` of index sets (``None``: all) and each set's place in it: ``x[..., U][..., place]``."""
    if len(indices) == 1:
        return indices[0], [None]
    if any(i is None for i in indices):
        return None, list(indices)
    union = torch.unique(torch.cat([i for i in indices if i is not None]))
    return union, [torch.searchsorted(union, i) for i in indices if i is not None]


def kron_predictive(
    model: nn.Module,
    inputs: Tensor | Mapping[str, Any],
    outputs: Outputs,
    parts: Sequence[KronBlocks],
) -> tuple[Tensor, Tensor | None, list[list[Tensor]]]:
    """``(logits, keep, [[Σ_f per prior] per part])``, the hooked passes shared by the parts."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    names = sorted({m for p in parts for m in p.targets.kmods}, key=order.__getitem__)
    users = {m: [i for i, p in enumerate(parts) if m in p.targets.kmods] for m in names}
    cols, rows = parts[0].targets.cols, parts[0].targets.rows  # one posterior: its own
    where: list[dict[str, tuple[Tensor | None, Tensor | None]]] = [{} for _ in parts]
    if len(parts) > 1:  # the union of the parts' rows and columns; each part's place in it
        cols, rows = {}, {}
        for m, idx in users.items():
            cols[m], cw = union_index([parts[i].targets.cols[m] for i in idx])
            rows[m], rw = union_index([parts[i].targets.rows[m] for i in idx])
            for i, c, r in zip(idx, cw, rw, strict=True):
                where[i][m] = (c, r)
    modules = {m: parts[users[m][0]].targets.modules[m] for m in names}
    ps = output_passes(model, inputs, outputs, modules, cols, rows)
    b = ps.logits.shape[0]
    n_cls = ps.logits.shape[-1] if outputs.target_ids is None else len(outputs.target_ids)
    if len(parts) > 1 and not fits_memory(ps.inputs, rows, parts, n_cls, ps.logits.device):
        del ps
        alone = [kron_predictive(model, inputs, outputs, [p]) for p in parts]
        return alone[0][0], alone[0][1], [covs for _, _, (covs,) in alone]
    keys: list[Tensor] = []
    out_dtypes = [p.dtype if p.residual is None else p.combine_dtype for p in parts]
    results: list[list[list[Tensor]]] = [[[] for _ in p.inv_eigenvalues] for p in parts]
    with torch.no_grad():
        for pg in ps.positions:
            new = ps.logits.new_zeros
            covs = [
                [new(b, n_cls, n_cls, dtype=dt) for _ in p.inv_eigenvalues]
                for p, dt in zip(parts, out_dtypes, strict=True)
            ]
            for m in names:
                x_u, d_u = ps.inputs[m], torch.stack(pg.grads.pop(m))  # d: [K, B, (T...,) r]
                if len(parts) == 1:
                    terms = {0: _contributions(parts[0], m, x_u, d_u, b)}
                else:
                    terms = _module_terms(parts, users[m], m, x_u, d_u, where, b)
                for i in users[m]:
                    for cov, term in zip(covs[i], terms[i], strict=True):
                        cov += term
                del x_u, d_u, terms
            for per_prior, now in zip(results, covs, strict=True):
                for rows_so_far, cov in zip(per_prior, now, strict=True):
                    rows_so_far.append(cov.index_select(0, pg.examples))
            keys.append(pg.keys)
    return ps.logits, ps.keep, [[in_row_order(keys, c) for c in r] for r in results]


def fits_memory(
    inputs: Mapping[str, Tensor],
    rows: Mapping[str, Tensor | None],
    parts: Sequence[KronBlocks],
    n_outputs: int,
    device: torch.device,
) -> bool:
    """Whether the backward passes shared by several ``parts`` fit the free memory."""
    total = 0
    for m, x in inputs.items():
        r_u = rows[m]
        n_out = next(p.targets.kmods[m].n_out for p in parts if m in p.targets.kmods)
        r = n_out if r_u is None else int(r_u.numel())
        total += x.numel() // max(x.shape[-1], 1) * x.element_size() * (n_outputs * r + x.shape[-1])
    available, _ = available_memory(device)
    return available is None or total <= available


def _module_terms(
    parts: Sequence[KronBlocks],
    idx: Sequence[int],
    m: str,
    x_u: Tensor,
    d_u: Tensor,
    where: Sequence[Mapping[str, tuple[Tensor | None, Tensor | None]]],
    b: int,
) -> dict[int, list[Tensor]]:
    """Module ``m``'s terms of the parts ``idx``, each distinct block computed once.

    Parts holding one ``1/E`` stack (the same block at the same priors, `KronLaplace.fit_many`) share its
    terms; parts holding one block at different single priors share its rotated tokens and each ``M``.
    """
    rep: dict[int, int] = {}  # part -> the part whose terms it takes
    stacks: dict[int, int] = {}
    for i in idx:
        st = parts[i].stacked.get(m)
        rep[i] = i if st is None else stacks.setdefault(id(st), i)
    blocks: dict[tuple[int, int], list[int]] = {}  # a block's single-prior sequence parts
    plain: dict[int, list[int]] = {}  # such a part -> its block's
    for i in dict.fromkeys(rep.values()):
        p = parts[i]
        if (
            x_u.ndim > 2
            and p.residual is None
            and m not in p.lowrank
            and len(p.inv_eigenvalues) == 1
        ):
            plain[i] = blocks.setdefault((id(p.bases[m][0]), id(p.bases[m][1])), [])
            plain[i].append(i)
    terms: dict[int, list[Tensor]] = {}
    for i in dict.fromkeys(rep.values()):
        if i in terms:
            continue
        c, r = where[i][m]
        x = x_u if c is None else x_u.index_select(-1, c)
        d = d_u if r is None else d_u.index_select(-1, r)
        p, group = parts[i], plain.get(i, [])
        if len(group) > 1:
            x3 = x.reshape(b, -1, x.shape[-1])
            d4 = d.reshape(d.shape[0], b, x3.shape[1], d.shape[-1])
            bias = p.targets.kmods[m].bias_name is not None
            inv = [parts[j].inv_eigenvalues[0][m] for j in group]
            each = shared_covariances(x3, d4, *p.bases[m], bias, inv, p.dtype, each=True)
            terms.update({j: [t] for j, t in zip(group, each, strict=True)})
        else:
            terms[i] = _contributions(p, m, x, d, b)
    return {i: terms[rep[i]] for i in idx}


def _contributions(part: KronBlocks, m: str, x: Tensor, d: Tensor, b: int) -> list[Tensor]:
    """Module ``m``'s ``[B, C, C]`` terms of ``part``'s covariances, one per prior."""
    q_g, q_a = part.bases[m]
    inv = [e[m] for e in part.inv_eigenvalues]
    bias = part.targets.kmods[m].bias_name is not None
    if x.ndim == 2 and m not in part.lowrank and part.residual is None:  # one position per example
        xq, dq = rotate_inputs(x.to(part.dtype), q_a, bias), d.to(part.dtype) @ q_g
        return unshared_covariances(xq, dq, inv)
    x = x.reshape(b, -1, x.shape[-1])  # [B, T, c_w], d: [C, B, T, r]
    d = d.reshape(d.shape[0], b, x.shape[1], d.shape[-1])
    if m in part.lowrank:
        x, d = x.to(part.dtype), d.to(part.dtype)
        if bias:
            x = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)
        return [lowrank_covariance(x, d, *part.lowrank[m], e) for e in inv]
    if part.residual is not None:
        res, dt = [rs[m] for rs in part.residual], part.dtype
        return residual_covariances(x, d, q_g, q_a, bias, inv, res, dt, part.combine_dtype)
    return shared_covariances(x, d, q_g, q_a, bias, inv, part.dtype, part.stacked.get(m))
