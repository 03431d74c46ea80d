"""Small models, synthetic factors and dense references shared by the Laplace tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from partialbayes.selection import KronBlock, Subset


class TinyNet(nn.Module):
    """Linear(3, 5) -> tanh -> HF Conv1D(5 -> 4) -> tanh -> Linear(4, 3): covers both storage layouts."""

    def __init__(self, seed: int = 0, n_classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l0 = nn.Linear(3, 5)
        self.c1 = Conv1D(4, 5)
        nn.init.normal_(self.c1.weight, std=0.5)
        nn.init.normal_(self.c1.bias, std=0.1)
        self.l2 = nn.Linear(4, n_classes)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.c1(torch.tanh(self.l0(x)))))


def kron_subset(model: TinyNet) -> Subset:
    """Full l0 weight (no bias), S-KFAC-like blocks on the Conv1D and on l2 (with biases)."""
    return Subset.from_model(
        model,
        {
            "l0.weight": KronBlock(),
            "c1.weight": KronBlock(rows=torch.tensor([0, 2, 3]), cols=torch.tensor([1, 4])),
            "c1.bias": KronBlock(rows=torch.tensor([0, 2, 3])),
            "l2.weight": KronBlock(rows=torch.tensor([1, 2]), cols=torch.tensor([0, 1, 3])),
            "l2.bias": KronBlock(rows=torch.tensor([1, 2])),
        },
    )


def random_factors(posterior, seed: int, rank: int | None = None) -> dict[str, SimpleNamespace]:
    """PSD factors (possibly rank-deficient) of the right block sizes for every module."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in posterior.modules:
        r, _, c = posterior._dims[m]
        xg = torch.randn(r, rank or r, generator=g, dtype=torch.float64)
        xa = torch.randn(c, rank or c, generator=g, dtype=torch.float64)
        out[m] = SimpleNamespace(G=xg @ xg.T * 3.0, A=xa @ xa.T / 2.0)
    return out


def dense_precision(posterior, factors, prior, temperature=1.0, scale=1.0) -> torch.Tensor:
    """Block-diagonal dense ``(G ⊗ A) s / T + δ_m I`` in block order (modules in order)."""
    blocks = []
    for i, m in enumerate(posterior.modules):
        k = torch.kron(factors[m].G, factors[m].A) * scale / temperature
        blocks.append(k + prior[i] * torch.eye(k.shape[0], dtype=k.dtype))
    return torch.block_diag(*blocks)


def dense_kron_covariance(
    q_g: torch.Tensor, q_a: torch.Tensor, eigenvalues: torch.Tensor
) -> torch.Tensor:
    """The dense block covariance ``(Q_G ⊗ Q_A) diag(1/E) (Q_G ⊗ Q_A)ᵀ``, ``[rc, rc]`` (row-major vec)."""
    q = torch.kron(q_g, q_a)
    return (q / eigenvalues.reshape(-1)) @ q.T


def dense_posterior_covariance(la) -> torch.Tensor:
    """A fitted `KronLaplace`'s covariance at its prior, dense: block diagonal, modules in order."""
    blocks = []
    for i, m in enumerate(la.modules):
        g, a = la._eig[m]
        qg, qa = g.U, a.U
        eigenvalues = la._eigenvalues(i, m, la.prior_precision, la._scale(None))[:-1, :-1]
        blocks.append(dense_kron_covariance(qg, qa, eigenvalues))
    return torch.block_diag(*blocks)


def autograd_block_jacobian(la, inputs) -> torch.Tensor:
    """``J [B, C, P]`` of a `KronLaplace`'s blocks (modules in order, each ``vec(W[R][:, C] | b[R])``).

    One ``torch.autograd.grad`` per logit ``(b, c)`` of ``[B, C]`` logits: no hooks, no batching, so
    independent of the package's Jacobian paths. ``inputs``: a tensor or keyword inputs.
    """
    model, subset = la.model, la.subset
    params = dict(model.named_parameters())
    names = list(subset.names)
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    logits = getattr(out, "logits", out)
    b, c = logits.shape
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for i in range(b):
        for k in range(c):
            grads = torch.autograd.grad(
                logits[i, k], [params[n] for n in names], retain_graph=True, allow_unused=True
            )
            for n, g in zip(names, grads, strict=True):
                g = torch.zeros_like(params[n]) if g is None else g
                rows[n].append(subset.gather(n, g.detach()))
    jac = {n: torch.stack(v).reshape(b, c, -1) for n, v in rows.items()}
    return torch.cat([la.params_to_block(m, jac).reshape(b, c, -1) for m in la.modules], dim=-1)


def reference_block_jacobian(model: TinyNet, x: torch.Tensor, subset: Subset) -> torch.Tensor:
    """Per-example Jacobians ``[B, C, P]`` in block order, by torch.func on the logical weights."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)
    cols = []
    for m, km in subset.kron_modules().items():
        jw = jac[km.weight_name]
        if km.transposed:
            jw = jw.transpose(-1, -2)
        if km.rows is not None:
            jw = jw[..., km.rows, :]
        if km.cols is not None:
            jw = jw[..., km.cols]
        parts = [jw]
        if km.bias_name is not None:
            jb = jac[km.bias_name]
            parts.append((jb if km.rows is None else jb[..., km.rows]).unsqueeze(-1))
        block = torch.cat(parts, dim=-1)
        cols.append(block.reshape(*block.shape[:2], -1))
        del m
    return torch.cat(cols, dim=-1)


def classification_data(n: int, seed: int, n_classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, n_classes, (n,), generator=g)
    return x, y
