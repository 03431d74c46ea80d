"""`PosteriorModel` through a real ``transformers.Trainer`` run, for every posterior family (issue #25).

``Trainer.predict(PosteriorModel(posterior))`` must give exactly what ``posterior.predict`` gives batch by
batch (Laplace, SWAG, IVON, SampledLaplace; Monte Carlo families with a seeded generator consumed in the
same order), and ``Trainer.evaluate`` the mean predictive NLL. The families are dev dependencies of the
workspace, so this test lives here rather than in ``packages/predictive/tests``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from partialbayes.curvature import KronLaplace
from partialbayes.ivon import GaussianPosterior
from partialbayes.linear_sampling import SampledLaplace
from partialbayes.predictive import PosteriorModel, nll
from partialbayes.selection import KronBlock, Subset
from partialbayes.swag import collect_swag

transformers = pytest.importorskip("transformers")

from tiny_models import tiny_model  # noqa: E402

N_EXAMPLES, BATCH, LENGTH = 10, 4, 6  # three evaluation batches, the last one short


def examples(head: str, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(N_EXAMPLES):
        mask = torch.ones(LENGTH, dtype=torch.long)
        mask[LENGTH - 1 - i % 3 :] = 0  # some padding
        labels = (
            torch.randint(0, 3, (LENGTH,), generator=g).masked_fill(mask == 0, -100)
            if head == "token"
            else torch.randint(0, 3, (), generator=g)
        )
        ids = torch.randint(1, 30, (LENGTH,), generator=g)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def batches(data: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [
        transformers.default_data_collator(data[i : i + BATCH]) for i in range(0, len(data), BATCH)
    ]


def posterior(family: str, model, data, head: str):
    subset = Subset.from_model(
        model,
        {
            "bert.encoder.layer.0.output.dense.weight": KronBlock(rows=torch.tensor([0, 3, 5])),
            "classifier.weight": KronBlock(),
        },
    )
    if family == "laplace":
        sharing = "expand" if head == "token" else "reduce"
        return KronLaplace(model, subset, sharing=sharing).fit(data), {}
    if family == "swag":
        swag = collect_swag(model, subset, data, lr=0.05, n_steps=8, snapshot_every=2, max_rank=3,
                            progress=False)  # fmt: skip
        return swag, {"n_samples": 5}
    if family == "ivon":
        mean = {n: p.detach().clone() for n, p in model.named_parameters() if n in subset.names}
        std = {n: 0.05 * torch.ones_like(m) for n, m in mean.items()}
        return GaussianPosterior(mean, std, model), {"n_samples": 5}
    la = SampledLaplace(model, subset, prior_precision=1.0).fit(
        data, n_samples=8, generator=torch.Generator().manual_seed(0)
    )
    return la, {"n_samples": 5}


@pytest.mark.parametrize("head", ["sequence", "token"])
@pytest.mark.parametrize("family", ["laplace", "swag", "ivon", "sampled-laplace"])
def test_trainer_predict_equals_posterior_predict(tmp_path, family, head):
    model = tiny_model("bert", head, seed=0, num_labels=3).eval()
    data = examples(head)
    post, kwargs = posterior(family, model, batches(data), head)
    wrapped = PosteriorModel(post, generator=torch.Generator().manual_seed(1), **kwargs)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=BATCH, report_to=[], use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=wrapped, args=args, data_collator=transformers.default_data_collator
    )
    out = trainer.predict(data)
    g = torch.Generator().manual_seed(1)
    probs = [post.predict(b, generator=g, **kwargs) for b in batches(data)]
    logp = out.predictions
    if head == "token":
        expected = np.concatenate(
            [p.clamp_min(torch.finfo(p.dtype).tiny).log().numpy() for p in probs]
        )
    else:
        expected = torch.cat(probs).clamp_min(torch.finfo(probs[0].dtype).tiny).log().numpy()
    np.testing.assert_allclose(logp, expected, rtol=1e-6, atol=1e-7)
    # Trainer reports each batch's predictive NLL (labels -100 left out) averaged over the examples
    per_batch, sizes = [], []
    for p, b in zip(probs, batches(data), strict=True):
        keep = b["labels"] != -100
        per_batch.append(float(nll(p[keep], b["labels"][keep])))
        sizes.append(len(b["labels"]))
    assert out.metrics["test_loss"] == pytest.approx(np.average(per_batch, weights=sizes), rel=1e-6)


def test_evaluate_with_compute_metrics_and_a_regression_posterior(tmp_path):
    model = tiny_model("bert", seed=0, num_labels=3).eval()
    data = examples("sequence")
    swag, _ = posterior("swag", model, batches(data), "sequence")
    seen = []

    def compute_metrics(pred):
        probs = torch.softmax(torch.as_tensor(pred.predictions), -1)
        seen.append(probs)
        return {
            "accuracy": float((probs.argmax(-1) == torch.as_tensor(pred.label_ids)).double().mean())
        }

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=BATCH, report_to=[], use_cpu=True,
        disable_tqdm=True,
    )  # fmt: skip
    wrapped = PosteriorModel(swag, n_samples=4, generator=torch.Generator().manual_seed(2))
    trainer = transformers.Trainer(model=wrapped, args=args, compute_metrics=compute_metrics)
    metrics = trainer.evaluate(data)
    g = torch.Generator().manual_seed(2)
    probs = torch.cat([swag.predict(b, n_samples=4, generator=g) for b in batches(data)])
    torch.testing.assert_close(seen[0], probs, rtol=1e-5, atol=1e-6)
    labels = torch.stack([e["labels"] for e in data])
    assert metrics["eval_accuracy"] == pytest.approx(
        float((probs.argmax(-1) == labels).double().mean())
    )
    # regression: Trainer.predict returns (mean, variance)
    reg = tiny_model("bert", seed=1, num_labels=1).eval()
    targets = [{**e, "labels": torch.tensor(float(e["labels"]))} for e in data]
    subset = Subset.from_model(
        reg, {"classifier.weight": KronBlock(), "classifier.bias": KronBlock()}
    )
    swag = collect_swag(reg, subset, batches(targets), lr=0.05, n_steps=6, snapshot_every=2,
                        max_rank=2, likelihood="regression", sigma_noise=0.5, progress=False)  # fmt: skip
    wrapped = PosteriorModel(swag, n_samples=3, generator=torch.Generator().manual_seed(3))
    out = transformers.Trainer(model=wrapped, args=args).predict(targets)
    mean, var = out.predictions
    g = torch.Generator().manual_seed(3)
    ref = [swag.predict(b, n_samples=3, generator=g) for b in batches(targets)]
    np.testing.assert_allclose(mean, torch.cat([m for m, _ in ref]).numpy(), rtol=1e-6)
    np.testing.assert_allclose(var, torch.cat([v for _, v in ref]).numpy(), rtol=1e-6)
    assert np.all(var >= 0.25 - 1e-7)  # σ² = 0.25 included


def test_a_text_classification_pipeline_scores_the_predictive(tmp_path):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(25)]
    (tmp_path / "vocab.txt").write_text("\n".join(words))
    tokenizer = transformers.BertTokenizer(str(tmp_path / "vocab.txt"))
    model = tiny_model("bert", seed=0, num_labels=3).eval()
    swag, _ = posterior("swag", model, batches(examples("sequence")), "sequence")
    wrapped = PosteriorModel(swag, n_samples=4, generator=torch.Generator().manual_seed(4))
    pipe = transformers.pipeline("text-classification", model=wrapped, tokenizer=tokenizer)
    texts = ["w1 w2 w3", "w4 w5"]
    scores = pipe(texts, top_k=None)
    g = torch.Generator().manual_seed(4)
    for text, got in zip(texts, scores, strict=True):
        probs = swag.predict(dict(tokenizer(text, return_tensors="pt")), n_samples=4, generator=g)[
            0
        ]
        by_label = {d["label"]: d["score"] for d in got}
        for c in range(3):
            assert by_label[f"LABEL_{c}"] == pytest.approx(float(probs[c]), rel=1e-5)
