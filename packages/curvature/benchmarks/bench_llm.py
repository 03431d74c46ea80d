"""Laplace-LoRA at a real LLM's size (issue #23): a GPT-2-small-shaped model with GPT-2's vocabulary.

Random weights (the hub is unreachable; sizes, not values, decide time and memory): GPT-2 small (12 layers,
width 768, 124M parameters, vocabulary 50,257), PEFT LoRA r=8 on every attention and MLP map (``c_attn``,
``c_proj``, ``c_fc``), batches of 4 sequences of 128 tokens whose last token is the scored answer (prompt
labelled -100). Rows, one run, ratios only between rows of this run:

* one forward pass and one training step (forward + backward of the LM loss into the adapters): the
  references for time and for peak memory (memory added above the loaded model);
* the KFAC factors of the adapters (``kfac``, ``fisher="mc"`` and ``"empirical"``, ``sharing="expand"``,
  float32) — the curvature pass of a fit; the full Laplace fit and the answer-only predictive are added
  when the pieces of issue #23 are wired into ``KronLaplace``;
* `memory_estimate` of that fit beside its measured peak;
* bayesian-lora (PyPI ``bayesian-lora``, the Laplace-LoRA authors' library): ``calculate_kronecker_factors``
  (last-token logits over the vocabulary, one sampled label, low-rank factors above 512 at rank 10) and
  ``model_evidence``, on the same model and batches, when it is installed;
* the model of the issue's report (2 layers of width 256, an untied 50,257-token head, 8 answer-only
  sequences of 64 tokens): the ``mc`` fit's peak memory, which used to exceed 8 GB (``torch.eye(C)``).
"""

from __future__ import annotations

import torch
from benchharness import Bench
from torch import nn

from partialbayes.curvature import kfac, memory_estimate
from partialbayes.selection import lora_subset

VOCAB = 50257


def _gpt2(b: Bench, *, layers: int, width: int, tied: bool = True) -> nn.Module:
    import peft
    from transformers import GPT2Config, GPT2LMHeadModel

    if b.quick:
        layers, width = 2, 32
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_layer=layers,
        n_embd=width,
        n_head=max(1, width // 64),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    return peft.get_peft_model(GPT2LMHeadModel(cfg), lora).to(b.device).eval()


def _batches(b: Bench, n_batches: int, batch: int, length: int) -> list[dict[str, torch.Tensor]]:
    """Full-length random sequences whose last token is the answer (labels -100 elsewhere)."""
    if b.quick:
        n_batches, batch, length = 1, 2, 16
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(0, VOCAB, (batch, length), generator=g)
        labels = torch.full_like(ids, -100)
        labels[:, -1] = ids[:, -1]
        batch_ = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        out.append({k: v.to(b.device) for k, v in batch_.items()})
    return out


def _step(model: nn.Module, loader) -> None:
    for batch in loader:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)


def _forward(model: nn.Module, loader) -> None:
    with torch.no_grad():
        for batch in loader:
            model(**{k: v for k, v in batch.items() if k != "labels"})


def bench_gpt2_small_lora(b: Bench) -> None:
    group = "Laplace-LoRA, GPT-2 small shape, LoRA r=8" + (" (quick: tiny)" if b.quick else "")
    model = _gpt2(b, layers=12, width=768)
    loader = _batches(b, 1, 4, 128)
    subset = lora_subset(model)
    rep = 2 if b.quick else 3
    b.time("forward", lambda: _forward(model, loader), group=group, repeat=rep)
    b.time(
        "training step (forward+backward)", lambda: _step(model, loader), group=group, repeat=rep
    )
    for fisher in ("mc", "empirical"):
        b.time(
            f"KFAC factors, fisher={fisher}, expand",
            lambda fisher=fisher: kfac(
                model,
                loader,
                subset,
                fisher=fisher,
                sharing="expand",
                dtype=torch.float32,
                generator=torch.Generator(b.device).manual_seed(0),
            ),
            group=group,
            reference="training step (forward+backward)",
            repeat=rep,
        )
    est = memory_estimate(
        model,
        subset,
        loader[0],
        fisher="mc",
        sharing="expand",
        dtype=torch.float32,
        target_ids=list(range(5)),
    )
    print(est)
    b.metric("memory_estimate, 5 answer ids: peak", est.total / 2**20, unit="MB", group=group)
    _bayesian_lora(b, group, model, loader)


def _bayesian_lora(b: Bench, group: str, model: nn.Module, loader) -> None:
    name = "bayesian-lora calculate_kronecker_factors + model_evidence"
    if not b.has("bayesian_lora"):
        b.skip(name, group=group, reason="bayesian-lora not installed (pip install bayesian-lora)")
        return
    from bayesian_lora import calculate_kronecker_factors, model_evidence
    from bayesian_lora.main import cholesky_decompose_small_factors

    def forward_call(m: nn.Module, batch) -> torch.Tensor:  # the answer's next-token logits
        return m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, -2]

    def fit() -> None:
        factors = calculate_kronecker_factors(
            model,
            forward_call,
            loader,
            n_kfac=10,
            lr_threshold=512,
            target_module_keywords=["lora"],
        )
        factors = cholesky_decompose_small_factors(factors, 512, str(b.device), torch.float32)
        with torch.no_grad():
            ll = -sum(float(model(**batch).loss) for batch in loader)
        model_evidence(model, torch.tensor(ll), factors, 8, 10, torch.tensor(0.1))
        model.eval()  # calculate_kronecker_factors leaves the model in training mode

    try:
        b.time(name, fit, group=group, reference="training step (forward+backward)", repeat=2)
    except Exception as err:  # a peer's failure is a finding, not a crash of the run
        b.skip(name, group=group, reason=f"failed: {type(err).__name__}: {err}"[:200])


def bench_issue_model_memory(b: Bench) -> None:
    """The issue's report: the mc fit of a 2-layer GPT-2 with an untied 50k head, 8 × 64 tokens."""
    group = "Issue #23 model (2 layers, width 256, untied 50,257 head)" + (
        " (quick: tiny)" if b.quick else ""
    )
    model = _gpt2(b, layers=2, width=256, tied=False)
    loader = _batches(b, 2, 4, 64)
    subset = lora_subset(model)
    b.time("training step (forward+backward)", lambda: _step(model, loader), group=group, repeat=2)
    b.time(
        "KFAC factors, fisher=mc, expand",
        lambda: kfac(
            model,
            loader,
            subset,
            fisher="mc",
            sharing="expand",
            generator=torch.Generator(b.device).manual_seed(0),
        ),
        group=group,
        reference="training step (forward+backward)",
        repeat=2,
    )
    est = memory_estimate(
        model, subset, loader[0], fisher="mc", sharing="expand", target_ids=list(range(5))
    )
    print(est)
    b.metric("memory_estimate, 5 answer ids: peak", est.total / 2**20, unit="MB", group=group)
