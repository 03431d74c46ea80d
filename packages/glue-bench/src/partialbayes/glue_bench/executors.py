"""Where the units of a grid run: one after another in this process (``local``), or as Ray tasks (``ray``).

A unit is one (task, split), each under its claim (``ResultStore.unit_claim``) in one shared results folder;
how units spread over processes, Ray and Slurm is in the how-to. Ray (``partialbayes-glue-bench[ray]``) is
imported only when asked for.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partialbayes.glue_bench.store import atomic_write
from partialbayes.predictive.internal import check_choice

EXECUTORS = ("local", "ray")
RAY_INSTALL = "pip install 'partialbayes-glue-bench[ray]'"
logger = logging.getLogger(__name__)


@dataclass
class UnitResult:
    """What a unit reports back (its records are in the results folder): failed cells, stage timings."""

    failures: list[str] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)


UnitJob = Callable[[str, int], UnitResult]
"""``job(task, split) -> UnitResult``: the work of one unit."""


def run_units(
    units: Sequence[tuple[str, int]],
    job: UnitJob,
    results: Path,
    executor: str = "local",
    ray_address: str | None = None,
    keep_going: bool = False,
    gpus_per_unit: float = 0.0,
) -> list[UnitResult]:
    """Run ``job`` for every (task, split) unit; returns their results in the order they finish.

    Args:
        units: The units.
        job: The work of one unit; for ``ray`` picklable (a ``functools.partial`` of a module function).
        results: The results folder every unit writes to.
        executor: ``local`` (this process, in order) or ``ray`` (one task per unit on the cluster at
            ``ray_address``; without one, on the cluster Ray is initialised with, or on a local cluster
            started here and shut down at the end). Ray workers print their progress (:func:`on_worker`).
        ray_address: ``HOST:PORT`` or ``ray://HOST:PORT`` of a running cluster.
        keep_going: Ray: a unit that raises becomes a failure line and the others go on; otherwise the
            others are cancelled and its error is raised here (``local`` always raises).
        gpus_per_unit: GPUs each Ray task asks for (1 on ``cuda``).

    Raises:
        ValueError: Unknown executor; no Ray cluster answers at ``ray_address`` (within seconds, before
            anything is written).
        ImportError: Ray requested but not installed (the message names the extra).
        FileNotFoundError: A Ray worker does not see the results folder this process created.
    """
    check_choice("executor", executor, EXECUTORS)
    if executor == "local":
        return [job(task, split) for task, split in units]
    ray = import_ray()
    started = connect_ray(ray, ray_address)
    probe = Path(results).absolute() / f".glue-bench-probe-{uuid.uuid4().hex}"
    try:
        atomic_write(probe, socket.gethostname())
        remote = ray.remote(num_cpus=1, num_gpus=gpus_per_unit)(on_worker)
        pending = {remote.remote(job, t, s, str(probe)): (t, s) for t, s in units}
        logger.info(f"{len(pending)} unit(s) sent to the Ray cluster")
        out = []
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            task, split = pending.pop(ref)
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if isinstance(err.cause, BaseException) else err
                if not keep_going:
                    for other in pending:
                        ray.cancel(other)
                    raise cause from None
                out.append(UnitResult([f"{task}/split{split}: {type(cause).__name__}: {cause}"]))
                logger.warning(f"[{task} split {split}] FAILED ({out[-1].failures[0]})")
        return out
    finally:
        probe.unlink(missing_ok=True)
        if started:
            ray.shutdown()


def on_worker(job: UnitJob, task: str, split: int, probe: str) -> UnitResult:
    """A unit on a Ray worker: check this host sees the driver's results folder, run it, print its progress.

    Printed from INFO up (Ray forwards it to the driver) where nobody set up logging in the worker.

    Raises:
        FileNotFoundError: The probe file the driver wrote into the results folder is not here.
    """
    path = Path(probe)
    if not path.is_file():
        raise FileNotFoundError(
            f"results folder {path.parent} on Ray worker {socket.gethostname()}: the file {path.name} "
            "that the driver wrote there is missing, so this is not the driver's folder; give --results "
            "a path on a file system that every node mounts"
        )
    if not (package := logging.getLogger(__package__)).hasHandlers():
        package.addHandler(logging.StreamHandler(sys.stdout))
        package.setLevel(logging.INFO)
    return job(task, split)


def import_ray() -> Any:
    """The ``ray`` module, or an ``ImportError`` naming the extra that installs it.

    Ray's ``uv run`` hook is switched off (``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0``): it would start each worker in an
    environment synced without this package's extras.
    """
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"--executor ray needs Ray: {RAY_INSTALL}") from err
    return ray


def connect_ray(ray: Any, address: str | None, timeout: float = 5.0) -> bool:
    """Connect to the Ray cluster at ``address``, or start a local one; whether it was started here.

    Ray retries an address that does not answer for minutes, so it is tried first with a plain TCP
    connection of at most ``timeout`` seconds. An initialised Ray (the caller's ``ray.init``) is used as it is.

    Raises:
        ValueError: ``address`` is not ``HOST:PORT`` / ``ray://HOST:PORT``, or nothing answers there.
    """
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(include_dashboard=False)
        return True
    m = re.fullmatch(r"(?:ray://)?\[?([^\]\s]+?)\]?:(\d+)", address.strip())
    if m is None:
        raise ValueError(f"--ray-address must be HOST:PORT or ray://HOST:PORT, got {address!r}")
    try:
        socket.create_connection((m[1], int(m[2])), timeout=timeout).close()
    except OSError as err:
        raise ValueError(
            f"no Ray cluster answers at {address} ({err or type(err).__name__}): start one there "
            "(`ray start --head --port PORT`), or leave out --ray-address to start a local one"
        ) from None
    ray.init(address=address.strip())
    return False
