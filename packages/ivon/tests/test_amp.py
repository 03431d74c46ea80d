"""Mixed precision: torch.amp.GradScaler (scaled gradients, skipped steps) and autocast."""

import pytest
import torch

from partialbayes.ivon import IVON


def _scaler(init_scale=2.0**12):
    try:
        return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    except (AttributeError, RuntimeError, TypeError) as err:  # pragma: no cover - old torch
        pytest.skip(f"torch.amp.GradScaler on the CPU is not available: {err}")


def _setup(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model = model.to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(9, 3, generator=g).to(dtype)
    y = torch.randn(9, 2, generator=g).to(dtype)
    return model, x, y


def _opt(model, mc=1, hess_approx="price", seed=3):
    return IVON(
        model.parameters(), lr=0.1, ess=9.0, hess_init=0.5, beta2=0.9, mc_samples=mc,
        hess_approx=hess_approx, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def _state(model, opt):
    ps = list(model.parameters())
    return (
        [p.detach().clone() for p in ps]
        + [opt.state[p]["hess"].clone() for p in ps]
        + [opt.state[p]["momentum"].clone() for p in ps]
    )


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("mc", [1, 2])
@pytest.mark.parametrize("hess_approx", ["price", "gradsq"])
def test_grad_scaler_run_equals_unscaled_run(mc, hess_approx):
    runs = []
    for scaled in (False, True):
        model, x, y = _setup()
        opt = _opt(model, mc, hess_approx)
        scaler = _scaler() if scaled else None
        for _ in range(4):
            for _ in range(mc):
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    loss = _loss(model, x, y)
                    (scaler.scale(loss) if scaled else loss).backward()
            if scaled:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        assert opt.current_step == 4
        runs.append(_state(model, opt))
    for a, b in zip(*runs, strict=True):  # power-of-two scaling is exact
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_inf_gradients_skip_the_step_without_touching_the_state():
    model, x, y = _setup()
    opt = _opt(model)
    scaler = _scaler()
    ref_model, _, _ = _setup()
    ref = _opt(ref_model)
    for t in range(4):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            loss = _loss(model, x, y) * (float("inf") if t == 1 else 1.0)
            scaler.scale(loss).backward()
        before = _state(model, opt)
        steps_before = opt.current_step
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if t == 1:  # skipped: nothing moved, the scale backed off, the samples were dropped
            for a, b in zip(before, _state(model, opt), strict=True):
                assert torch.equal(a, b)
            assert opt.current_step == steps_before
            assert scaler.get_scale() == scale_before / 2
            assert all(p.grad is None for p in model.parameters())
            with ref.sampled_params():  # the reference consumes the same noise, takes no step
                pass
        else:
            with ref.sampled_params(train=True):
                ref.zero_grad()
                _loss(ref_model, x, y).backward()
            ref.step()
    assert opt.current_step == 3
    for a, b in zip(_state(model, opt), _state(ref_model, ref), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for a in _state(model, opt):
        assert torch.isfinite(a).all()


def test_explicit_unscale_for_gradient_clipping():
    runs = []
    for scaled in (False, True):
        model, x, y = _setup()
        opt = _opt(model)
        scaler = _scaler()
        for _ in range(3):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                loss = _loss(model, x, y)
                (scaler.scale(loss) if scaled else loss).backward()
            if scaled:
                scaler.unscale_(opt)  # p.grad holds the (MC-averaged) gradient after the block
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if scaled:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        runs.append(_state(model, opt))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_explicit_unscale_with_several_samples_raises():
    model, x, y = _setup()
    opt = _opt(model, mc=2)
    scaler = _scaler()
    for _ in range(2):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            scaler.scale(_loss(model, x, y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.step(opt)


def _autocast_ok(dtype):
    try:
        with torch.autocast("cpu", dtype=dtype):
            torch.nn.Linear(2, 2)(torch.ones(1, 2))
    except (RuntimeError, ValueError) as err:  # pragma: no cover - old torch
        pytest.skip(f"CPU autocast with {dtype} is not available: {err}")


def test_float16_autocast_with_grad_scaler_matches_unscaled_autocast():
    _autocast_ok(torch.float16)
    runs = []
    for scaled in (False, True):
        model, x, y = _setup(torch.float32)
        opt = _opt(model)
        scaler = _scaler(2.0**8)
        losses = []
        for _ in range(5):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = _loss(model, x, y).float()
                (scaler.scale(loss) if scaled else loss).backward()
            losses.append(loss.item())
            if scaled:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        assert all(p.dtype == torch.float32 for p in model.parameters())
        runs.append(_state(model, opt))
    for a, b in zip(*runs, strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bfloat16_autocast_trains_close_to_float32():
    _autocast_ok(torch.bfloat16)
    runs = []
    for autocast in (False, True):
        model, x, y = _setup(torch.float32)
        opt = _opt(model)
        for _ in range(5):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = _loss(model, x, y).float()
                loss.backward()
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.02)  # bf16 has 8 mantissa bits
