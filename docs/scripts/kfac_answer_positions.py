"""KFAC of LoRA adapters when only an answer token is scored: which positions count, against the dense GGN.

Measures the numbers quoted on the curvature concept page (section "Token-level outputs"): on a tiny
2-layer Llama with LoRA on q/k/v/o/down (float64, 6 seeds, batches of 4 prompts + one answer token each),
the trace ratio tr(G ⊗ A) / tr(GGN block) and the relative Frobenius error of every adapter's Kronecker
block, counting as a module's examples (a) the kept output positions only (the rule before the fix) and
(b) the real positions whose output gradient is not zero (the rule ``kfac`` uses now).

Run from the repository root: ``uv run --frozen python docs/scripts/kfac_answer_positions.py``.
It reuses the dense references of the curvature test suite (``packages/curvature/tests``).
"""

from __future__ import annotations

import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "curvature" / "tests"))
from _token_refs import ggn, kept, output_jacobian
from test_lora_causal_lm import answer_batch, peft_llama, reference_factors

from partialbayes.selection import lora_modules, lora_subset

warnings.filterwarnings("ignore", category=FutureWarning)
torch.set_num_threads(1)


def main() -> None:
    results: dict[str, list[tuple[str, float, float]]] = {
        "kept positions": [],
        "carrying gradient": [],
    }
    for seed in range(6):
        model = peft_llama(seed, 2)
        batch = answer_batch(4, 6, seed)
        subset = lora_subset(model)
        mods = list(lora_modules(model))
        keep = kept(batch, True)
        logits, J = output_jacobian(model, batch, keep, subset)
        H = ggn(J, logits)
        new = reference_factors(model, batch, mods, "exact")
        old = reference_factors(model, batch, mods, "exact", positions=keep)
        start = 0
        for name in subset.names:
            k = subset.num_entries(name)
            block = H[start : start + k, start : start + k]
            start += k
            m = name.removesuffix(".weight")
            for rule, ref in (("kept positions", old), ("carrying gradient", new)):
                G, A, _ = ref[m]
                kron = torch.kron(G, A)
                ratio = float(torch.trace(kron) / torch.trace(block))
                err = float(torch.linalg.norm(kron - block) / torch.linalg.norm(block))
                results[rule].append((m, ratio, err))
    for rule, rows in results.items():
        for label, is_kv in (("k/v adapters", True), ("other adapters", False)):
            sel = [(r, e) for m, r, e in rows if (".k_proj." in m or ".v_proj." in m) == is_kv]
            ratios = [r for r, _ in sel]
            q = statistics.quantiles(ratios, n=4)
            print(
                f"{rule:18s} {label:15s} trace ratio median {statistics.median(ratios):.2f} "
                f"(quartiles {q[0]:.2f}-{q[2]:.2f}), relative error median "
                f"{statistics.median(e for _, e in sel):.2f}  ({len(sel)} blocks)"
            )


if __name__ == "__main__":
    main()
