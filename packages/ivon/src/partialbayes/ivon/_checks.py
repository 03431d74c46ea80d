"""Validation of IVON's hyperparameters and of a state dict before it is loaded (nothing is mutated here)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from partialbayes.predictive.internal import check_int, check_keys, check_number

#: Hyperparameters every IVON parameter group holds, with their intervals.
RANGES: dict[str, str] = {
    "lr": "(0, inf)",
    "ess": "(0, inf)",
    "hess_init": "(0, inf)",
    "beta1": "[0, 1)",
    "beta2": "[0, 1)",
    "weight_decay": "[0, inf)",
    "clip_radius": "(0, inf]",
}


def validate_group(group: Mapping[str, Any], where: str = "") -> None:
    """Check every hyperparameter of a parameter group (``where`` prefixes the names, e.g. a group index)."""
    for name, interval in RANGES.items():
        if name not in group:
            raise ValueError(f"IVON: {where}parameter group has no {name!r} (not an IVON group)")
        check_number(f"{where}IVON: {name}", group[name], interval)


def check_state_dict(
    state_dict: Any, groups: Sequence[Mapping[str, Any]], label: Callable[[Tensor], str]
) -> None:
    """Refuse a state dict that does not fit the optimizer's ``groups``, before anything is loaded."""
    where = "IVON.load_state_dict: "
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{where}expected a dict, got {type(state_dict).__name__}")
    check_keys(
        f"{where}the state dict", state_dict, ("state", "param_groups"), ("generator_state",)
    )
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, Sequence) or not isinstance(state, Mapping):
        raise TypeError(f"{where}'param_groups' must be a list and 'state' a dict")
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"{where}the state dict has {len(saved_groups)} parameter groups, this optimizer {len(groups)}"
        )
    for g, (saved, own) in enumerate(zip(saved_groups, groups, strict=True)):
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), Sequence):
            raise TypeError(f"{where}parameter group {g} is not a dict with a 'params' list")
        validate_group(saved, f"{where}group {g}: ")
        # no "step" would restart the debiasing and schedules at step 0
        check_keys(f"{where}group {g}", saved, ("step",), {*own, "params"})
        check_int(f"{where}group {g}: step", saved["step"], "[0, inf)")
        if len(saved["params"]) != len(own["params"]):
            raise ValueError(
                f"{where}group {g} holds {len(saved['params'])} parameters in the state dict, "
                f"{len(own['params'])} in this optimizer"
            )
        for key, p in zip(saved["params"], own["params"], strict=True):
            _check_param_state(state.get(key), p, f"{where}{label(p)}: ")
    gen_state = state_dict.get("generator_state")
    if gen_state is not None and not (
        isinstance(gen_state, Tensor) and gen_state.dtype == torch.uint8
    ):
        raise TypeError(f"{where}'generator_state' must be a uint8 tensor (Generator.get_state())")


def _check_param_state(entry: Any, p: Tensor, where: str) -> None:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}the state dict holds no IVON state (momentum, hess) for it")
    check_keys(f"{where}it", entry, ("momentum", "hess"), (), "state entries")
    for key in ("momentum", "hess"):
        t = entry[key]
        if not isinstance(t, Tensor):
            raise ValueError(f"{where}no tensor {key!r} for it (not an IVON state dict)")
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(
                f"{where}saved {key!r} has shape {tuple(t.shape)}, the parameter has {tuple(p.shape)}"
            )
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}saved {key!r} is not a finite floating-point tensor")
    if not bool((entry["hess"] > 0).all()):
        raise ValueError(f"{where}saved 'hess' has entries <= 0 (it must be positive)")
