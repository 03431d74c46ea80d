"""Discovery of the linear maps of a model."""

from __future__ import annotations

from torch import nn


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face ``Conv1D`` (GPT-2): a linear map stored as (n_in x n_out), detected without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Return the linear maps of ``model`` by qualified name, in registration order.

    Args:
        model: Any ``torch.nn.Module``.

    Returns:
        Mapping from module name (as in ``model.named_modules()``) to every ``nn.Linear`` and Hugging Face
        ``Conv1D`` module.

    Raises:
        ValueError: If ``model`` has no linear maps.
    """
    found = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) or _is_conv1d(m)}
    if not found:
        raise ValueError(f"model {type(model).__name__} has no linear maps (nn.Linear or Conv1D)")
    return found
