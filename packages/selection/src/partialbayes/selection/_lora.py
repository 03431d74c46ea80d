"""Bayesian LoRA: subsets over the LoRA adapter maps of a PEFT model (Yang et al., 2024)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from partialbayes.selection._module_strategies import whole_modules
from partialbayes.selection._modules import linear_modules
from partialbayes.selection._subset import Subset
from partialbayes.selection._validate import check_type


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT LoRA layers of ``model`` (modules holding ``lora_A`` and ``lora_B`` module dicts)."""
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(m, "lora_B", None), nn.ModuleDict)
    }


def _adapters(layer: nn.Module, part: str = "lora_A") -> nn.ModuleDict:
    """The ``lora_A`` / ``lora_B`` module dict of a LoRA layer (adapter name -> map)."""
    found = getattr(layer, part)
    assert isinstance(found, nn.ModuleDict)
    return found


def _active(layer: nn.Module) -> list[str]:
    """Adapters of ``layer`` that are active (PEFT's ``active_adapters``; every adapter if it has none)."""
    keys = list(_adapters(layer))
    active = getattr(layer, "active_adapters", None)
    if active is None:
        return keys
    if isinstance(active, str):
        active = [active]
    return [k for k in keys if k in set(active)]


def _adapter_names(adapter: str | Iterable[str] | None) -> list[str] | None:
    if adapter is None:
        return None
    names = [adapter] if isinstance(adapter, str) else list(adapter)
    if not names or not all(isinstance(a, str) for a in names):
        raise TypeError(f"adapter must be a name, a list of names or None, got {adapter!r}")
    return names


def lora_modules(
    model: nn.Module, adapter: str | Iterable[str] | None = None
) -> dict[str, nn.Module]:
    """The LoRA adapter maps (``lora_A`` and ``lora_B``) of a PEFT model, by module name in model order.

    Pass the result as ``modules=`` to a strategy (:func:`sparse_kfac`, :func:`max_operator_norm` with
    ``group="all"``, :func:`random_modules`) to restrict it to the adapters. ``adapter``: the adapter
    name(s) to take; default the active adapter(s) of each layer.

    Raises:
        TypeError: If ``model`` is not an ``nn.Module`` or ``adapter`` is not a name / list of names.
        ValueError: If ``model`` has no LoRA adapters, an adapter name is unknown (listing those
            present), no adapter is active, a layer's adapters are merged into its base weights, or an
            adapter is not a linear map.
    """
    check_type("model", model, nn.Module, "a torch.nn.Module")
    wanted = _adapter_names(adapter)
    layers = _lora_layers(model)
    if not layers:
        raise ValueError(
            f"model {type(model).__name__} has no LoRA adapters (no module with lora_A / lora_B adapter "
            "maps); wrap it with peft.get_peft_model(model, peft.LoraConfig(...)) first"
        )
    present = sorted({k for layer in layers.values() for k in _adapters(layer)})
    if wanted is not None:
        unknown = [a for a in wanted if a not in present]
        if unknown:
            raise ValueError(f"unknown LoRA adapter(s) {unknown}; adapters present: {present}")
    linear = linear_modules(model)
    out: dict[str, nn.Module] = {}
    for name, layer in layers.items():
        chosen = [k for k in _adapters(layer) if k in wanted] if wanted else _active(layer)
        merged = set(getattr(layer, "merged_adapters", None) or [])
        for key in chosen:
            if key in merged:
                raise ValueError(
                    f"LoRA adapter {key!r} of {name!r} is merged into the base weights (peft "
                    "merge_adapter); unmerge it first, or it takes no part in the forward pass"
                )
            for part in ("lora_A", "lora_B"):
                full = f"{name}.{part}.{key}" if name else f"{part}.{key}"
                if full not in linear:
                    kind = type(_adapters(layer, part)[key]).__name__
                    raise ValueError(
                        f"LoRA adapter {full!r} is a {kind}, not a linear map (nn.Linear / Conv1D); only "
                        "adapters of linear layers are supported"
                    )
                out[full] = linear[full]
    if not out:
        raise ValueError(
            f"no active LoRA adapter in {type(model).__name__} (adapters present: {present}); pass "
            "adapter=... to choose one"
        )
    return {n: out[n] for n in linear if n in out}


def lora_subset(
    model: nn.Module, adapter: str | Iterable[str] | None = None, *, modules_to_save: bool = False
) -> Subset:
    """Every weight of the LoRA adapter maps of a PEFT model is stochastic (Bayesian LoRA), in model order.

    Kronecker-structured, so `KronLaplace` fits it directly; for a sparser subset use
    ``sparse_kfac(model, p, modules=lora_modules(model))``.

    Args:
        model: A PEFT model with LoRA adapters.
        adapter: Adapter name(s); default the active adapter(s) of each layer.
        modules_to_save: Also make the trainable copies of PEFT's ``modules_to_save`` (e.g. a new
            classification head, ``classifier.modules_to_save.<adapter>``) stochastic, whole.

    Raises:
        ValueError: As :func:`lora_modules`; with ``modules_to_save=True``, a model without such copies.
    """
    names = list(lora_modules(model, adapter))
    if modules_to_save:
        saved = _saved_modules(model, _adapter_names(adapter))
        if not saved:
            raise ValueError(
                f"modules_to_save=True, but {type(model).__name__} has no PEFT modules_to_save copy for "
                "the chosen adapter(s)"
            )
        names += list(saved)
    return whole_modules(model, names)


def _saved_modules(model: nn.Module, wanted: list[str] | None) -> dict[str, nn.Module]:
    """Trainable ``modules_to_save`` copies of the chosen (default: active) adapters."""
    out: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        saved = getattr(mod, "modules_to_save", None)
        if not isinstance(saved, nn.ModuleDict) or not hasattr(mod, "original_module"):
            continue
        active = getattr(mod, "active_adapters", None) or list(saved)
        keys = wanted if wanted is not None else ([active] if isinstance(active, str) else active)
        for key in saved:
            if key in keys:
                out[f"{name}.modules_to_save.{key}"] = saved[key]
    return out
