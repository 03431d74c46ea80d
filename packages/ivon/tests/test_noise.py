"""The noise draw: float32 standard normals, small tensors straight from the generator, large CPU tensors in
seeded pieces, cast to the target's dtype."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partialbayes.ivon import _noise


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(_noise, "PIECE", 64)


def _expected(sizes, seed, dtype):
    """The documented construction, written out: per tensor in order, direct or seeded pieces."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        z = torch.empty(n, dtype=torch.float32)
        if n <= _noise.PIECE:
            z.normal_(generator=gen)
        else:
            starts = range(0, n, _noise.PIECE)
            for start, s in zip(starts, _noise.piece_seeds(len(starts), gen), strict=True):
                z[start : start + _noise.PIECE].normal_(generator=torch.Generator().manual_seed(s))
        out.append(z.to(dtype))
    return out


@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.float16, torch.float32, torch.float64]),
)
def test_noise_is_the_documented_construction_whatever_the_thread_count(sizes, seed, dtype):
    saved_piece, threads = _noise.PIECE, torch.get_num_threads()
    _noise.PIECE = 64
    try:
        expected = _expected(sizes, seed, dtype)
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            got = [torch.empty(n, dtype=dtype) for n in sizes]
            _noise.normal_(got, torch.Generator().manual_seed(seed))
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b)
    finally:
        _noise.PIECE = saved_piece
        torch.set_num_threads(threads)


def test_small_tensors_draw_straight_from_the_generator_in_order():
    sizes = [5, 3, 7]
    got = [torch.empty(n, dtype=torch.float16) for n in sizes]
    _noise.normal_(got, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(1)
    for z in got:
        assert torch.equal(z, torch.empty(z.shape).normal_(generator=gen).half())


def test_global_rng_when_no_generator(small_pieces):
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        z = torch.empty(1000)
        _noise.normal_([z], None)
        draws.append(z)
    assert torch.equal(*draws)


def test_pieces_are_standard_normal_and_uncorrelated(small_pieces):
    """Mean, variance and the correlation of neighbouring pieces within sampling error (fixed seed)."""
    n_pieces, std = 400, 1.0
    z = torch.empty(n_pieces * _noise.PIECE, dtype=torch.float64)
    _noise.normal_([z], torch.Generator().manual_seed(3))
    n = z.numel()
    assert abs(z.mean().item()) < 5 * std / math.sqrt(n)
    assert abs(z.var().item() / std**2 - 1) < 5 * math.sqrt(2 / n)
    pieces = z.view(n_pieces, -1) / std
    corr = (pieces[1:] * pieces[:-1]).mean(1)  # each ~ N(0, 1/PIECE) if independent
    assert abs(corr.mean().item()) < 5 / math.sqrt(corr.numel() * _noise.PIECE)
    assert corr.abs().max().item() < 5 / math.sqrt(_noise.PIECE)
    assert len(set(_noise.piece_seeds(n_pieces, torch.Generator().manual_seed(3)))) == n_pieces


def test_generator_on_another_device_and_strided_tensors(small_pieces):
    t = torch.empty(20, 30).t()  # not contiguous: drawn whole, in the order of its shape
    _noise.normal_([t], torch.Generator().manual_seed(0))
    assert torch.equal(t, torch.empty(30, 20).normal_(generator=torch.Generator().manual_seed(0)))
    if torch.cuda.is_available():
        z = torch.empty(100, device="cuda")
        _noise.normal_([z], torch.Generator().manual_seed(0))
        expected = torch.empty(100).normal_(generator=torch.Generator().manual_seed(0))
        assert torch.equal(z.cpu(), expected)  # drawn whole on the generator's device, then copied
