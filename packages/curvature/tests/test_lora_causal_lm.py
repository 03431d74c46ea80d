"""Bayesian LoRA on a causal LM: a Kronecker Laplace over the adapters, scored at the answer token.

Dense float64 references by plain autograd on a tiny PEFT-wrapped Llama whose batches are prompts (labels
-100) followed by one answer token: the KFAC factors of the adapters by their definition, the exact GGN
block of the output-layer adapters, the linearised ``J Σ Jᵀ`` of the answer token, and the restriction to an
answer vocabulary; then end to end (fine-tune, fit, prior, predict, save / load, S-KFAC, conformance).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from _token_refs import LM_VOCAB, ggn, inputs, kept, llama_lm, output_jacobian, targets  # noqa: E402

from partialbayes.curvature import (  # noqa: E402
    DenseLaplace,
    DiagLaplace,
    KronLaplace,
    dense_curvature,
    kfac,
)
from partialbayes.predictive import Posterior, probit  # noqa: E402
from partialbayes.predictive.testing import check_posterior  # noqa: E402
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


# ----------------------------------------------------------------------------- the linearised predictive
def random_factors(la: KronLaplace, seed: int) -> dict[str, SimpleNamespace]:
    """Positive definite ``G`` (summed scale) and ``A`` for every block of ``la``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in la.modules:
        r, _, c = la._dims[m]
        xg = torch.randn(r, r, generator=g, dtype=torch.float64)
        xa = torch.randn(c, c, generator=g, dtype=torch.float64)
        out[m] = SimpleNamespace(G=xg @ xg.T, A=xa @ xa.T / c)
    return out


def jacobian_by_module(J: Tensor, subset, modules: tuple[str, ...]) -> Tensor:
    """``J [N, C, P]`` (subset order) with its columns in ``modules`` order (one weight per adapter)."""
    start, per = 0, {}
    for n in subset.names:
        k = subset.num_entries(n)
        per[n.removesuffix(".weight")] = J[..., start : start + k]
        start += k
    return torch.cat([per[m] for m in modules], -1)


@FIXTURE
@given(
    seed=st.integers(0, 2**10),
    b=st.integers(1, 3),
    t=st.integers(3, 6),
    rank=st.integers(1, 3),
    prior=st.floats(0.2, 5.0),
    family=st.sampled_from(["kron", "dense"]),
    chunk=st.sampled_from([None, 1]),
)
def test_answer_token_covariance_equals_dense_reference(
    device, seed, b, t, rank, prior, family, chunk
):
    """``logit_mean_cov`` of the answer tokens is ``J P⁻¹ Jᵀ`` with ``J`` by plain autograd on the adapters.

    Kron: any Kronecker factors, ``P = blockdiag(G ⊗ A + δI)``. Dense: the fitted curvature is the exact
    GGN of the training answers, by the same autograd (an exactness case), and ``P = GGN + δI``.
    """
    model = peft_llama(seed, rank).to(device)
    subset = lora_subset(model)
    test = _on(answer_batch(b, t, seed + 1), device)
    keep = kept(test, True)
    if family == "kron":
        la = KronLaplace(model, subset, prior_precision=prior, sharing="expand")
        factors = random_factors(la, seed)
        la.fit_curvature(factors, map_loss=1.0, n_data=5, n_outputs=LM_VOCAB)
        P = torch.block_diag(
            *[
                torch.kron(factors[m].G, factors[m].A)
                + prior * torch.eye(factors[m].G.shape[0] * factors[m].A.shape[0]).double()
                for m in la.modules
            ]
        )
        logits, J = output_jacobian(model, test, keep, subset)
        J = jacobian_by_module(J.cpu(), subset, la.modules)
    else:
        train = _on(answer_batch(3, t, seed), device)
        la = DenseLaplace(model, subset, prior_precision=prior).fit([train])
        train_logits, J_train = output_jacobian(model, train, kept(train, True), subset)
        H = ggn(J_train, train_logits).cpu()
        torch.testing.assert_close(dense_curvature(model, [train], subset).cpu(), H)
        P = H + prior * torch.eye(H.shape[0]).double()
        logits, J = output_jacobian(model, test, keep, subset)
        J = J.cpu()
    ref = J @ torch.linalg.solve(P, J.mT)
    f, cov = la.logit_mean_cov(test, chunk_size=chunk)
    assert f.shape == (b, LM_VOCAB)
    assert cov.shape == (b, LM_VOCAB, LM_VOCAB)
    torch.testing.assert_close(f, logits)
    torch.testing.assert_close(cov.cpu(), ref, rtol=1e-7, atol=1e-10)
    probs = la.predict(test)  # [B, T, V]: every real position by the probit, padding at the MAP
    torch.testing.assert_close(probs[keep].cpu(), probit(logits.cpu(), ref))
    full = model(**inputs(test)).logits.detach()
    padding = test["attention_mask"] == 0
    torch.testing.assert_close(probs[padding], torch.softmax(full, -1)[padding])
    torch.testing.assert_close(la.predict(inputs(test)), probs)  # labels are ignored


