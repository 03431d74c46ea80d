import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partialbayes.curvature import kfac
from partialbayes.curvature._kfac import shared_rows
from partialbayes.selection import modules

FIXTURE_OK = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


@FIXTURE_OK
@given(b=st.integers(1, 3), t=st.integers(1, 5), d=st.integers(1, 3), seed=st.integers(0, 999))
def test_shared_rows_reduce_and_expand_equal_loops(device, b, t, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, d, generator=g, dtype=torch.float64).to(device)
    mask = (torch.rand(b, t, generator=g) > 0.4).to(device, torch.float64)
    mask[:, 0] = 1  # every sequence keeps a token
    summed = torch.stack([sum(x[i, j] * mask[i, j] for j in range(t)) for i in range(b)])
    torch.testing.assert_close(shared_rows(x, mask, "reduce", mean=False), summed)
    torch.testing.assert_close(
        shared_rows(x, mask, "reduce", mean=True), summed / mask.sum(1, keepdim=True)
    )
    expanded = shared_rows(x, mask, "expand", mean=True)
    torch.testing.assert_close(expanded, (x * mask[..., None]).reshape(b * t, d))
    torch.testing.assert_close(shared_rows(x[:, 0], None, "reduce", mean=True), x[:, 0])


@pytest.mark.parametrize("sizes", [[1], [5], [2, 3, 1]])
def test_streamed_kfac_equals_the_one_shot_statement(device, sizes):
    """A linear regression layer, empirical Fisher: δ_n = (W x_n + b − y_n) / σ², over uneven batches."""
    g = torch.Generator().manual_seed(sum(sizes))
    model = torch.nn.Linear(3, 2).double().to(device).eval()
    n, sigma = sum(sizes), 0.7
    x = torch.randn(n, 3, generator=g, dtype=torch.float64).to(device)
    y = torch.randn(n, 2, generator=g, dtype=torch.float64).to(device)
    loader = list(zip(x.split(sizes), y.split(sizes), strict=True))
    (f,) = kfac(
        model,
        loader,
        modules(model, [""]),
        likelihood="regression",
        fisher="empirical",
        sigma_noise=sigma,
    ).values()
    with torch.no_grad():
        delta = (model(x) - y) / sigma**2
    x1 = torch.cat([x, torch.ones(n, 1, dtype=x.dtype, device=device)], 1)  # the folded bias
    torch.testing.assert_close(f.G, delta.T @ delta)
    torch.testing.assert_close(f.A, x1.T @ x1 / n)
    if n == 1:  # one datum: G ⊗ A is the empirical Fisher block, the outer product of its gradient
        grad = (delta.T @ x1).reshape(-1)  # row-major vec of the (n_out x n_in | bias) gradient
        torch.testing.assert_close(torch.kron(f.G, f.A), torch.outer(grad, grad))
