"""Sampling-based linearised Laplace in the benchmark: dense float64 references for the glue-bench code
(one EM step, the predictive, the dense Jacobians), and bad settings."""

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import nn

from partialbayes.glue_bench.linearised import (
    LinearSamplingConfig,
    fit_linearised,
    linearised_probs,
)

F64 = torch.float64
FIXTURE_OK = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)


class Toy(nn.Module):
    """A two-layer classifier taking keyword inputs like a Hugging Face model: ``x`` (B, L, D), mean-pooled
    over the positions where ``attention_mask`` is 1."""

    def __init__(self, dim: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, attention_mask):
        mask = attention_mask.unsqueeze(-1).to(x.dtype)
        pooled = (torch.tanh(self.inner(x)) * mask).sum(1) / mask.sum(1)
        return self.head(pooled)


def _batches(sizes, lengths, dim, classes, seed, device):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for b, length in zip(sizes, lengths, strict=True):
        mask = torch.ones(b, length, dtype=torch.long)
        mask[0, length // 2 + 1 :] = 0  # one padded example per batch
        out.append(
            {
                "x": torch.randn(b, length, dim, generator=gen, dtype=F64).to(device),
                "attention_mask": mask.to(device),
                "labels": torch.randint(0, classes, (b,), generator=gen).to(device),
            }
        )
    return out


def _toy(dim, hidden, classes, seed, device):
    torch.manual_seed(seed)
    return Toy(dim, hidden, classes).to(device, F64).eval()


def _params(model, seed):
    """Whole head plus a random mask of the inner weight."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(model.inner.weight.shape, generator=gen) < 0.5
    mask.view(-1)[0] = True
    return {
        "inner.weight": mask.to(model.inner.weight.device),
        "head.weight": None,
        "head.bias": None,
    }


def _dense_jacobian(model, batches, params):
    """[n, m, d] Jacobian of every example's logits in the chosen entries, example by example."""
    named = dict(model.named_parameters())
    names = [n for n in named if n in params]
    theta = torch.cat(
        [
            named[n].detach()[params[n]] if params[n] is not None else named[n].detach().reshape(-1)
            for n in names
        ]
    )
    rows = []
    for b in batches:
        for i in range(b["labels"].shape[0]):
            inputs = {k: v[i : i + 1] for k, v in b.items() if k != "labels"}

            def f(flat, inputs=inputs):
                p, start = {}, 0
                for n in names:
                    mask = params[n]
                    size = int(mask.sum()) if mask is not None else named[n].numel()
                    chunk = flat[start : start + size]
                    start += size
                    p[n] = (
                        chunk.reshape(named[n].shape)
                        if mask is None
                        else named[n].detach().masked_scatter(mask, chunk)
                    )
                return torch.func.functional_call(model, p, (), inputs)[0]

            rows.append(torch.autograd.functional.jacobian(f, theta))
    return torch.stack(rows), theta


def test_one_em_step_matches_dense_formulas(device):
    """α₁ = γ̂ / ‖θ̄‖² with θ̄ = H⁻¹ΦᵀBY exact and γ̂ a k-sample estimate of tr(H⁻¹ΦᵀBΦ)."""
    classes, k, alpha0 = 3, 400, 2.0
    batches = _batches([5, 4, 6], [3, 2, 4], 2, classes, 0, device)
    model = _toy(2, 3, classes, 0, device)
    params = _params(model, 0)
    phi, theta = _dense_jacobian(model, batches, params)
    _, m, d = phi.shape
    config = LinearSamplingConfig(
        k=k, em_iters=1, samples=2, cg_iters=d + 5, cg_tol=1e-12, alpha0=alpha0, jitter=1e-3
    )
    post = fit_linearised(model, batches, params, config, torch.Generator().manual_seed(0))

    with torch.no_grad():
        logits = torch.cat(
            [model(**{k: v for k, v in b.items() if k != "labels"}) for b in batches]
        )
    labels = torch.cat([b["labels"] for b in batches])
    p = logits.softmax(-1)
    eye = torch.eye(m, dtype=F64, device=device)
    bmat = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1) + 1e-3 * eye
    y = torch.einsum("nmd,d->nm", phi, theta) + torch.linalg.solve(
        bmat, torch.nn.functional.one_hot(labels, m).to(F64) - p
    )
    ggn = torch.einsum("nmd,nme,nef->df", phi, bmat, phi)
    h = ggn + alpha0 * torch.eye(d, dtype=F64, device=device)
    mean = torch.linalg.solve(h, torch.einsum("nmd,nme,ne->d", phi, bmat, y))
    hinv_ggn = torch.linalg.solve(h, ggn)
    gamma = torch.trace(hinv_ggn)
    sd = torch.sqrt(2 * torch.trace(hinv_ggn @ hinv_ggn) / k)  # sd of the k-sample estimate
    step = post.history[0]
    assert abs(step["gamma"] - float(gamma)) < 5 * float(sd)
    assert step["alpha"] == pytest.approx(step["gamma"] / float(mean @ mean), rel=1e-6)
    assert post.alpha == step["alpha"]
    assert post.samples.shape == (d, 2)
    assert post.cg_converged