@FIXTURE
@given(
    seed=st.integers(0, 2**10),
    b=st.integers(1, 3),
    t=st.integers(3, 6),
    family=st.sampled_from(["kron", "kron-low-rank", "diag", "dense"]),
    ids=st.lists(st.integers(0, LM_VOCAB - 1), min_size=1, max_size=4, unique=True),
    chunk=st.sampled_from([None, 1]),
)
def test_answer_only_predictive_equals_the_dense_reference(device, seed, b, t, family, ids, chunk):
    """``target_ids``: ``J_K P⁻¹ J_Kᵀ`` of the answer tokens' logits at the answer positions, ``K`` passes.

    ``J_K`` (the rows ``ids`` of the Jacobian, by plain autograd) at the positions the labels mark (the
    causal shift), or without labels at each sequence's last real token; the probit of that Gaussian is
    `predict`'s distribution over the ``K`` tokens; draws are ``[n, P, K]``.
    """
    model = peft_llama(seed, 2).to(device)
    subset = lora_subset(model)
    train = _on(answer_batch(3, t, seed), device)
    if family == "dense":
        la = DenseLaplace(model, subset, prior_precision=0.6).fit([train])
        P = dense_curvature(model, [train], subset).cpu() + 0.6 * torch.eye(subset.num_entries())
        order = subset.names
    elif family == "diag":
        la = DiagLaplace(model, subset, prior_precision=0.6).fit([train])
        P = torch.diag(torch.cat([la._h[n] for n in subset.names]).cpu() + 0.6)
        order = subset.names
    else:
        la = KronLaplace(
            model, subset, prior_precision=0.6, max_rank=2 if family == "kron-low-rank" else None
        )
        la.fit_curvature(random_factors(la, seed), map_loss=1.0, n_data=5, n_outputs=LM_VOCAB)
        P = torch.block_diag(*[dense_block(la, m) for m in la.modules])
        order = la.modules
    test = _on(answer_batch(b, t, seed + 1), device)
    keep = kept(test, True)
    logits, J = output_jacobian(model, test, keep, subset)
    if family != "dense" and family != "diag":
        J = jacobian_by_module(J.cpu(), subset, order)
    sub = torch.tensor(ids)
    J = J.cpu()[:, sub]
    ref = J @ torch.linalg.solve(P, J.mT)
    f, cov = la.logit_mean_cov(test, chunk_size=chunk, target_ids=ids)
    assert f.shape == (b, len(ids))
    assert cov.shape == (b, len(ids), len(ids))
    torch.testing.assert_close(f.cpu(), logits.cpu()[:, sub])
    torch.testing.assert_close(cov.cpu(), ref, rtol=1e-7, atol=1e-10)
    probs = la.predict(test, target_ids=ids)
    torch.testing.assert_close(probs.cpu(), probit(logits.cpu()[:, sub], ref))
    # without labels: the answer is read at the last real token (the prompt alone, right-padded)
    last = keep.int().argmax(1)
    prompts = {
        "input_ids": test["input_ids"],
        "attention_mask": (torch.arange(t, device=device)[None] <= last[:, None]).long(),
    }
    torch.testing.assert_close(la.predict(prompts, target_ids=ids), probs)
    draws = la.predictive_samples(test, 5, target_ids=ids, generator=torch.Generator(device))
    assert draws.shape == (5, b, len(ids))


