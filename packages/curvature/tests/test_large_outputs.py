"""A 50,257-token output (GPT-2's vocabulary): no C × C object, the exact Fisher refused, memory known first."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from _alloc_guard import LargestTensor

from partialbayes.curvature import DenseLaplace, DiagLaplace, KronLaplace, kfac, memory_estimate
from partialbayes.curvature import _memory as memory_module
from partialbayes.selection import modules

VOCAB = 50257
MAPS = ["transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]


def _lm(device, **options):
    model = tiny_model("gpt2", "causal-lm", seed=0, vocab=VOCAB, hidden=8, positions=16, **options)
    return model.to(device).eval()


def _batch(device):
    """Two prompts of 6 tokens (the second padded by one), each with one scored answer token."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 6), generator=g)
    mask = torch.tensor([[1] * 6, [1] * 5 + [0]])
    labels = torch.full((2, 6), -100)
    labels[0, 5], labels[1, 4] = ids[0, 5], ids[1, 4]
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "labels": labels.to(device),
    }


@pytest.mark.parametrize("fisher", ["mc", "empirical"])
def test_mc_and_empirical_fisher_build_nothing_of_vocabulary_squared(device, fisher):
    """No tensor near C² elements (the old identity was C² = 2.5e9 floats, 10 GB) is ever created."""
    model = _lm(device)
    subset = modules(model, MAPS)
    g = torch.Generator(device).manual_seed(0)
    with LargestTensor(limit=VOCAB**2 // 1000) as guard:
        factors = kfac(
            model, [_batch(device)], subset, fisher=fisher, sharing="expand", generator=g
        )
    assert guard.largest <= 2 * 6 * VOCAB  # one batch's logits [B, T, C] is the largest
    assert set(factors) == set(MAPS)
    assert all(bool(torch.isfinite(f.G).all()) and float(f.G.trace()) > 0 for f in factors.values())


def test_exact_fisher_on_a_vocabulary_is_refused_before_any_backward_pass(device):
    model = _lm(device)
    with (
        LargestTensor(limit=VOCAB**2 // 1000),
        pytest.raises(
            ValueError, match=r"fisher='exact' on 50257 outputs costs 50,257 backward"
        ) as err,
    ):
        kfac(model, [_batch(device)], modules(model, MAPS), fisher="exact", sharing="expand")
    for hint in ("[50257, 2, 50257]", "fisher='mc'", "fisher='empirical'", "target_ids", "batch 0"):
        assert hint in str(err.value)


def test_exact_fisher_refused_when_its_vectors_exceed_memory(monkeypatch, device):
    """Few outputs but little memory: the [C, N, C] output vectors are refused, naming the memory."""
    monkeypatch.setattr(memory_module, "available_memory", lambda dev: (1000, "test budget"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 10)).to(device).eval()
    data = [(torch.randn(8, 3, device=device), torch.zeros(8, dtype=torch.long, device=device))]
    with pytest.raises(
        ValueError, match=r"3\.12 KiB of output vectors .* 1000 B available \(test budget\)"
    ):
        kfac(model, data, modules(model, ["0"]), fisher="exact")
    kfac(model, data, modules(model, ["0"]), fisher="empirical")  # one vector per example: fine


def test_memory_estimate_refuses_an_lm_head_before_allocating(device):
    """An untied 50k LM head in the subset: G alone is 50257² floats; refused with the numbers and fixes."""
    model = _lm(device, tie_word_embeddings=False)
    subset = modules(model, [*MAPS, "lm_head"])
    with LargestTensor(limit=VOCAB**2 // 1000):
        est = memory_estimate(model, subset, _batch(device), fisher="mc", sharing="expand")
        with pytest.raises(ValueError, match="Refused before allocating") as err:
            est.check(max_memory=4 * 2**30)
    assert est.factors >= VOCAB**2 * 8
    assert "G of 'lm_head' (50257 x 50257)" in str(err.value)
    assert "max_rank" in str(err.value)
    assert "sparse_kfac" in str(err.value)
    low = memory_estimate(
        model, subset, _batch(device), fisher="mc", sharing="expand", max_rank=64, target_ids=[5, 7]
    )
    assert low.total < est.total / 500  # the head's G as a rank-64 sketch: O(n · 74) floats
    low.check(max_memory=2**30)
    assert "predictive, per batch" in str(low)
    whole_vocab = memory_estimate(model, subset, _batch(device), fisher="mc", sharing="expand")
    assert whole_vocab.predictive > 1000 * low.predictive  # [N, C, C] covariances vs [N, 2, 2]


_MEASURE = textwrap.dedent(
    """
    import json, torch
    from torch import nn
    from partialbayes.curvature import DenseLaplace, DiagLaplace, KronLaplace, kfac, memory_estimate
    from partialbayes.curvature._kfac import whole_factor
    from partialbayes.selection import modules

    torch.set_num_threads(1)

    def run(width):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(300, width), nn.Tanh(), nn.Linear(width, 10)).eval()
        data = [(torch.randn(64, 300), torch.randint(0, 10, (64,)))]
        subset = modules(model, ["0", "2"])
        est = memory_estimate(model, subset, data[0], fisher="mc")
        fs = kfac(model, data, subset, fisher="mc", generator=torch.Generator().manual_seed(0))
        eig = [whole_factor(t) for f in fs.values() for t in (f.G, f.A)]
        return est

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    run(20)  # load the code paths first
    base = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    est = run(1500)
    print(json.dumps({"estimate": est.factors + est.eigen + est.fit_batch,
                      "measured": status("VmHWM:") - base}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_memory_estimate_within_a_factor_two_of_the_measured_peak():
    """kfac + eigendecompositions of a 1500-wide map: peak RSS growth within [1/2, 2] of the estimate."""
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE], capture_output=True, text=True, check=True, timeout=300
    )
    numbers = json.loads(out.stdout.strip().splitlines()[-1])
    ratio = numbers["measured"] / numbers["estimate"]
    assert 0.5 <= ratio <= 2.0, numbers


def _answer_loader(device):
    return [_batch(device)]


def test_lm_head_fit_is_refused_before_allocating_and_fits_low_rank(device):
    """An untied 50k head in the subset: refused at the first batch, before its 50257² factor; then fitted
    with ``max_rank`` (a sketch, never V²) and predicted answer-only, under the allocation guard."""
    model = _lm(device, tie_word_embeddings=False)
    subset = modules(model, [*MAPS, "lm_head"])
    g = torch.Generator(device).manual_seed(0)
    with LargestTensor(limit=VOCAB**2 // 1000):
        la = KronLaplace(model, subset, fisher="mc", max_memory=4 * 2**30)
        with pytest.raises(ValueError, match=r"allowed \(max_memory\)") as err:
            la.fit(_answer_loader(device), generator=g)
        for hint in ("G of 'lm_head' (50257 x 50257)", "max_rank", "Refused before allocating"):
            assert hint in str(err.value)
        low = KronLaplace(model, subset, fisher="mc", max_rank=16, max_memory=2**30)
        low.fit(_answer_loader(device), generator=g)
        assert "G 50257x50257 rank 16" in low.summary()
        probs = low.predict(_batch(device), target_ids=[5, 7, 11])
    assert probs.shape == (2, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, device=device, dtype=probs.dtype))


@pytest.mark.parametrize("family", [KronLaplace, DiagLaplace, DenseLaplace])
def test_answer_only_predictive_builds_nothing_of_vocabulary_squared(device, family):
    """``target_ids``: K backward passes and ``[P, K, K]``; the whole vocabulary's ``[P, C, C]`` is refused first."""
    model = _lm(device)
    subset = modules(model, MAPS[:1])
    la = family(model, subset, fisher="empirical", max_memory=8 * 2**30)
    la.fit(_answer_loader(device))
    with LargestTensor(limit=VOCAB**2 // 1000) as guard:
        f, cov = la.logit_mean_cov(_batch(device), target_ids=[3, 1, 4])
        with pytest.raises(ValueError, match=r"(?s)predictive, per batch .*target_ids") as err:
            la.logit_mean_cov(_batch(device))  # [2, 50257, 50257] covariances: 40 GB
    assert f.shape == (2, 3)
    assert cov.shape == (2, 3, 3)
    assert guard.largest <= 2 * 6 * VOCAB  # the logits
    assert "Refused before allocating" in str(err.value)


def test_a_fit_above_max_memory_is_refused_for_every_structure(device):
    model = _lm(device)
    subset = modules(model, MAPS[:1])
    for family in (KronLaplace, DiagLaplace, DenseLaplace):
        with pytest.raises(ValueError, match=r"Fit: fisher='mc'"):
            family(model, subset, fisher="mc", max_memory=1000).fit(_answer_loader(device))
    with pytest.raises(ValueError, match="max_memory must be a positive int"):
        KronLaplace(model, subset, max_memory=0)


def _estimate(total_gib, available_gib, itemsize=8):
    from partialbayes.curvature import MemoryEstimate

    gib = 2**30
    return MemoryEstimate(
        int(total_gib * gib), 0, 0, 0, "G of 'x'", available_gib * gib, "test", itemsize
    )


def test_a_memory_limit_that_is_not_a_positive_int_is_named():
    est = _estimate(1, 100)
    for bad in ("1GB", True, 1.5):
        with pytest.raises(TypeError, match=r"max_memory must be an int, got"):
            est.check(max_memory=bad)
    for bad in (-5, 0):
        with pytest.raises(ValueError, match="max_memory must be a positive"):
            est.check(max_memory=bad)


def test_a_limit_above_the_available_memory_warns_and_refuses_what_the_machine_cannot_hold():
    with (
        pytest.warns(
            UserWarning, match=r"max_memory=64.00 GiB is more than the 20.00 GiB available"
        ),
        pytest.raises(ValueError, match=r"47.00 GiB but 20.00 GiB is available"),
    ):
        _estimate(47, 20).check(max_memory=64 * 2**30)
    with pytest.warns(UserWarning, match="is more than"):
        _estimate(1, 20).check(max_memory=64 * 2**30)  # fits the machine: warned, not refused


def test_the_float32_advice_is_given_only_to_a_float64_fit():
    with pytest.raises(ValueError, match=r"dtype=torch.float32 \(half the bytes\)"):
        _estimate(47, 20).check()
    with pytest.raises(ValueError, match="Refused before allocating") as err:
        _estimate(47, 20, itemsize=4).check()
    assert "float32" not in str(err.value)


def test_memory_estimate_checks_target_ids(device):
    model = _lm(device)
    subset = modules(model, MAPS[:1])
    for bad, match in (([5, 5], "repeated"), ([VOCAB], "out of range"), ([], "non-empty")):
        with pytest.raises(ValueError, match=match):
            memory_estimate(model, subset, _batch(device), fisher="mc", target_ids=bad)
