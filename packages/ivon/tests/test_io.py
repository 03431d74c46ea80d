import pytest
import torch

from partialbayes.ivon import (
    IVON,
    GaussianPosterior,
    MultiIVON,
    ivon_posterior,
    load_posterior,
)


def _model(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(
        device=device, dtype=torch.float64
    )


def _trained_posterior(device, seed):
    model = _model(device, seed)
    opt = IVON(
        model.parameters(), lr=0.1, ess=20, generator=torch.Generator(device).manual_seed(seed)
    )
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    for _ in range(2):
        with opt.sampled_params(train=True):
            model(x).square().mean().backward()
        opt.step()
    return model, ivon_posterior(opt, model)


def _assert_same(a, b):
    assert set(a.mean) == set(b.mean)
    for n in a.mean:
        assert torch.equal(a.mean[n], b.mean[n])
        assert torch.equal(a.std[n], b.std[n])
        assert a.mean[n].dtype == b.mean[n].dtype
        assert a.mean[n].device == b.mean[n].device


def test_round_trip_gaussian_and_mixture(tmp_path, device):
    model, post = _trained_posterior(device, 0)
    post.save(tmp_path / "post.safetensors")
    loaded = load_posterior(tmp_path / "post.safetensors", model)
    assert isinstance(loaded, GaussianPosterior)
    _assert_same(post, loaded)
    gen = torch.Generator(device).manual_seed(4)
    same = post.sample(3, generator=torch.Generator(device).manual_seed(4))
    for n, w in loaded.sample(3, generator=gen).items():
        assert torch.equal(w, same[n])  # same seed, same sample after the round trip
    assert loaded.model is model

    mix = MultiIVON([post, _trained_posterior(device, 1)[1], _trained_posterior(device, 2)[1]])
    mix.save(tmp_path / "mix.safetensors")
    back = load_posterior(tmp_path / "mix.safetensors", model)
    assert isinstance(back, MultiIVON)
    assert len(back.components) == 3
    for a, b in zip(mix.components, back.components, strict=True):
        _assert_same(a, b)
    on_cpu = load_posterior(tmp_path / "mix.safetensors")  # no model: CPU tensors
    assert all(t.device.type == "cpu" for t in on_cpu.components[0].mean.values())
    assert [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".")
    ] == []  # no temp files left


def test_refuses_mismatched_models_and_foreign_files(tmp_path):
    _, post = _trained_posterior("cpu", 0)
    post.save(tmp_path / "post.safetensors")
    wider = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    with pytest.raises(ValueError, match=r"0\.weight: saved \(4, 3\), model \(5, 3\)"):
        load_posterior(tmp_path / "post.safetensors", wider)
    with pytest.raises(ValueError, match=r"missing parameters \['2\.bias', '2\.weight'\]"):
        load_posterior(tmp_path / "post.safetensors", torch.nn.Sequential(torch.nn.Linear(3, 4)))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not a saved partialbayes posterior"):
        load_posterior(tmp_path / "other.safetensors")


def test_save_creates_the_folder_refuses_a_folder_and_needs_the_model(tmp_path):
    """Issue #27: a missing folder or a folder path raised SafetensorError naming a random temp file."""
    model, post = _trained_posterior("cpu", 0)
    target = tmp_path / "new" / "deeper" / "post.safetensors"
    post.save(target)
    _assert_same(post, GaussianPosterior.load(target, model))
    with pytest.raises(ValueError, match=r"it is a folder; give a file path"):
        post.save(tmp_path / "new")
    free = GaussianPosterior(post.mean, post.std)
    with pytest.raises(ValueError, match="has no model"):
        free.save(tmp_path / "free.safetensors")