def dense_block(la: KronLaplace, m: str) -> Tensor:
    """The dense precision block ``G ⊗ A + δ I`` of module ``m`` from its stored (maybe low-rank) factors."""
    mats = []
    for f in la._eig[m]:
        eye = torch.eye(f.U.shape[0], dtype=f.U.dtype, device=f.U.device)
        mats.append((f.U * f.s) @ f.U.T + f.rest * (eye - f.U @ f.U.T))
    k = torch.kron(*mats).cpu()
    return k + la.prior_precision[la.modules.index(m)].cpu() * torch.eye(k.shape[0]).double()


def test_answer_only_bad_input_is_named():
    model = peft_llama(0, 2)
    la = KronLaplace(model, lora_subset(model), sharing="expand")
    la.fit_curvature(random_factors(la, 0), map_loss=1.0, n_data=5, n_outputs=LM_VOCAB)
    batch = answer_batch(2, 5, 0)
    with pytest.raises(ValueError, match="target_ids: 3 is repeated"):
        la.predict(batch, target_ids=[3, 1, 3])
    with pytest.raises(ValueError, match=rf"target_ids: {LM_VOCAB} is out of range .* {LM_VOCAB}"):
        la.logit_mean_cov(batch, target_ids=[0, LM_VOCAB])
    with pytest.raises(TypeError, match="integer token ids"):
        la.predictive_samples(batch, 2, target_ids=[0.5, 1.0])


class AnswerHead(nn.Module):
    """A causal LM's logits of a few answer tokens at the last real token: ``[B, K]`` (Laplace-LoRA)."""

    def __init__(self, lm: nn.Module, answer_ids: list[int]) -> None:
        super().__init__()
        self.lm = lm
        self.register_buffer("answer_ids", torch.tensor(answer_ids))

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask).logits
        last = attention_mask.sum(1) - 1
        return logits[torch.arange(len(last), device=last.device), last][:, self.answer_ids]


@FIXTURE
@given(seed=st.integers(0, 2**10), b=st.integers(1, 3), t=st.integers(3, 6))
def test_answer_vocabulary_is_the_marginal_of_the_linearised_logits(device, seed, b, t):
    """Restricting ``N(f, J Σ Jᵀ)`` to the answer tokens is predicting through an answer-only head.

    The same curvature, moved onto an ``AnswerHead`` around the same model, predicts ``probit`` of the
    sub-block ``(f[ids], Σ_f[ids, ids])`` of the full-vocabulary posterior at the answer position.
    """
    model = peft_llama(seed, 2).to(device)
    ids = [1, 4, 7]
    la = KronLaplace(model, lora_subset(model), prior_precision=0.7, sharing="expand")
    factors = random_factors(la, seed)
    la.fit_curvature(factors, map_loss=1.0, n_data=5, n_outputs=LM_VOCAB)
    head = AnswerHead(model, ids)
    on_head = KronLaplace(head, lora_subset(head), prior_precision=0.7, sharing="expand")
    on_head.fit_curvature(
        {f"lm.{m}": v for m, v in factors.items()}, map_loss=1.0, n_data=5, n_outputs=len(ids)
    )
    batch = _on(answer_batch(b, t, seed), device)
    prompt_len = batch["labels"].ne(-100).int().argmax(1)  # the answer's position
    prompts = {  # the prompt alone: the head reads its last real token
        "input_ids": batch["input_ids"],
        "attention_mask": (torch.arange(t, device=device)[None] < prompt_len[:, None]).long(),
    }
    f, cov = la.logit_mean_cov(batch)
    sub = torch.tensor(ids, device=f.device)
    want = probit(f[:, sub], cov[:, sub][:, :, sub])
    torch.testing.assert_close(on_head.predict(prompts), want)


def test_a_head_in_training_mode_leaves_the_wrapped_model_as_it_was():
    """Fitting and predicting through a wrapper restore every module's own mode, not the wrapper's.

    ``AnswerHead(model)`` is in training mode as built, the language model inside it in eval mode; the
    curvature pass and the predictive used to restore with ``head.train(True)``, which switched the whole
    language model (its dropout included) to training mode.
    """
    model = peft_llama(0, 2)
    head = AnswerHead(model, [1, 4, 7])
    assert head.training
    assert not model.training
    modes = {n: m.training for n, m in head.named_modules()}
    batch = answer_batch(3, 5, 0)
    prompts = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": torch.tensor([0, 2, 1]),
    }
    with pytest.warns(UserWarning, match="training mode"):
        la = KronLaplace(head, lora_subset(head), sharing="expand").fit([prompts])
    assert {n: m.training for n, m in head.named_modules()} == modes
    la.predict(prompts)
    la.logit_mean_cov(prompts)
    assert {n: m.training for n, m in head.named_modules()} == modes


