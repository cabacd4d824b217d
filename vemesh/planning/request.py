"""What ``vemesh plan`` is asked, as one value: :class:`PlanRequest`.

The CLI builds it from its flags (:meth:`PlanRequest.from_args`) and :func:`vemesh.planning.plan` accepts it (or
its fields as keywords), so both ask the planner the same question with the same defaults. Pure Python: building
and checking a request imports no torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from vemesh.layout.names import divisors
from vemesh.models.llama3.config import check_ac, config_of
from vemesh.planning.speedups import Speedups

__all__ = ["CHOICES", "COMPILE_COMPONENTS", "GRADIENT_SYNC", "JOB_FLAGS", "OPTIMIZER_IMPLEMENTATIONS", "PlanRequest"]

#: What a search by time may choose for each mesh (``--choose``), besides the mesh itself.
CHOICES = ("micro-batch-size", "activation-checkpointing")

#: How AdamW steps (``--optimizer-implementation``), as torchtitan's ``optimizer.implementation`` names it: torch's
#: loop over tensors (``foreach=False``), its foreach kernels (``foreach=True``) or its fused kernel (``fused=True``).
OPTIMIZER_IMPLEMENTATIONS = ("for-loop", "foreach", "fused")

#: What ``--compile`` compiles, as torchtitan's ``compile.components`` names it: the blocks, and the loss (the Llama 3
#: preset's: torchtitan's default since 2025; its December 2024 commit compiled the blocks alone)
COMPILE_COMPONENTS = ("model", "loss")

#: With gradient accumulation, the micro-batches whose backward averages the gradients over DP
#: (``--gradient-sync``): the last alone (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)`` on the
#: others: Accelerate's default, the GPT example's loop), or each (torchtitan's loop; Accelerate's
#: ``sync_each_batch``), which FSDP2 pays in reduce-scatters rather than in unsharded gradients held.
GRADIENT_SYNC = ("last", "each")

#: The fields that describe a job: given without a model they would be ignored, so they are refused.
JOB_FLAGS: tuple[str, ...] = ("device_memory", "global_batch_size", "dtype", "dp_mode", "micro_batch_size",
                              "pp_schedule", "rank_by", "parallelize", "step", "loss", "before_optimizer", "moe_load_factor",
                              "sequence_parallel", "activation_checkpointing", "device_profile", "choose", "compile",
                              "float8", "float8_all_gather", "async_tp", "trace_pp",
                              "jobs", "optimizer_implementation", "gradient_sync")


@dataclass(frozen=True)
class PlanRequest:
    """One planning question: the mesh (or a search over every mesh), and with ``model`` the job trained on it.

    The mesh: ``pp``, ``dp``, ``cp``, ``tp`` are degrees, one of them ``"auto"`` (or -1) to fill in; ``dp=None``
    is ``"auto"`` unless another degree is. ``ep`` reuses the DP x CP ranks; ``dp_replicate`` splits DP for HSDP.
    With ``model`` and ``device_memory`` and none of ``pp``/``dp``/``tp``, every mesh of ``world_size`` is tried and
    those that fit are ranked by ``rank_by`` (:attr:`searches`).

    The job: ``model`` is the GPT preset (``"gpt:n_layer=..."``), the Llama 3 preset (``"llama3:8b"``),
    ``"module:MODULE:FACTORY"``, or the factory;
    ``parallelize`` and ``step`` are ``"MODULE:FUNCTION"`` or the functions (they trace the user's own model); with PP
    ``loss`` is the schedule's ``loss_fn`` and ``pp_schedule`` names torch's schedule for both. A field left ``None``
    takes the default the CLI documents; the preset's own flags (``sequence_parallel``,
    ``activation_checkpointing``) are refused beside a ``parallelize`` or ``step``, which decide those things
    themselves.
    """

    world_size: int
    model: Any = None
    parallelize: Any = None
    step: Any = None
    loss: Any = None  #: with PP and the user's functions: ``loss_fn(output, target)`` for torch's schedule
    #: with the user's functions: ``FUNCTION(model)`` between the last backward and ``optimizer.step()`` (clipping)
    before_optimizer: Any = None
    # the mesh
    pp: int | str | None = None
    dp: int | str | None = None
    cp: int | str = 1
    tp: int | str | None = None
    ep: int = 1
    dp_replicate: int = 1
    devices_per_host: int | None = None
    #: where the job runs: the ``init_device_mesh`` call's device, and without a profile how the optimizer is planned
    #: (``cpu``: torch's loop over tensors; any other: foreach over whole tensors, as on CUDA)
    device_type: str = "cuda"
    # the job
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    dtype: str | None = None
    dp_mode: str | None = None
    pp_schedule: str | None = None
    sequence_parallel: bool = False
    #: ``none``, ``full`` (``True``), and for the Llama 3 preset ``selective-op`` or ``selective-N``
    activation_checkpointing: bool | str = False
    moe_load_factor: float | str | None = None
    #: one of :data:`OPTIMIZER_IMPLEMENTATIONS`; None: as torch picks on the device (foreach on a GPU, else the loop)
    optimizer_implementation: str | None = None
    gradient_sync: str | None = None  #: ``last`` or ``each`` (:data:`GRADIENT_SYNC`); None: the preset's, else last
    # what GPU users turn on for speed (vemesh.planning.speedups): rules on the traced step's time
    #: True (the bare flag: the blocks, and the Llama 3 preset's loss as torchtitan compiles it) or the components
    #: of :data:`COMPILE_COMPONENTS`, comma-separated (``"model"``: the blocks alone)
    compile: bool | str = False
    float8: str | None = None  #: ``tensorwise`` or ``rowwise``
    float8_all_gather: bool = False
    async_tp: bool = False
    # the question
    device_memory: int | str | None = None
    rank_by: str | None = None
    device_profile: Any = None  #: a built-in profile's name, a JSON file, or a DeviceProfile: adds the step time
    #: a search by time: what it chooses for each mesh as well, of :data:`CHOICES` (or one comma-separated string)
    choose: tuple[str, ...] | str | None = None
    #: a search traces each of a preset's PP meshes through torch's schedule, as ``pp=N`` plans it (otherwise it
    #: leaves them out, each with the command that plans it; a user's own functions' are always traced)
    trace_pp: bool = False
    #: a search plans its meshes in this many processes at once (:mod:`vemesh.planning.search_jobs`; None: one)
    jobs: int | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            given = [f for f in JOB_FLAGS if getattr(self, f) not in (None, False)]
            if given:
                raise ValueError(f"argument --{given[0].replace('_', '-')}: describes a job; give the model too "
                                 "(--model gpt:n_layer=...,... or --model module:package.module:factory)")
            return
        user = self.parallelize is not None or self.step is not None
        if user and isinstance(self.model, str) and not self.model.startswith("module:"):
            raise ValueError(f"--parallelize and --step trace your own model, given as --model module:MODULE:FACTORY; "
                             f"got --model {self.model} (the presets are parallelized by vemesh.models)")
        ac = check_ac(self.activation_checkpointing)
        llama3 = isinstance(self.model, str) and self.model.startswith("llama3:")
        if llama3:
            config_of(self.model)  # an unknown size or key: one line
        for flag, value, whose in (("--sequence-parallel", self.sequence_parallel, "the GPT preset's"),
                                   ("--activation-checkpointing", ac != "none", "the presets'")):
            if value and user:
                raise ValueError(f"{flag} is {whose}; with --parallelize your function decides it")
        if ac.startswith("selective") and not llama3:
            raise ValueError(f"--activation-checkpointing {ac}: the GPT preset recomputes whole blocks (full) or "
                             "none; selective-op and selective-N are the Llama 3 preset's (--model llama3:8b)")
        mode = self.dp_mode or ("fsdp" if llama3 else "zero1")
        if self.dp_replicate != 1 and not user and mode != "fsdp":  # the split would change nothing planned
            raise ValueError(f"--dp-replicate {self.dp_replicate} splits DP for FSDP2's HSDP (replicas of FSDP "
                             f"shards); {mode} averages over all of DP: give --dp-mode fsdp, or leave "
                             "--dp-replicate out")
        if self.sequence_parallel and llama3:
            raise ValueError("--sequence-parallel: the Llama 3 preset always runs TP with sequence parallelism, as "
                             "torchtitan does")
        self._check_speedups()
        if self.optimizer_implementation not in (None, *OPTIMIZER_IMPLEMENTATIONS):
            raise ValueError(f"--optimizer-implementation {self.optimizer_implementation!r}: choose one of "
                             f"{', '.join(OPTIMIZER_IMPLEMENTATIONS)} (or leave it out: as torch picks on the device)")
        self._check_gradient_sync(llama3)
        if self.before_optimizer is not None and not user:
            raise ValueError("--before-optimizer is your loop's end of a step, for your own functions (--parallelize, "
                             "--step); the GPT preset runs the example's (its clipping and loss all-reduces)")
        if self.loss is not None and not user:
            raise ValueError("--loss is your pipeline's loss_fn, for your own functions (--parallelize, --step); the "
                             "GPT preset has its own")
        if self.device_profile is not None and not user and not str(self.model).startswith(("gpt:", "llama3:")):
            raise ValueError("--device-profile times a traced step: give your model's step too (--step MODULE:FUNCTION, "
                             "with --parallelize for TP, CP or EP), or a preset (--model gpt:... or llama3:...)")
        if self.rank_by == "time" and self.device_profile is None:
            raise ValueError("--rank-by time needs --device-profile NAME|FILE: the device each mesh's step is timed on")
        if isinstance(self.device_memory, int) and (isinstance(self.device_memory, bool) or self.device_memory < 1):
            raise ValueError(f"device_memory {self.device_memory!r}: give bytes (at least 1) or a size such as "
                             "'80GiB'")
        if self.jobs is not None and (not isinstance(self.jobs, int) or isinstance(self.jobs, bool) or self.jobs < 1):
            raise ValueError(f"--jobs must be a positive integer (the processes that plan a search's meshes at once); "
                             f"got {self.jobs!r}")
        if self.jobs is not None and not self.searches:
            raise ValueError("--jobs is for a search (--device-memory, none of --pp, --dp, --tp): a plan of one mesh "
                             "runs in one process")
        data = self.world_size // self.cp if isinstance(self.cp, int) and self.cp > 0 else 0
        if self.dp_replicate != 1 and self.searches and data and data % self.dp_replicate:  # no mesh's DP splits so
            raise ValueError(f"--dp-replicate {self.dp_replicate} splits each mesh's DP into {self.dp_replicate} "
                             f"replicas, and no DP of {self.world_size} ranks (CP {self.cp}) is a multiple of it: "
                             f"choose one of {', '.join(map(str, divisors(data)))}")
        if self.trace_pp and not self.searches:
            raise ValueError("--trace-pp is for a search (--device-memory, none of --pp, --dp, --tp): a plan of one "
                             "mesh with --pp N traces its pipeline already")
        for choice in self.choices:
            if choice not in CHOICES:
                raise ValueError(f"--choose {choice!r} is not a choice; choose from {', '.join(CHOICES)} "
                                 "(comma-separated)")
        if self.choices:
            if not self.searches or self.order != "time":
                raise ValueError("--choose picks what makes each mesh's step fastest in a search by time: give "
                                 "--device-memory and --device-profile, and none of --pp, --dp, --tp")
            if "micro-batch-size" in self.choices and self.micro_batch_size is not None:
                raise ValueError(f"--choose micro-batch-size and --micro-batch-size {self.micro_batch_size}: fix it or "
                                 "let the search choose it, not both")
            if "activation-checkpointing" in self.choices and (user or ac != "none"):
                raise ValueError("--choose activation-checkpointing is the GPT preset's choice, made without "
                                 "--activation-checkpointing" + ("; with --parallelize your function decides it: "
                                 "plan one function with it and one without to compare" if user else ""))

    def _check_gradient_sync(self, llama3: bool) -> None:
        sync = self.gradient_sync
        if sync is None:
            return
        if sync not in GRADIENT_SYNC:
            raise ValueError(f"--gradient-sync {sync!r}: choose last (the last micro-batch's backward averages the "
                             "gradients: no_sync on the others) or each (every micro-batch's does: torchtitan's loop)")
        if llama3 and sync != "each":  # the GPT preset runs the example's loop, which takes either
            raise ValueError(f"--gradient-sync {sync}: the Llama 3 preset runs torchtitan's loop, which averages the "
                             "gradients on each micro-batch's backward; give --gradient-sync each or leave it out")
        if sync == "each" and isinstance(self.pp, int) and self.pp > 1:
            raise ValueError(f"--gradient-sync each with --pp {self.pp}: torch's schedule runs the micro-batches and "
                             "averages each stage's gradients on its last backward; leave --gradient-sync out")

    def _check_speedups(self) -> None:
        """--compile, --float8, --float8-all-gather and --async-tp: what they need, each in one line."""
        # a compiled loss holds less (the Llama 3 preset's, traced as inductor holds it): it changes the peak too
        peak = "loss" in self.compiled_parts()
        given = [f for f, v in (("--compile", self.compile and not peak), ("--float8", self.float8),
                                ("--async-tp", self.async_tp), ("--float8-all-gather", self.float8_all_gather)) if v]
        if given and self.device_profile is None:
            raise ValueError(f"{given[0]} changes the predicted step time only (the peak is the eager trace's, but for "
                             "the Llama 3 preset's compiled loss): give --device-profile NAME|FILE too")
        Speedups(bool(self.compile), self.float8, self.float8_all_gather, self.async_tp)  # what they need of each other
        if self.float8 is not None and self.parallelize is None and self.step is None:  # yours: read from the trace
            if (self.dtype or "fp32") != "bf16":
                raise ValueError(f"--float8 {self.float8} runs the Linear matmuls in float8 in place of bf16 ones "
                                 f"(torchao's training recipe): give --dtype bf16; got {self.dtype or 'fp32'}")
        if self.float8_all_gather and self.parallelize is None:  # your function's wrapper: read from its trace
            if (self.dp_mode or ("fsdp" if str(self.model).startswith("llama3:") else "zero1")) != "fsdp":
                raise ValueError(f"--float8-all-gather is FSDP2's parameter all-gather: give --dp-mode fsdp; got "
                                 f"{self.dp_mode or 'zero1'}")
        if self.async_tp and not self.searches and self.tp in (None, 1, "1"):
            raise ValueError("--async-tp overlaps TP's all-gathers and reduce-scatters with the matmuls they feed, "
                             f"but the mesh has no TP (--tp {self.tp or 1}): give --tp N, or leave --async-tp out")

    def compiled_parts(self) -> tuple[str, ...]:
        """What ``compile`` compiles (:data:`COMPILE_COMPONENTS`): none, the blocks, or the blocks and the Llama 3
        preset's loss (the bare flag's for that preset); ``ValueError`` names a bad one."""
        llama3 = str(self.model).startswith("llama3:") and self.parallelize is None and self.step is None
        if self.compile in (False, None):
            return ()
        if self.compile is True:
            return COMPILE_COMPONENTS if llama3 else ("model",)
        parts = tuple(dict.fromkeys(p.strip() for p in str(self.compile).split(",")))
        for part in parts:
            if part not in COMPILE_COMPONENTS:
                raise ValueError(f"--compile {self.compile!r}: {part!r} is not a component; give model or model,loss "
                                 "(torchtitan's compile.components), or the bare flag")
        if "model" not in parts:
            raise ValueError(f"--compile {self.compile!r}: the plan times the blocks compiled; give model,loss")
        if "loss" in parts and not llama3:
            raise ValueError(f"--compile {self.compile!r}: the loss is compiled as the Llama 3 preset's (torchtitan's); "
                             "the GPT example compiles its blocks alone, and your own step's loss is traced as your "
                             "step runs it: give --compile model, or the bare flag")
        return parts

    @property
    def choices(self) -> tuple[str, ...]:
        """``choose`` as a tuple of names (a comma-separated string split)."""
        if self.choose is None:
            return ()
        items = self.choose.split(",") if isinstance(self.choose, str) else self.choose
        return tuple(c.strip() for c in items if c.strip())

    @property
    def searches(self) -> bool:
        """Whether every mesh of the world size is tried: a model and a device memory, and no PP, DP or TP."""
        return (self.model is not None and self.device_memory is not None
                and self.pp is None and self.dp is None and self.tp is None)

    @property
    def order(self) -> str:
        """The search order: ``rank_by``, else time with a device profile, inter-host with ``devices_per_host``, else
        peak."""
        return self.rank_by or ("time" if self.device_profile is not None else
                                "inter-host" if self.devices_per_host else "peak")

    def memory(self) -> int | None:
        """``device_memory`` in bytes (a string such as ``"80GiB"`` parsed); ``ValueError`` names a bad one."""
        if self.device_memory is None or isinstance(self.device_memory, int):
            return self.device_memory
        from vemesh.planning.estimate import parse_size  # torch: the request itself stays importable without it

        return parse_size(self.device_memory, "--device-memory")

    def job(self) -> Any:
        """The :class:`~vemesh.planning.fit.Job`: what is trained and how, every default filled in."""
        from vemesh.planning.fit import Job  # torch: the request itself stays importable without it
        from vemesh.planning.routing import check_load_factor  # torch: the request itself stays importable without it

        factor = check_load_factor(self.moe_load_factor) if self.moe_load_factor is not None else 1.0
        micro = self.micro_batch_size if self.micro_batch_size is not None or not self.searches else 1
        llama3 = isinstance(self.model, str) and self.model.startswith("llama3:")
        ac = check_ac(self.activation_checkpointing)
        speed = Speedups(bool(self.compile), self.float8, self.float8_all_gather, self.async_tp)
        return Job(self.model, self.global_batch_size or 32, dtype=self.dtype or "fp32",
                   dp_mode=self.dp_mode or ("fsdp" if llama3 else None), micro_batch_size=micro,
                   pp_schedule=self.pp_schedule or "1f1b", sequence_parallel=self.sequence_parallel,
                   activation_checkpointing=ac if llama3 else ac == "full", parallelize=self.parallelize,
                   step=self.step, loss=self.loss, before_optimizer=self.before_optimizer, moe_load_factor=factor,
                   timed=self.device_profile is not None, speed=speed if speed.any else None, trace_pp=self.trace_pp,
                   optimizer_implementation=self.optimizer_implementation, gradient_sync=self.gradient_sync,
                   compiled_loss="loss" in self.compiled_parts())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlanRequest:
        """The request of ``vemesh plan``'s parsed flags (each flag is the field of the same name)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
