"""Token-level (``[B, T, C]``) models, batches and dense float64 references by plain autograd.

The references differentiate one output ``logits[b, t, c]`` at a time (no vmap, no hooks): independent of
everything the package computes.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

from partialbayes.selection import Subset
from tiny_models import tiny_model

VOCAB, TAGS = 30, 3
LM_VOCAB = 11


class TokenNet(nn.Module):
    """A per-token network (positions never interact): ``x [B, T, d] -> logits [B, T, C]``.

    With ``act=False`` it is a deep linear network, KFAC-expand's exact case for the Gaussian likelihood.
    """

    def __init__(self, d: int, h: int, c: int, act: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(d, h)
        self.head = nn.Linear(h, c)
        self.act = nn.Tanh() if act else nn.Identity()

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        del attention_mask  # positions do not interact: the mask only tells which outputs count
        return self.head(self.act(self.lin1(x)))


def bert_tagger(seed: int = 0) -> nn.Module:
    return tiny_model("bert", "token", seed=seed, vocab=VOCAB, num_labels=TAGS).double().eval()


def _rms_norm_in_own_dtype(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """LlamaRMSNorm without its float32 round trip (which limits float64 references to ~1e-7)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def llama_lm(seed: int = 0, layers: int = 1) -> nn.Module:
    """A tiny Llama causal LM in float64 (its RMSNorms kept in float64 too)."""
    model = tiny_model(
        "llama", "causal-lm", seed=seed, vocab=LM_VOCAB, num_key_value_heads=1, layers=layers
    )
    model = model.double().eval()
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = types.MethodType(_rms_norm_in_own_dtype, module)  # type: ignore[method-assign]
    return model


def tagged_batch(b: int, t: int, seed: int, ignore: float = 0.25) -> dict[str, Tensor]:
    """Token classification: right padding (label -100 there too) and some real tokens labelled -100."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (b, t), generator=g) * mask
    labels = torch.randint(0, TAGS, (b, t), generator=g)
    labels[torch.rand(b, t, generator=g) < ignore] = -100
    labels[:, 0] = torch.randint(0, TAGS, (b,), generator=g)  # every sequence keeps a position
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lm_batch(b: int, t: int, seed: int) -> dict[str, Tensor]:
    """Causal LM: ``labels = input_ids`` (shifted inside the model), right padding, a -100 prompt token."""
    if t < 3:
        raise ValueError("lm_batch needs t >= 3 (a prompt token, an ignored and a scored target)")
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    ids = torch.randint(1, LM_VOCAB, (b, t), generator=g) * mask
    labels = ids.clone()
    labels[:, 1] = -100  # the first target of every sequence is ignored (e.g. part of a prompt)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def kept(batch: dict[str, Tensor], shift: bool) -> Tensor:
    """The kept positions ``[B, T]``, written out for the tests from the documented rule."""
    mask, labels = batch["attention_mask"].bool(), batch["labels"]
    if not shift:
        return mask & (labels != -100)
    keep = torch.zeros_like(mask)
    keep[:, :-1] = mask[:, :-1] & mask[:, 1:] & (labels[:, 1:] != -100)
    return keep


def targets(batch: dict[str, Tensor], keep: Tensor, shift: bool) -> Tensor:
    """Labels of the kept positions (``labels[t + 1]`` with ``shift``), row-major."""
    labels = batch["labels"]
    if shift:
        labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    return labels[keep]


def inputs(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}


def output_jacobian(
    model: nn.Module, batch: dict[str, Tensor], keep: Tensor, subset: Subset
) -> tuple[Tensor, Tensor]:
    """``(logits [N, C], J [N, C, P])`` at the kept positions, ``P`` = the subset's entries in its order.

    One ``torch.autograd.grad`` per output ``logits[b, t, c]``; entries parameter by parameter in
    ``subset.names`` order, each in ``subset.gather`` order.
    """
    params = dict(model.named_parameters())
    names = list(subset.names)
    targets_ = [params[n] for n in names]
    out = model(**inputs(batch))
    logits = getattr(out, "logits", out)
    rows = []
    for b, t in keep.nonzero().tolist():
        per_class = []
        for c in range(logits.shape[-1]):
            grads = torch.autograd.grad(
                logits[b, t, c], targets_, retain_graph=True, allow_unused=True
            )
            per_class.append(
                torch.cat(
                    [
                        subset.gather(n, torch.zeros_like(p) if g is None else g)
                        for n, p, g in zip(names, targets_, grads, strict=True)
                    ]
                )
            )
        rows.append(torch.stack(per_class))
    return logits[keep].detach(), torch.stack(rows).detach()


def ggn(
    J: Tensor, logits: Tensor, likelihood: str = "classification", sigma: float = 1.0
) -> Tensor:
    """``Σ_n J_nᵀ Λ_n J_n`` over the output rows."""
    if likelihood == "classification":
        p = torch.softmax(logits, -1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    else:
        c = logits.shape[-1]
        lam = (
            torch.eye(c, dtype=logits.dtype, device=logits.device).expand(logits.shape[0], c, c)
            / sigma**2
        )
    return torch.einsum("ncp,ncd,ndq->pq", J, lam, J)


def empirical_fisher(J: Tensor, logits: Tensor, labels: Tensor) -> Tensor:
    """``Σ_n g_n g_nᵀ``, ``g_n = J_nᵀ (p_n − e_{y_n})``."""
    r = (
        torch.softmax(logits, -1)
        - torch.eye(logits.shape[-1], dtype=logits.dtype, device=logits.device)[labels]
    )
    g = torch.einsum("ncp,nc->np", J, r)
    return g.T @ g
