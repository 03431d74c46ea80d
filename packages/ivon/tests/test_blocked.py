"""The update math (ivon_update) and the ways of applying it (packed, chunked, whole) against each other."""

import math

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from partialbayes.ivon import IVON, _kernels
from partialbayes.ivon._kernels import Hyper, Update, ivon_update, update_

HYPER = Hyper(
    lr=0.1, beta1=0.9, beta2=0.8, weight_decay=0.01, ess=7.0, bias_correction=0.5, clip_radius=None
)


@given(
    h=st.floats(1e-6, 1e3),
    h_hat=st.floats(-1e4, 1e4),
    beta2=st.floats(0.0, 0.999999),
    delta=st.floats(0.0, 1.0),
)
@example(h=1e-6, h_hat=-1.0, beta2=0.0, delta=1.0)  # h' < 0, h' + δ > 0
def test_hessian_stays_positive_and_fixes_h_hat_equal_h(h, h_hat, beta2, delta):
    """h' = β2·h + (1−β2)·ĥ + ½(1−β2)²(h−ĥ)²/(h+δ) (gradsq feeds ĥ directly).

    For every ĥ the precision stays positive, h' + δ ≥ (h + δ)/2 (Lin et al. 2020, Thm. 1: with S = h + δ and
    x = (1−β2)(h−ĥ), S' = (S−x)²/(2S) + S/2); h' itself can fall below 0 only for ĥ < 0, which gradsq's
    squares never give (h = 1e-6, ĥ = −1, β2 = 0, δ = 1 gives h' = −0.5, h' + δ = 0.5).
    """
    t = torch.tensor([h], dtype=torch.float64)
    hyper = HYPER._replace(beta2=beta2, weight_decay=delta)
    zero = torch.zeros_like(t)
    kw = dict(hess_approx="gradsq", learn_hess=True)
    stat = torch.tensor([h_hat]).double()
    _, _, new = ivon_update(Update(zero, zero, t, zero, None, stat, None), hyper, **kw)
    assert new.item() + delta >= (h + delta) / 2 * (1 - 1e-12)
    if h_hat >= 0:
        assert new.item() > 0
    _, _, same = ivon_update(Update(zero, zero, t, zero, None, t, None), hyper, **kw)
    torch.testing.assert_close(same, t, rtol=1e-12, atol=0)


def test_fixed_hessian_and_mask_keep_h():
    g = torch.Generator().manual_seed(0)
    m, mu, g_, stat = (torch.randn(6, generator=g, dtype=torch.float64) for _ in range(4))
    h = torch.rand(6, generator=g, dtype=torch.float64) + 0.5
    mask = torch.tensor([True, False, True, False, False, True])
    kw = dict(hess_approx="price")
    _, _, fixed = ivon_update(Update(m, mu, h, g_, None, None, None), HYPER, learn_hess=False, **kw)
    assert fixed is h
    u = Update(m, mu, h, g_, None, stat, mask)
    _, _, masked = ivon_update(u, HYPER, learn_hess=True, **kw)
    assert torch.equal(masked[~mask], h[~mask])
    assert (masked[mask] != h[mask]).all()


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    chunk=st.integers(1, 17),
    small=st.integers(0, 30),
    seed=st.integers(0, 1000),
    case=st.sampled_from(
        [
            ("price", "noise"),
            ("price", "stat"),
            ("gradsq", None),
            ("gradsq", "stat"),
            ("fixed", None),
        ]
    ),
    masked=st.booleans(),
    clip=st.sampled_from([0.3, None]),
)
def test_packed_and_chunked_update_equals_whole_tensor_update(
    sizes, chunk, small, seed, case, masked, clip
):
    hess_approx, source = case
    g = torch.Generator().manual_seed(seed)

    def make():
        return [torch.randn(n, generator=g, dtype=torch.float64) for n in sizes]

    means, mom, grads, extra = make(), make(), make(), make()
    hess = [torch.rand(n, generator=g, dtype=torch.float64) + 0.1 for n in sizes]
    masks = [torch.rand(n, generator=g) < 0.5 if masked else None for n in sizes]
    noises = [e.half() for e in extra] if source == "noise" else None
    stats = extra if source == "stat" else None
    learn = hess_approx != "fixed"
    kwargs = dict(
        hyper=HYPER._replace(clip_radius=clip),
        hess_approx="price" if hess_approx == "fixed" else hess_approx,
        learn_hess=learn,
    )

    def items(lists):
        m, mu, h = lists
        return [
            Update(m[i], mu[i], h[i], grads[i], noises and noises[i], stats and stats[i],
                   masks[i] if learn else None)
            for i in range(len(sizes))
        ]  # fmt: skip

    copies = [[t.clone() for t in lst] for lst in (means, mom, hess)]
    saved = _kernels.CHUNK, _kernels.SMALL
    _kernels.CHUNK, _kernels.SMALL = chunk, {False: small, True: small}
    try:
        _kernels.apply(update_, items(copies), **kwargs)
    finally:
        _kernels.CHUNK, _kernels.SMALL = saved
    for it in items((means, mom, hess)):
        update_(it, **kwargs)
    for a_list, b_list in zip(copies, (means, mom, hess), strict=True):
        for a, b in zip(a_list, b_list, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # setattr each time
@given(n_hidden=st.integers(5, 60), seed=st.integers(0, 1000))
def test_chunked_draw_and_update_equal_whole_tensor_ones(n_hidden, seed, monkeypatch):
    """Chunked and packed passes take the same steps as whole-tensor ones (the noise is drawn whole)."""
    finals = []
    for chunk, small in ((1 << 22, 0), (32, 0), (7, 0), (32, 40), (1 << 22, 1 << 22)):
        monkeypatch.setattr(_kernels, "CHUNK", chunk)
        monkeypatch.setattr(_kernels, "SMALL", {False: small, True: small})
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


def test_strided_parameters_are_updated_in_place():
    """A non-contiguous parameter (a transposed view) goes through the kernel whole, unchanged in layout."""
    torch.manual_seed(0)
    base = torch.randn(300, 400, dtype=torch.float64)
    strided = torch.nn.Parameter(base.t())  # 400 x 300, not contiguous, > SMALL entries
    plain = torch.nn.Parameter(base.t().contiguous())
    runs = []
    for p in (strided, plain):
        opt = IVON(
            [p], lr=0.1, ess=10.0, generator=torch.Generator().manual_seed(1), compiled=False
        )
        for _ in range(2):
            with opt.sampled_params(train=True):
                (p**2).sum().backward()
            opt.step()
        runs.append(p.detach().clone())
    assert not strided.is_contiguous()
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-15, atol=0)
    assert math.isfinite(runs[0].sum().item())
