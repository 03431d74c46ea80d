"""Dense float64 references for the curvature tests (torch.func on small models)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev


def block_jacobian(
    model: nn.Module, x, names: list[str], *, kwargs: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-example Jacobians of the logits w.r.t. the named parameters (flattened, in ``names`` order).

    Returns:
        ``(logits [B, C], J [B, C, P])``, each parameter flattened row-major in storage order.
    """
    params = dict(model.named_parameters())

    def f(*ps: Tensor) -> Tensor:
        sub = {**params, **dict(zip(names, ps, strict=True))}
        out = functional_call(model, sub, (), x) if kwargs else functional_call(model, sub, (x,))
        return getattr(out, "logits", out)

    with torch.no_grad():
        logits = f(*[params[n] for n in names])
    jac = jacrev(f, argnums=tuple(range(len(names))))(*[params[n].detach() for n in names])
    b, c = logits.shape
    J = torch.cat([j.reshape(b, c, -1) for j in jac], dim=-1)
    return logits, J


def linear_block_jacobian(
    model: nn.Module, x, module: str, bias: bool, **kw
) -> tuple[Tensor, Tensor]:
    """Jacobian w.r.t. ``vec(W | b)`` row-major in the logical (n_out x n_in) orientation."""
    names = [f"{module}.weight"] + ([f"{module}.bias"] if bias else [])
    logits, J = block_jacobian(model, x, names, **kw)
    w = dict(model.named_parameters())[f"{module}.weight"]
    n_out, n_in = w.shape
    b, c = logits.shape
    Jw = J[..., : n_out * n_in].reshape(b, c, n_out, n_in)
    if bias:
        Jw = torch.cat([Jw, J[..., n_out * n_in :, None]], dim=-1)
    return logits, Jw.reshape(b, c, -1)


def output_hessian_sqrt(logits: Tensor, likelihood: str, sigma: float = 1.0) -> Tensor:
    """``L_n`` ``[B, C, C]``: the Hessian of the per-example NLL w.r.t. the logits."""
    if likelihood == "classification":
        p = torch.softmax(logits, -1)
        return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    c = logits.shape[-1]
    return torch.eye(c, dtype=logits.dtype).expand(logits.shape[0], c, c) / sigma**2


def dense_ggn(J: Tensor, logits: Tensor, likelihood: str, sigma: float = 1.0) -> Tensor:
    """``Σ_n J_nᵀ L_n J_n``."""
    L = output_hessian_sqrt(logits, likelihood, sigma)
    return torch.einsum("bcp,bcd,bdq->pq", J, L, J)


def dense_ef(J: Tensor, logits: Tensor, y: Tensor, likelihood: str, sigma: float = 1.0) -> Tensor:
    """``Σ_n g_n g_nᵀ`` with ``g_n = J_nᵀ ∇_f NLL``."""
    if likelihood == "classification":
        r = torch.softmax(logits, -1) - torch.eye(logits.shape[-1], dtype=logits.dtype)[y]
    else:
        r = (logits - y.reshape(logits.shape)) / sigma**2
    g = torch.einsum("bcp,bc->bp", J, r)
    return g.T @ g


class SeqNet(nn.Module):
    """Token model: two linear maps applied per token, masked mean (or sum) pooling, a linear head.

    ``forward(x [B, T, d], attention_mask [B, T] | None) -> logits [B, C]``; identity activation gives a
    deep linear network.
    """

    def __init__(self, d: int, h: int, c: int, act: bool = True, pool: str = "mean") -> None:
        super().__init__()
        self.lin1 = nn.Linear(d, h)
        self.lin2 = nn.Linear(h, h)
        self.head = nn.Linear(h, c)
        self.act = nn.Tanh() if act else nn.Identity()
        self.pool = pool

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        m = torch.ones(x.shape[:2], dtype=x.dtype) if attention_mask is None else attention_mask
        m = m.to(x.dtype)
        h = self.act(self.lin2(self.act(self.lin1(x))))
        s = (h * m[..., None]).sum(1)
        return self.head(s / m.sum(1, keepdim=True) if self.pool == "mean" else s)


def seq_batch(
    b: int, t: int, d: int, c: int, seed: int, regression: bool = False, pad: int = 0
) -> dict[str, Tensor]:
    """A dict batch with random lengths in [1, t] and ``pad`` extra padded positions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t + pad, d, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t + pad)[None] < lengths[:, None]).long()
    y = (
        torch.randn(b, c, generator=g, dtype=torch.float64)
        if regression
        else torch.randint(0, c, (b,), generator=g)
    )
    return {"x": x, "attention_mask": mask, "labels": y}


def kw(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Model keyword inputs of a dict batch."""
    return {k: v for k, v in batch.items() if k != "labels"}
