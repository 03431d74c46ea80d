"""Kronecker Laplace over the LoRA adapters of a PEFT-wrapped Hugging Face classifier (dense float64 checks)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from partialbayes.curvature import KronLaplace, kfac  # noqa: E402
from partialbayes.selection import lora_modules, lora_subset, sparse_kfac  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

# peft calls a transformers method that transformers 5 deprecates; not ours to fix
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)
FIXTURE = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    max_examples=8,
)


def peft_bert(seed: int, rank: int, classes: int, targets=("query", "value", "output.dense")):
    model = tiny_model("bert", seed=seed, num_labels=classes).double()
    lora = peft.LoraConfig(r=rank, target_modules=list(targets), init_lora_weights=False)
    return peft.get_peft_model(model, lora).eval()


def batch(b: int, t: int, classes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 30, (b, t), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.randint(0, classes, (b,), generator=g),
    }


def jacobians(
    model, one: dict[str, torch.Tensor], names: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[C]`` of one example and ``J [C, P]`` w.r.t. the named weights (row-major, concatenated)."""
    params = dict(model.named_parameters())
    inputs = {k: v for k, v in one.items() if k != "labels"}
    logits = model(**inputs).logits[0]
    rows = []
    for c in range(logits.shape[0]):
        grads = torch.autograd.grad(logits[c], [params[n] for n in names], retain_graph=True)
        rows.append(torch.cat([gr.reshape(-1) for gr in grads]))
    return logits.detach(), torch.stack(rows)


def softmax_hessian(logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits, -1)
    return torch.diag(p) - torch.outer(p, p)


@FIXTURE
@given(
    seed=st.integers(0, 2**16),
    rank=st.integers(1, 3),
    classes=st.integers(2, 3),
    prior=st.floats(0.1, 10.0),
)
def test_kron_laplace_on_lora_equals_dense_ggn_for_one_datum(seed, rank, classes, prior, device):
    """One datum of one token: KFAC is exact per map, so the posterior is the dense block-diagonal GGN."""
    model = peft_bert(seed, rank, classes).to(device)
    subset = lora_subset(model)
    names = list(subset.names)
    assert all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * 4  # (query, value, attention.output.dense, output.dense) x (A, B)
    one = batch(1, 1, classes, seed)
    la = KronLaplace(model, subset, prior_precision=prior).fit(
        [{k: v.to(device) for k, v in one.items()}]
    )
    model.cpu()
    logits, J = jacobians(model, one, names)
    L = softmax_hessian(logits)
    sizes = [subset.num_entries(n) for n in names]
    factors = kfac(model, [one], subset)
    blocks = []
    for n, Jm in zip(names, J.split(sizes, dim=1), strict=True):
        ggn = Jm.T @ L @ Jm
        blocks.append(ggn)
        # the factors themselves: G ⊗ A is the dense block
        fm = factors[n.removesuffix(".weight")]
        torch.testing.assert_close(torch.kron(fm.G, fm.A), ggn, rtol=1e-8, atol=1e-11)
    precision = torch.block_diag(*blocks) + prior * torch.eye(sum(sizes), dtype=torch.float64)
    torch.testing.assert_close(la.log_det().cpu(), torch.logdet(precision), rtol=1e-9, atol=1e-9)
    # linearised predictive on another input of three tokens: J Σ Jᵀ with Σ the dense inverse
    model.to(device)
    other = batch(1, 3, classes, seed + 1)
    f, cov = la.logit_mean_cov({k: v.to(device) for k, v in other.items() if k != "labels"})
    model.cpu()
    logits2, J2 = jacobians(model, other, names)
    torch.testing.assert_close(f[0].cpu(), logits2, rtol=1e-10, atol=1e-12)
    want = J2 @ torch.linalg.solve(precision, J2.T)
    torch.testing.assert_close(cov[0].cpu(), want, rtol=1e-7, atol=1e-11)


def test_peft_wrappers_are_not_tied_weights():
    """S-KFAC over the whole PEFT model: base_layer under its wrapper is not a tie (it was refused)."""
    model = peft_bert(0, 2, 2)
    subset = sparse_kfac(model, 50)
    wrapped = "base_model.model.bert.encoder.layer.0.attention.self.query"
    assert f"{wrapped}.base_layer.weight" in subset.names
    assert f"{wrapped}.lora_A.default.weight" in subset.names
    la = KronLaplace(model, subset).fit([batch(3, 4, 2, 0)])
    assert torch.isfinite(la.log_marginal_likelihood())
    adapters = sparse_kfac(model, 50, modules=lora_modules(model))
    la = KronLaplace(model, adapters).fit([batch(3, 4, 2, 0)])
    assert set(la.modules) == set(lora_modules(model))
