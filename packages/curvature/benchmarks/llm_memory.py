"""Laplace-LoRA at a real vocabulary: peak process memory of a Kronecker fit and its answer-only predictive.

The model of issue #23: a GPT-2-shaped causal LM built in code (vocabulary 50,257, 2 layers of width 256,
4 heads, untied head; random weights: memory does not depend on the values), LoRA r=8 on ``c_attn``,
``c_proj`` and ``c_fc`` (peft), 8 answer-only sequences of 64 tokens in two batches (labels -100 except one
answer token per sequence). One case per fresh process (the peak resident memory, ``VmHWM`` of
``/proc/self/status``, is then this case's alone)::

    python packages/curvature/benchmarks/llm_memory.py --case mc

Cases: ``mc`` / ``empirical`` (the LoRA subset: fit, then the predictive of 5 answer tokens); ``exact``
(the default fisher: refused at the first batch); ``head-low-rank`` (LoRA and the 50,257 × 256 LM head,
``max_rank=64``); ``head`` (the same without ``max_rank``, ``max_memory`` 6 GiB: refused before allocating).
Each prints ``<step>: <seconds> s, peak <GiB> GiB``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tiny_models, at the repository root
from tiny_models import answer_batches, lora_gpt2, peak_gib

ANSWERS = [262, 290, 286, 257, 284]  # five token ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--case", required=True, choices=["mc", "empirical", "exact", "head-low-rank", "head"]
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from partialbayes.curvature import KronLaplace
    from partialbayes.selection import lora_subset, modules

    model, batches = lora_gpt2(), answer_batches(2, 4, 64, span=24)
    subset = lora_subset(model)
    options: dict = {"fisher": "mc" if args.case.startswith("head") else args.case}
    if args.case.startswith("head"):
        subset = subset | modules(model, ["base_model.model.lm_head"])
        if args.case == "head-low-rank":
            options["max_rank"] = 64
        else:
            options["max_memory"] = 6 * 2**30
    with torch.no_grad():
        model(input_ids=batches[0]["input_ids"])
    print(
        f"model and one forward: {subset.num_entries()} weights, peak {peak_gib():.2f} GiB",
        flush=True,
    )
    start = time.perf_counter()
    la = KronLaplace(model, subset, sharing="expand", dtype=torch.float32, **options)
    try:
        la.fit(batches, generator=torch.Generator().manual_seed(0))
    except ValueError as err:
        print(
            f"refused: {time.perf_counter() - start:.1f} s, peak {peak_gib():.2f} GiB", flush=True
        )
        print(str(err).splitlines()[0])
        return
    print(f"fit: {time.perf_counter() - start:.1f} s, peak {peak_gib():.2f} GiB", flush=True)
    start = time.perf_counter()
    probs = la.predict(batches[0], target_ids=ANSWERS)
    assert probs.shape == (4, len(ANSWERS))
    assert bool(torch.isfinite(probs).all())
    print(
        f"predict {tuple(probs.shape)}: {time.perf_counter() - start:.1f} s, peak {peak_gib():.2f} GiB"
    )


if __name__ == "__main__":
    main()
