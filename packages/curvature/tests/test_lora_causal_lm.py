"""Bayesian LoRA on a causal LM: a Kronecker Laplace over the adapters, scored at the answer token.

Dense float64 references by plain autograd on a tiny PEFT-wrapped Llama whose batches are prompts (labels
-100) followed by one answer token: the KFAC factors of the adapters by their definition, the exact GGN
block of the output-layer adapters, the linearised ``J Σ Jᵀ`` of the answer token, and the restriction to an
answer vocabulary; then end to end (fine-tune, fit, prior, predict, save / load, S-KFAC, conformance).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from _token_refs import LM_VOCAB, ggn, inputs, kept, llama_lm, output_jacobian, targets  # noqa: E402

from partialbayes.curvature import kfac  # noqa: E402
from partialbayes.selection import lora_modules, lora_subset, sparse_kfac  # noqa: E402

# peft calls a transformers method that transformers 5 deprecates; not ours to fix
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)
torch.set_num_threads(1)
FIXTURE = settings(
    max_examples=6,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    deadline=None,
)
ATTENTION_AND_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")


def peft_llama(
    seed: int, rank: int = 2, targets: tuple[str, ...] = ATTENTION_AND_MLP, layers: int = 2
) -> nn.Module:
    """A tiny float64 Llama with random LoRA adapters (``B ≠ 0``), weights drawn large enough to matter."""
    base = llama_lm(seed, layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0.0, 0.3, generator=g)
    lora = peft.LoraConfig(r=rank, target_modules=list(targets), init_lora_weights=False)
    model = peft.get_peft_model(base, lora).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0.0, 0.3, generator=g)
    return model


def answer_batch(b: int, t: int, seed: int) -> dict[str, Tensor]:
    """Prompts of 2 .. t-1 tokens, then one answer token, right-padded to ``t``; only the answer labelled."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, t, (b,), generator=g)
    mask = (torch.arange(t)[None] <= prompt[:, None]).long()
    ids = torch.randint(1, LM_VOCAB, (b, t), generator=g) * mask
    labels = torch.full((b, t), -100)
    labels[torch.arange(b), prompt] = ids[torch.arange(b), prompt]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _on(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def reference_factors(
    model: nn.Module,
    batch: dict[str, Tensor],
    names: list[str],
    fisher: str,
    positions: Tensor | None = None,
) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """KFAC-expand of token-level outputs by its definition: ``{module: (G, A, counted [B, T])}``.

    The output vectors of every kept position (answer token) are backpropagated at once, one pass per
    vector; ``G`` sums ``δδᵀ`` over the real positions; ``A`` averages ``xxᵀ`` over the real positions whose
    ``δ`` is not zero in some pass (relative threshold 1e-12 on ``‖δ‖²``: float64 rounding noise of the
    attention kernels is ~1e-32 there). The adapters have no bias. ``positions`` (``[B, T]`` bool) replaces
    that rule, for both factors (``docs/scripts/kfac_answer_positions.py`` passes the kept positions: the
    rule before the fix).
    """
    named = dict(model.named_modules())
    xs: dict[str, Tensor] = {}
    outs: dict[str, Tensor] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            xs[name], outs[name] = args[0].detach(), out

        return hook

    handles = [named[m].register_forward_hook(record(m)) for m in names]
    try:
        logits = model(**inputs(batch)).logits
    finally:
        for h in handles:
            h.remove()
    keep = kept(batch, True)
    p = torch.softmax(logits[keep], -1)
    eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
    if fisher == "exact":
        vectors = [p[:, c : c + 1].sqrt() * (eye[c] - p) for c in range(p.shape[-1])]
    else:
        vectors = [p - eye[targets(batch, keep, True)]]
    real = batch["attention_mask"].bool() if positions is None else positions
    G = {m: torch.zeros(()) for m in names}
    energy = {m: torch.zeros(real.shape, dtype=p.dtype, device=p.device) for m in names}
    for v in vectors:
        cot = torch.zeros_like(logits)
        cot[keep] = v
        deltas = torch.autograd.grad(logits, [outs[m] for m in names], cot, retain_graph=True)
        for m, d in zip(names, deltas, strict=True):
            d = d * real[..., None]
            G[m] = G[m] + d.reshape(-1, d.shape[-1]).T @ d.reshape(-1, d.shape[-1])
            energy[m] = torch.maximum(energy[m], d.square().sum(-1))
    out = {}
    for m in names:
        counted = real & (energy[m] > 1e-12 * energy[m].max()) if positions is None else real
        x = xs[m][counted]
        out[m] = (G[m], x.T @ x / x.shape[0], counted)
    return out


# ----------------------------------------------------------------------------- KFAC of the adapters
@FIXTURE
@given(
    seed=st.integers(0, 2**10),
    b=st.integers(1, 3),
    t=st.integers(3, 6),
    rank=st.integers(1, 3),
    fisher=st.sampled_from(["exact", "empirical"]),
    percent=st.sampled_from([None, 50]),
)
def test_kfac_counts_every_position_that_feeds_the_answer(
    device, seed, b, t, rank, fisher, percent
):
    """Prompt tokens labelled -100 still feed the answer through attention: their δ and x are in the factors.

    Before the fix, a module's examples were the kept *output* positions only, so the value projections of
    the prompt (the path the answer reads the prompt through) were missing from ``G`` and ``A``.
    """
    model = peft_llama(seed, rank).to(device)
    batch = _on(answer_batch(b, t, seed), device)
    mods = lora_modules(model)
    subset = (
        lora_subset(model) if percent is None else sparse_kfac(model, percent, modules=list(mods))
    )
    factors = kfac(model, [batch], subset, sharing="expand", fisher=fisher)
    ref = reference_factors(model, batch, list(mods), fisher)
    n_kept = int(kept(batch, True).sum())
    for m, f in factors.items():
        G, A, counted = ref[m]
        rows = slice(None) if f.rows is None else f.rows
        cols = slice(None) if f.cols is None else f.cols
        torch.testing.assert_close(f.G, G[rows][:, rows], rtol=1e-9, atol=1e-14)
        torch.testing.assert_close(f.A, A[cols][:, cols], rtol=1e-9, atol=1e-14)
        if (
            ".layers.0.self_attn.v_proj." in m
        ):  # the test means something: prompt positions count here
            assert int(counted.sum()) > n_kept
        if (
            ".layers.1.mlp." in m
        ):  # per-token path after the last attention: the answer position alone
            assert int(counted.sum()) == n_kept


@FIXTURE
@given(
    seed=st.integers(0, 2**10),
    t=st.integers(3, 6),
    rank=st.integers(1, 3),
    fisher=st.sampled_from(["exact", "empirical"]),
)
def test_output_layer_adapters_exact_with_one_answer(device, seed, t, rank, fisher):
    """LoRA on ``lm_head``, one prompt and its answer: ``G ⊗ A`` is the exact GGN (or EF) block.

    The output layer acts per position and only the answer position is scored, so its factors must see that
    position alone — the prompt tokens feed it nothing (counting them in ``A`` would break exactness).
    """
    model = peft_llama(seed, rank, targets=("lm_head",)).to(device)
    batch = _on(answer_batch(1, t, seed), device)
    subset = lora_subset(model)
    factors = kfac(model, [batch], subset, sharing="expand", fisher=fisher)
    keep = kept(batch, True)
    logits, J = output_jacobian(model, batch, keep, subset)
    sizes = [subset.num_entries(n) for n in subset.names]
    if fisher == "exact":
        H = ggn(J, logits)
    else:
        r = (
            torch.softmax(logits, -1)
            - torch.eye(logits.shape[-1]).to(logits)[targets(batch, keep, True)]
        )
        grad = torch.einsum("ncp,nc->np", J, r)
        H = grad.T @ grad
    start = 0
    for name, k in zip(subset.names, sizes, strict=True):
        f = factors[name.removesuffix(".weight")]
        block = H[start : start + k, start : start + k]
        start += k
        torch.testing.assert_close(torch.kron(f.G, f.A), block, rtol=1e-9, atol=1e-12)
