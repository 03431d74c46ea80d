"""Full-network linearised Laplace for a small transformer, with sample-then-optimise and EM.

Run: ``uv run --frozen python packages/linear-sampling/examples/linearised_laplace_transformer.py``.
Every weight except the token and position embeddings is stochastic (~5k parameters of a tiny DistilBERT).
"""

import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from partialbayes.linear_sampling import (
    Prior,
    SGDConfig,
    fit_prior_precision,
    linearised_logit_samples,
    linearised_targets,
    network_features,
    network_logits,
    network_parameters,
    posterior_samples,
    softmax_hessian,
)

torch.manual_seed(0)

# 1. A tiny classifier and a toy task: is token 7 in the sentence?
config = DistilBertConfig(
    vocab_size=50,
    dim=16,
    n_layers=2,
    n_heads=2,
    hidden_dim=32,
    max_position_embeddings=32,
    num_labels=2,
)
model = DistilBertForSequenceClassification(config)


def make(n: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Token sequences (n of them) and whether token 7 occurs in each."""
    ids = torch.randint(8, 50, (n, 8))
    has = torch.rand(n) < 0.5
    ids[has, torch.randint(1, 8, (int(has.sum()),))] = 7
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, has.long()


train, y_train = make(96)
test, y_test = make(8)

# 2. The MAP: summed cross-entropy plus the Gaussian prior's α/2 ‖θ‖² on the stochastic weights.
params = [n for n, _ in model.named_parameters() if "embeddings" not in n]
alpha = 1.0
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(150):
    out = model(**train)
    loss = torch.nn.functional.cross_entropy(out.logits, y_train, reduction="sum")
    named = dict(model.named_parameters())
    loss = loss + 0.5 * alpha * sum((named[n] ** 2).sum() for n in params)
    opt.zero_grad()
    loss.backward()
    opt.step()
model.eval()

# 3. The linearised model: Φ = ∂ logits / ∂ θ at the MAP (torch.func jvp / vjp on dict batches),
#    B_n = softmax Hessian (the GGN), pseudo-targets Φθ* + B⁻¹(y − p).
features = network_features(model, train, params)
logits = network_logits(model, train)
noise = softmax_hessian(logits, jitter=1e-4)
theta_map = network_parameters(model, params)
targets = linearised_targets(features, theta_map, logits, y_train, noise)
print(f"d = {features.d} stochastic weights, n = {features.n}, m = {features.m}")

# 4. EM for the prior precision, one α for attention weights and one for the rest (MacKay updates,
#    effective dimension from k sample-then-optimise samples; g-prior feature normalisation).
sizes = {n: p.numel() for n, p in model.named_parameters()}
groups = torch.cat([torch.full((sizes[n],), 0 if "attention" in n else 1) for n in params])
em = fit_prior_precision(
    features,
    targets,
    noise,
    Prior(torch.ones(2), groups),
    k=8,
    method="sgd",
    sgd=SGDConfig(batch_size=32, max_epochs=15),
    g_prior=True,
    tol=0.1,
    max_iter=3,
    generator=torch.Generator().manual_seed(0),
)
print("α (normalised, attention / rest):", [f"{a:.3g}" for a in em.prior.alpha.tolist()])

# 5. Posterior samples z_j ~ N(0, H⁻¹) under the fitted prior (one precision per weight: the g-prior),
#    then linearised logit samples f(x; θ*) + J(x) z_j for the test sentences.
d = features.d
prior = Prior(em.precision_diag, torch.arange(d))
z = posterior_samples(
    features,
    noise,
    prior,
    16,
    method="sgd",
    sgd=SGDConfig(batch_size=32, max_epochs=15),
    generator=torch.Generator().manual_seed(1),
).samples
logit_samples = linearised_logit_samples(model, test, params, z)  # [k, n_test, classes]
probs = logit_samples.softmax(-1).mean(0)
print("MAP p(y=1):       ", network_logits(model, test).softmax(-1)[:, 1].numpy().round(3))
print("linearised p(y=1):", probs[:, 1].numpy().round(3))
print("labels:           ", y_test.numpy())
