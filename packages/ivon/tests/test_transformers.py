import pytest
import torch

from partialbayes.ivon import IVON, ivon_posterior

pytest.importorskip("transformers")

from tiny_models import tiny_model


def test_tiny_gpt2_trains(device):
    model = tiny_model("gpt2", "causal-lm", seed=0, size="s").to(device)
    ids = torch.randint(50, (4, 12), generator=torch.Generator().manual_seed(1)).to(device)

    def mean_loss():
        with torch.no_grad():
            return model(input_ids=ids, labels=ids).loss.item()

    opt = IVON(model.parameters(), lr=0.2, ess=1e4, hess_init=0.1, mc_samples=2,
               generator=torch.Generator(device).manual_seed(0))  # fmt: skip

    def closure():
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    before = mean_loss()
    for _ in range(10):
        loss = opt.step(closure)
        assert torch.isfinite(loss)
    after = mean_loss()
    assert after < before - 0.3, (before, after)
    # tied embeddings (lm_head.weight is wte.weight) are one parameter with one state
    assert model.lm_head.weight is model.transformer.wte.weight
    post = ivon_posterior(opt, model)
    batch = {"input_ids": ids, "labels": ids}  # a causal-LM batch: labels are ignored by predict
    logits = post.predictive_samples(batch, 2, generator=torch.Generator(device).manual_seed(0))
    assert logits.shape == (2, 4, 12, 50)
    assert torch.isfinite(logits).all()
    probs = post.predict(batch, n_samples=2, generator=torch.Generator(device).manual_seed(0))
    torch.testing.assert_close(probs, logits.softmax(-1).mean(0))
