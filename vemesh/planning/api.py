"""``vemesh.planning.plan``: will it fit, from Python. The same figures as ``vemesh plan --model ... --json``.

>>> from vemesh.planning import plan                                  # doctest: +SKIP
>>> doc = plan(make, parallelize=parallelize, step=step, world_size=8, tp=2, global_batch_size=16)
>>> doc["peak"], doc["classes"][0]["bytes_per_step"]                  # doctest: +SKIP
(30012416, {'DP': 23371776, 'TP': 11010048})

``model`` is the GPT preset (``"gpt:n_layer=..."``), ``"module:MODULE:FACTORY"``, or the factory itself; ``parallelize``
and ``step`` are ``"MODULE:FUNCTION"`` or the functions. Give the degrees for one mesh; give ``device_memory`` and no
``pp``/``dp``/``tp`` for every mesh of ``world_size`` that fits, ranked (the JSON of ``vemesh plan`` searching).
Bad values raise ``ValueError`` with the line ``vemesh plan`` prints.
"""

from __future__ import annotations

from typing import Any

__all__ = ["model_document", "plan", "verdict"]


def plan(model: Any, *, world_size: int, parallelize: Any = None, step: Any = None, pp: int | None = None,
         dp: int | str | None = None, cp: int = 1, tp: int | None = None, ep: int = 1, dp_replicate: int = 1,
         global_batch_size: int = 32, micro_batch_size: int | None = None, dtype: str = "fp32",
         dp_mode: str | None = None, pp_schedule: str = "1f1b", sequence_parallel: bool = False,
         activation_checkpointing: bool = False, moe_load_factor: float = 1.0, device_memory: int | str | None = None,
         devices_per_host: int | None = None, rank_by: str | None = None, device_type: str = "cuda") -> dict[str, Any]:
    """The prediction for one mesh, or the ranked search, as the dict ``vemesh plan --json`` prints."""
    from vemesh.planning.estimate import parse_size  # torch only when a model is planned: `import vemesh.planning` (the CLI) starts fast
    from vemesh.planning.fit import Job, predict, search  # torch only when a model is planned: `import vemesh.planning` (the CLI) starts fast
    from vemesh.planning.fit_report import search_document  # torch only when a model is planned: `import vemesh.planning` (the CLI) starts fast
    from vemesh.planning.mesh_plan import plan_mesh  # torch only when a model is planned: `import vemesh.planning` (the CLI) starts fast
    from vemesh.planning.routing import check_load_factor  # torch only when a model is planned: `import vemesh.planning` (the CLI) starts fast

    if isinstance(device_memory, str):
        device_memory = parse_size(device_memory, "device_memory")
    job = Job(model, global_batch_size, dtype=dtype, dp_mode=dp_mode, micro_batch_size=micro_batch_size,
              pp_schedule=pp_schedule, sequence_parallel=sequence_parallel,
              activation_checkpointing=activation_checkpointing, parallelize=parallelize, step=step,
              moe_load_factor=check_load_factor(moe_load_factor))
    if device_memory is not None and pp is None and dp is None and tp is None:
        rank_by = rank_by or ("inter-host" if devices_per_host else "peak")
        fits, rejected = search(job, world_size, device_memory=device_memory, devices_per_host=devices_per_host,
                                cp=cp, ep=ep, rank_by=rank_by)
        return search_document(job, world_size, device_memory, devices_per_host, rank_by, fits, rejected)
    mesh = plan_mesh(world_size, pp=pp or 1, dp=dp, cp=cp, tp=tp or 1, ep=ep, dp_replicate=dp_replicate,
                     devices_per_host=devices_per_host, device_type=device_type)
    d = mesh.degrees
    fit = predict(job, dp=d["DP"], tp=d["TP"], pp=d["PP"], cp=d["CP"], ep=mesh.ep, dp_replicate=dp_replicate)
    return model_document(job, mesh, fit, device_memory)


def verdict(fit: Any, device_memory: int | None) -> str | None:
    """``"fits"`` / ``"does not fit"`` against ``device_memory`` (None without one); static-only plans say so."""
    if device_memory is None:
        return None
    if fit.traced:
        return "fits" if fit.peak <= device_memory else "does not fit"
    return "the static memory alone fits" if fit.peak <= device_memory else "does not fit"


def model_document(job: Any, mesh: Any, fit: Any, device_memory: int | None) -> dict[str, Any]:
    """The JSON of one mesh's prediction, with the mesh's lines to paste and the verdict."""
    from vemesh.planning.fit_report import fit_document  # torch only when a model is planned: `import vemesh.planning` (the CLI) starts fast

    doc = fit_document(job, fit)
    doc.update({"world_size": mesh.world_size, "init_device_mesh": mesh.init_call(), "flatten": mesh.flatten_calls()})
    said = verdict(fit, device_memory)
    if said:
        doc.update({"device_memory": device_memory, "fits": said == "fits"})
    return doc
