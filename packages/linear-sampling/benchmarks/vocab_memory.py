"""SampledLaplace at a real vocabulary: peak process memory of fit and predict (issue #23).

A GPT-2-shaped causal LM built in code (vocabulary 50,257, 2 layers of width 256, 4 heads, untied head,
random weights: memory and speed do not depend on the values), LoRA r=8 on ``c_attn``, ``c_proj`` and
``c_fc`` (peft), 8 answer-only sequences of 64 tokens (labels -100 except one answer token per sequence).
Fits a `SampledLaplace` on the LoRA subset and predicts (``--answers``: 5 answer tokens, ``target_ids``), in
this process, and prints the peak resident memory (``VmHWM`` of ``/proc/self/status``) after each step. Run it in a fresh process::

    python packages/linear-sampling/benchmarks/vocab_memory.py --n-samples 32 --max-iter 3

The memory of a fit does not depend on the number of solver iterations (each repeats the same operator
calls), so a few iterations measure it; the solver then warns that it stopped early.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # tiny_models, at the repository root
from tiny_models import answer_batches, lora_gpt2, peak_gib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--n-samples", type=int, default=32)
    parser.add_argument("--max-iter", type=int, default=3)
    parser.add_argument("--method", default="cg", choices=["cg", "sgd"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--answers", action="store_true", help="predict 5 answer tokens only (target_ids)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from partialbayes.linear_sampling import SampledLaplace, SGDConfig
    from partialbayes.selection import lora_subset

    model, batches = lora_gpt2(), answer_batches(2, 4, 64, span=24)
    subset = lora_subset(model)
    with torch.no_grad():
        model(input_ids=batches[0]["input_ids"])
    print(f"model and one forward: d={subset.num_entries()}, peak {peak_gib():.2f} GiB", flush=True)

    post = SampledLaplace(model, subset, prior_precision=1.0)
    sgd = SGDConfig(max_epochs=args.max_iter) if args.method == "sgd" else None
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the solver stops early on purpose
        post.fit(
            batches,
            n_samples=args.n_samples,
            method=args.method,
            max_iter=args.max_iter if args.method == "cg" else None,
            sgd=sgd,
            generator=torch.Generator().manual_seed(0),
        )
    fit_s = time.perf_counter() - start
    print(f"fit ({post.info.steps} steps): {fit_s:.1f} s, peak {peak_gib():.2f} GiB", flush=True)
    start = time.perf_counter()
    probs = post.predict(batches[0], target_ids=[262, 290, 286, 257, 284] if args.answers else None)
    predict_s = time.perf_counter() - start
    assert bool(torch.isfinite(probs).all())
    print(f"predict {tuple(probs.shape)}: {predict_s:.1f} s, peak {peak_gib():.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
