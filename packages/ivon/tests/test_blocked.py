import functools
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partialbayes.ivon import IVON, _blocked
from partialbayes.ivon._math import EST_KINDS, hessian_update, update_


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    chunk=st.integers(1, 17),
    seed=st.integers(0, 1000),
    est_kind=st.sampled_from(EST_KINDS),
    use_workspace=st.booleans(),
    clip=st.sampled_from([0.3, math.inf]),
    small=st.integers(0, 30),
)
def test_chunked_update_equals_whole_list_update(
    sizes, chunk, seed, est_kind, use_workspace, clip, small
):
    g = torch.Generator().manual_seed(seed)

    def make():
        return [torch.randn(n, generator=g, dtype=torch.float64) for n in sizes]

    means, mom, grads, est = make(), make(), make(), make()
    hess = [torch.rand(n, generator=g, dtype=torch.float64) + 0.1 for n in sizes]
    masks = [torch.rand(n, generator=g) < 0.5 for n in sizes]
    fn = functools.partial(
        update_,
        est_kind=est_kind,
        beta1=0.9,
        beta2=0.8,
        delta=0.01,
        ess=7.0,
        lr=0.1,
        debias=0.5,
        clip_radius=clip,
    )
    if est_kind == "sample":  # weight samples near the means
        est = [m + 0.1 * e for m, e in zip(means, est, strict=True)]
    elif est_kind == "gradsq":
        est = [e * e for e in est]
    copies = [[t.clone() for t in lst] for lst in (means, mom, hess, grads, est)]
    workspace = _blocked.Workspace() if use_workspace else None
    _blocked.apply(
        fn, [*copies, masks], blocked=True, chunk=chunk, workspace=workspace, small=small
    )
    _blocked.apply(fn, [means, mom, hess, grads, est, masks], blocked=False)
    for a_list, b_list in zip(copies[:3], (means, mom, hess), strict=True):
        for a, b in zip(a_list, b_list, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_hessian_update_positive_and_fixed_point():
    h = torch.full((100,), 0.5, dtype=torch.float64)
    h_hat = torch.linspace(-50, 50, 100, dtype=torch.float64)
    assert (hessian_update(h, h_hat, 0.9, 1e-4) > 0).all()
    h = torch.tensor([2.0], dtype=torch.float64)
    torch.testing.assert_close(hessian_update(h, h, 0.99, 0.1), h)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # setattr each time
@given(n_hidden=st.integers(5, 60), seed=st.integers(0, 1000))
def test_chunked_draw_and_update_equal_whole_tensor_ones(n_hidden, seed, monkeypatch):
    """Chunked and batched passes take the same steps as whole-tensor ones (the noise is drawn whole)."""
    finals = []
    for chunk, small in ((1 << 22, 0), (32, 0), (7, 0), (32, 40)):
        monkeypatch.setattr(_blocked, "CHUNK", chunk)
        monkeypatch.setattr(_blocked, "SMALL", small)
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(3, n_hidden), torch.nn.Tanh()).double()
        x = torch.randn(4, 3, dtype=torch.float64)
        opt = IVON(model.parameters(), lr=0.1, ess=4, generator=torch.Generator().manual_seed(seed))
        for _ in range(2):
            with opt.sampled_params(train=True):
                model(x).pow(2).mean().backward()
            opt.step()
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    for other in finals[1:]:
        assert torch.equal(finals[0], other)