def test_predictive_matches_dense(device):
    classes = 2
    batches = _batches([3, 2], [3, 5], 2, classes, 1, device)
    model = _toy(2, 3, classes, 1, device)
    params = _params(model, 1)
    phi, _ = _dense_jacobian(model, batches, params)
    z = torch.randn(phi.shape[2], 5, generator=torch.Generator().manual_seed(2), dtype=F64)
    probs = linearised_probs(model, batches, params, z.to(device))
    with torch.no_grad():
        logits = torch.cat(
            [model(**{k: v for k, v in b.items() if k != "labels"}) for b in batches]
        )
    samples = logits.unsqueeze(0) + torch.einsum("nmd,dk->knm", phi, z.to(device))
    torch.testing.assert_close(probs, samples.softmax(-1).mean(0).cpu())
    assert probs.dtype == F64


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("k", 0),
        ("em_iters", 0),
        ("samples", 1.5),
        ("cg_iters", True),
        ("cg_tol", 0.0),
        ("alpha0", -1.0),
        ("dense_max_floats", -1),
    ],
)
def test_bad_settings_name_the_field(key, value):
    error = TypeError if isinstance(value, bool) or value == 1.5 else ValueError
    with pytest.raises(error, match=f"LinearSamplingConfig.{key}"):
        LinearSamplingConfig(**{key: value})


def test_dense_jacobians_match_the_operator_features(tiny_bert_factory, tiny_tokenizer):
    """The hook-based dense Φ (curvature.logit_jacobians) equals loader_features' Φ, column order too."""
    from partialbayes.glue_bench.linearised import dense_jacobians
    from partialbayes.linear_sampling import loader_features
    from partialbayes.selection import last_layer, sparse_kfac

    model, tok = tiny_bert_factory(3)
    model = model.double().eval()
    texts = [["a film", "the best film of the year"], ["dull", "it is"]]
    batches = []
    for i, chunk in enumerate(texts):
        enc = dict(tok(chunk, padding="longest", return_tensors="pt"))
        enc["labels"] = torch.tensor([i, 2])
        batches.append(enc)
    subset = sparse_kfac(model, 40.0) | last_layer(model)
    feats = loader_features(model, batches, subset)
    pairs = [dense_jacobians(model, b, subset) for b in batches]
    phi = torch.cat([p[1] for p in pairs])
    with torch.no_grad():
        logits = torch.cat(
            [model(**{k: v for k, v in b.items() if k != "labels"}).logits for b in batches]
        )
    torch.testing.assert_close(torch.cat([p[0] for p in pairs]), logits)
    assert phi.shape == (4, 3, feats.d)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(feats.d, 2, generator=gen, dtype=F64)
    v = torch.randn(4, 3, 2, generator=gen, dtype=F64)
    idx = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(torch.einsum("nmd,dk->nmk", phi[idx], z), feats.apply(idx, z))
    torch.testing.assert_close(torch.einsum("nmd,nmk->dk", phi[idx], v), feats.apply_t(idx, v))
