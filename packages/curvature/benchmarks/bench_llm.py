"""Laplace-LoRA at a real LLM's size (issue #23): a GPT-2-small-shaped model with GPT-2's vocabulary.

Random weights (the hub is unreachable; sizes, not values, decide time and memory): GPT-2 small (12 layers,
width 768, 124M parameters, vocabulary 50,257, tied head), PEFT LoRA r=8 on every attention and MLP map
(``c_attn``, ``c_proj``, ``c_fc``), batches of 4 sequences of 128 tokens whose last token is the scored
answer (prompt labelled -100). Rows, one run, ratios only between rows of this run:

* one forward pass and one training step (forward + backward of the LM loss into the adapters), over the
  same batches as the fit: the references for time and for peak memory (memory added above the loaded
  model);
* `KronLaplace` fits (``fisher="mc"`` and ``"empirical"``, ``sharing="expand"``, float32, factor sides above
  ``max_rank=64`` sketched): the pass over the loader, the factors' eigendecompositions (or sketches) and
  the training loss; the ratio to the training step over the same batches is the per-batch ratio;
* the answer-only predictive of 5 answer tokens at the answer position (``predict(batch, target_ids=...)``),
  as a ratio to one forward pass of the batch;
* bayesian-lora (PyPI ``bayesian-lora``, the Laplace-LoRA authors' library): ``calculate_kronecker_factors``
  (last-token logits over the vocabulary, one sampled label, low-rank factors above 512 at rank 10) and
  ``model_evidence`` on the same model and batches, when it is installed (``PYTHONPATH`` to a side folder:
  it is not locked). Its predictive (``jacobian_mean`` + ``variance``) is not run: on this model and batch
  it grew past 19 GB and was killed by the kernel;
* the model of the issue's report (2 layers of width 256, an untied 50,257-token head, 8 answer-only
  sequences of 64 tokens): peak resident memory of a fit and its answer-only predictive, each case in a
  fresh process (``llm_memory.py``; ``vocab_memory.py`` of linear-sampling for `SampledLaplace`).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
from benchharness import Bench

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tiny_models, at the repository root
from torch import nn

from partialbayes.curvature import KronLaplace, memory_estimate
from partialbayes.selection import lora_subset
from tiny_models import answer_batches, lora_gpt2


def _gpt2(b: Bench, *, layers: int, width: int, tied: bool = True) -> nn.Module:
    return lora_gpt2(*((2, 32) if b.quick else (layers, width)), tied=tied).to(b.device)


def _batches(b: Bench, n_batches: int, batch: int, length: int) -> list[dict[str, torch.Tensor]]:
    """Full-length random sequences whose last token is the answer (labels -100 elsewhere)."""
    if b.quick:
        n_batches, batch, length = 1, 2, 16
    return [
        {k: v.to(b.device) for k, v in x.items()} for x in answer_batches(n_batches, batch, length)
    ]


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
    loader = _batches(b, 2, 4, 128)
    subset = lora_subset(model)
    rep = 2 if b.quick else 3
    step = f"training step (forward+backward), {len(loader)} batches"
    b.time("forward, 1 batch", lambda: _forward(model, loader[:1]), group=group, repeat=rep)
    b.time(step, lambda: _step(model, loader), group=group, repeat=rep)
    posterior = None
    for fisher in ("mc", "empirical"):

        def fit(fisher: str = fisher) -> None:
            nonlocal posterior
            posterior = KronLaplace(
                model, subset, fisher=fisher, sharing="expand", dtype=torch.float32, max_rank=64
            ).fit(loader, generator=torch.Generator(b.device).manual_seed(0))

        b.time(
            f"KronLaplace fit, fisher={fisher}, max_rank=64",
            fit,
            group=group,
            reference=step,
            repeat=rep,
        )
    assert posterior is not None
    la = posterior
    b.time(  # whole factors: the eigendecompositions of the 768 / 2304 / 3072 sides dominate
        "KronLaplace fit, fisher=mc, whole factors",
        lambda: KronLaplace(model, subset, fisher="mc", sharing="expand", dtype=torch.float32).fit(
            loader, generator=torch.Generator(b.device).manual_seed(0)
        ),
        group=group,
        reference=step,
        repeat=1,
        warmup=0,
    )
    b.time(
        "answer-only predict, 5 answer ids",
        lambda: la.predict(loader[0], target_ids=ANSWERS),
        group=group,
        reference="forward, 1 batch",
        repeat=rep,
    )
    est = memory_estimate(
        model,
        subset,
        loader[0],
        fisher="mc",
        sharing="expand",
        dtype=torch.float32,
        max_rank=64,
        target_ids=ANSWERS,
    )
    print(est)
    b.metric(
        "memory_estimate of the fit and predict: peak", est.total / 2**20, unit="MB", group=group
    )
    _bayesian_lora(b, group, model, loader, step)


ANSWERS = [262, 290, 286, 257, 284]


def _bayesian_lora(b: Bench, group: str, model: nn.Module, loader, step: str) -> None:
    name = "bayesian-lora calculate_kronecker_factors + model_evidence"
    if not b.has("bayesian_lora"):
        b.skip(name, group=group, reason="bayesian-lora not installed (pip install bayesian-lora)")
        return
    from bayesian_lora import calculate_kronecker_factors, model_evidence
    from bayesian_lora.main import cholesky_decompose_small_factors

    def forward_call(m: nn.Module, batch) -> torch.Tensor:  # the answer's next-token logits
        return m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, -2]

    factors = {}
    big = 16 if b.quick else 512  # factors above this are low-rank (rank 10)

    def fit() -> None:
        found = calculate_kronecker_factors(
            model,
            forward_call,
            loader,
            n_kfac=10,
            lr_threshold=big,
            target_module_keywords=["lora"],
        )
        factors.update(cholesky_decompose_small_factors(found, big, str(b.device), torch.float32))
        with torch.no_grad():
            ll = -sum(float(model(**batch).loss) for batch in loader)
        model_evidence(model, torch.tensor(ll), factors, 8, 10, torch.tensor(0.1))
        model.eval()  # calculate_kronecker_factors leaves the model in training mode

    try:
        b.time(name, fit, group=group, reference=step, repeat=2)
    except Exception as err:  # a peer's failure is a finding, not a crash of the run
        b.skip(name, group=group, reason=f"failed: {type(err).__name__}: {err}"[:200])
        model.eval()
    # Not run: bayesian-lora's predictive (jacobian_mean: torch.func.jacrev over the LoRA weights, then
    # variance) of the same 5 answer logits grew past 19 GB of resident memory on this model and batch and
    # was killed by the kernel (2026-11-26, a 24 GB machine); it would take the machine down with it.


#: The issue's model: each case's peak resident memory, in a fresh process.
CASES = {
    "KronLaplace fisher=mc: fit + predict 5 answer ids": ("llm_memory.py", ["--case", "mc"]),
    "KronLaplace fisher=empirical: fit + predict 5 answer ids": (
        "llm_memory.py",
        ["--case", "empirical"],
    ),
    "KronLaplace fisher=exact (the default): refused": ("llm_memory.py", ["--case", "exact"]),
    "KronLaplace with the LM head, max_rank=64: fit + predict": (
        "llm_memory.py",
        ["--case", "head-low-rank"],
    ),
    "KronLaplace with the LM head, whole factors, max_memory 6 GiB: refused": (
        "llm_memory.py",
        ["--case", "head"],
    ),
    "SampledLaplace (k=8, CG 1 step): fit + predict 5 answer ids": (
        "vocab_memory.py",
        ["--n-samples", "8", "--max-iter", "1", "--answers"],
    ),
}


def bench_issue_model_memory(b: Bench) -> None:
    """The issue's report, in fresh processes: peak RSS of each case (the 3 GB and 6 GB targets)."""
    group = "Issue #23 model (2 layers, width 256, untied 50,257 head), peak RSS in a fresh process"
    if b.quick:
        b.skip("every case", group=group, reason="full-size only (a fresh process per case)")
        return
    root = Path(__file__).parents[2]
    scripts = {
        "llm_memory.py": root / "curvature" / "benchmarks",
        "vocab_memory.py": root / "linear-sampling" / "benchmarks",
    }
    for name, (script, args) in CASES.items():
        out = subprocess.run(
            [
                sys.executable,
                str(scripts[script] / script),
                *args,
                "--threads",
                str(torch.get_num_threads()),
            ],
            capture_output=True,
            text=True,
            timeout=3000,
        )
        peaks = re.findall(r"(\S+): ([\d.]+) s, peak ([\d.]+) GiB", out.stdout)
        if out.returncode or not peaks:
            b.skip(name, group=group, reason=f"failed: {(out.stderr or out.stdout)[-200:]}")
            continue
        seconds = ", ".join(f"{step} {float(t):.0f} s" for step, t, _ in peaks)
        b.metric(name, float(peaks[-1][2]), unit="GiB", group=group, note=seconds)
