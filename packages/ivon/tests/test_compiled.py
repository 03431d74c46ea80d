"""The torch.compile'd kernels: same results as the eager kernels, a clean fallback, no compile for small models."""

import math
import warnings

import pytest
import torch

from partialbayes.ivon import IVON, _kernels, optimizer


@pytest.fixture(autouse=True)
def _no_small_tensors(monkeypatch):
    """Compiled kernels run only on tensors above _kernels.SMALL entries: make every tensor large."""
    monkeypatch.setattr(_kernels, "SMALL", {False: 0, True: 0})


class _MaskSubset:
    def __init__(self, masks):
        self._masks = masks
        self.names = tuple(masks)

    def mask(self, name):
        return self._masks[name]


def _run(compiled, *, hess_approx="price", mc=1, clip=math.inf, masked=False, dtype=torch.float64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 20), torch.nn.Tanh(), torch.nn.Linear(20, 2))
    model = model.to(dtype)
    x = torch.randn(7, 3, dtype=dtype)
    y = torch.randn(7, 2, dtype=dtype)
    hyper = dict(
        lr=0.05, ess=30.0, hess_init=0.3, beta2=0.9, mc_samples=mc, hess_approx=hess_approx,
        clip_radius=clip, generator=torch.Generator().manual_seed(1), compiled=compiled,
    )  # fmt: skip
    if masked:
        mask = torch.rand(2, 20, generator=torch.Generator().manual_seed(2)) < 0.5
        opt = IVON.from_subset(model, _MaskSubset({"2.weight": mask}), **hyper)
    else:
        opt = IVON(model.parameters(), **hyper)
    for _ in range(3):
        for _ in range(mc):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
        opt.step()
    ps = list(model.parameters())
    return [p.detach().clone() for p in ps] + [opt.state[p]["hess"].clone() for p in ps]


def test_failed_compilation_warns_once_and_falls_back_to_eager(monkeypatch):
    _broken_compile(monkeypatch)
    with pytest.warns(RuntimeWarning, match="no compiler here") as record:
        fallback = _run(True, mc=2)
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert _kernels._STATE["ok"] is False
    eager = _run(False, mc=2)
    for a, b in zip(eager, fallback, strict=True):
        assert torch.equal(a, b)


def _broken_compile(monkeypatch):
    calls = []

    def broken_compile(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setitem(_kernels._STATE, "ok", None)
    monkeypatch.setitem(_kernels._STATE, "fns", {})
    return calls


def test_default_falls_back_silently_where_compiling_fails(monkeypatch):
    calls = _broken_compile(monkeypatch)
    monkeypatch.setattr(optimizer, "AUTO_COMPILE_MIN", 0)  # the test model counts as large
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fallback = _run(None, mc=2)
    assert calls
    assert _kernels._STATE["ok"] is False
    eager = _run(False, mc=2)
    for a, b in zip(eager, fallback, strict=True):
        assert torch.equal(a, b)


def test_default_does_not_compile_for_small_models(monkeypatch):
    calls = _broken_compile(monkeypatch)
    _run(None)
    assert not calls
    assert _kernels._STATE["ok"] is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        {},
        {"mc": 2},
        {"clip": 0.01},
        {"hess_approx": "gradsq"},
        {"hess_approx": "gradsq", "mc": 2},
        {"masked": True},
        {"masked": True, "mc": 2, "clip": 0.01},
    ],
)
def test_compiled_kernels_match_eager_kernels(case):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = _run(True, **case)
    if any("torch.compile failed" in str(w.message) for w in record):
        pytest.skip("torch.compile is not available here")
    eager = _run(False, **case)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.slow
def test_compiled_kernels_float32():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = _run(True, dtype=torch.float32)
    if any("torch.compile failed" in str(w.message) for w in record):
        pytest.skip("torch.compile is not available here")
    eager = _run(False, dtype=torch.float32)
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
