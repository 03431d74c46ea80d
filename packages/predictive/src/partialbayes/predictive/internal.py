"""Plumbing the sibling packages share: no compatibility promise, not part of the API reference."""

from partialbayes.predictive._answers import answer_index, check_target_ids
from partialbayes.predictive._batch import (
    IGNORE_INDEX,
    Batch,
    batch_size,
    flatten_outputs,
    model_logits,
    move_batch,
    output_logits,
    split_batch,
    take_inputs,
)
from partialbayes.predictive._files import (
    PosteriorFile,
    model_structure,
    read_posterior_file,
    write_posterior_file,
)
from partialbayes.predictive._link import probit_kernel, probit_scale
from partialbayes.predictive._mc import cholesky_jitter, gaussian_draws, gaussian_mc
from partialbayes.predictive._posterior import (
    LIKELIHOODS,
    TrainerEvents,
    available_memory,
    check_likelihood,
    eval_mode,
    gradients_only,
    resolve_link,
    rows,
)
from partialbayes.predictive._validate import (
    check_bool,
    check_choice,
    check_fields,
    check_generator,
    check_int,
    check_number,
    check_type,
    ranged,
)

__all__ = [
    "IGNORE_INDEX",
    "LIKELIHOODS",
    "Batch",
    "PosteriorFile",
    "TrainerEvents",
    "answer_index",
    "available_memory",
    "batch_size",
    "check_bool",
    "check_choice",
    "check_fields",
    "check_generator",
    "check_int",
    "check_likelihood",
    "check_number",
    "check_target_ids",
    "check_type",
    "cholesky_jitter",
    "eval_mode",
    "flatten_outputs",
    "gaussian_draws",
    "gaussian_mc",
    "gradients_only",
    "model_logits",
    "model_structure",
    "move_batch",
    "output_logits",
    "probit_kernel",
    "probit_scale",
    "ranged",
    "read_posterior_file",
    "resolve_link",
    "rows",
    "split_batch",
    "take_inputs",
    "write_posterior_file",
]