# ----------------------------------------------------------------------------- end to end
WORDS = [f"w{i}" for i in range(LM_VOCAB - 1)]


def tokenizer():
    """A word-level tokenizer over ``LM_VOCAB`` tokens (``[PAD]`` = 0), as a Hugging Face fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[PAD]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]")


def features(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Prompts of 2-4 tokens; the answer (one of three tokens) is a function of the last prompt token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(
            1, LM_VOCAB, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g
        )
        answer = 1 + int(prompt[-1]) % 3
        ids = [*prompt.tolist(), answer]
        out.append(
            {
                "input_ids": ids,
                "attention_mask": [1] * len(ids),
                "labels": [-100] * len(prompt) + [answer],
            }
        )
    return out


@pytest.fixture(scope="module")
def fine_tuned():
    """A LoRA fine-tuned tiny Llama (30 AdamW steps on the adapters) and collator-built loaders."""
    base = llama_lm(0, layers=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a random base with features rich enough to learn from
        for p in base.parameters():
            p.normal_(0.0, 0.3, generator=g)
    torch.manual_seed(0)
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"]
        ),
    ).double()
    collator = transformers.DataCollatorForSeq2Seq(tokenizer(), padding=True)
    train = features(24, 0)
    loader = torch.utils.data.DataLoader(train, batch_size=8, collate_fn=collator)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    for _ in range(10):
        for batch in loader:
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
    model.eval()
    assert loss_of(model, loader) < 0.5 * math.log(3) * 24  # it learned the answers
    return model, loader, collator(features(6, 1))


def loss_of(model: nn.Module, loader) -> float:
    with torch.no_grad():
        return sum(float(model(**b).loss) * int(b["labels"].ne(-100).sum()) for b in loader)


def test_fit_and_predict_the_answer_token(fine_tuned, tmp_path):
    """Fit, prior by gradient marginal likelihood, predict, save / load, the protocol; and S-KFAC inside."""
    model, loader, test = fine_tuned
    la = KronLaplace(model, lora_subset(model), sharing="expand").fit(loader)
    assert la.shift_labels  # a PeftModelForCausalLM is a causal LM
    assert la.n_data == 24  # one scored answer per prompt
    result = la.maximize_evidence()
    assert result.converged
    assert math.isfinite(result.log_marginal_likelihood)
    probs = la.predict(test)
    assert probs.shape == (*test["input_ids"].shape, LM_VOCAB)
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2], dtype=probs.dtype))
    keep = kept(dict(test), True)
    map_probs = torch.softmax(model(**inputs(dict(test))).logits.detach(), -1)
    assert not torch.allclose(probs[keep], map_probs[keep], atol=1e-4)  # the posterior widens them
    padding = test["attention_mask"] == 0
    torch.testing.assert_close(probs[padding], map_probs[padding])
    la.save(tmp_path / "lora.safetensors")
    again = KronLaplace.load(tmp_path / "lora.safetensors", model)
    assert torch.equal(again.predict(test), probs)
    assert isinstance(la, Posterior)
    check_posterior(la, test, tmp_path / "check.safetensors")
    # S-KFAC inside the adapters: a quarter of every factor's rows and columns
    inside = sparse_kfac(model, 50, modules=lora_modules(model))
    sk = KronLaplace(model, inside, sharing="expand").fit(loader)
    sk.optimize_prior_precision("marglik")
    assert sk.num_floats < la.num_floats
    sk_probs = sk.predict(test)
    torch.testing.assert_close(sk_probs.sum(-1), torch.ones(probs.shape[:2], dtype=probs.dtype))
    assert not torch.allclose(sk_probs[keep], map_probs[keep], atol=1e-4)
    check_posterior(sk, test, tmp_path / "check-skfac.safetensors")
