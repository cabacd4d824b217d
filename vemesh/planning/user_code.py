"""The user's code as the planner calls it: ``MODULE:FUNCTION`` references resolved, the three (to five) functions
of a plan, and each call's failure worded as one line that names the function and the user's own frame.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._device as _device
from torch import nn
from torch.overrides import TorchFunctionMode

from vemesh.parallel.tp_split import plain_name
from vemesh.planning.estimate import load_object
from vemesh.planning.known_causes import worded
from vemesh.planning.pipeline_trace import MissingMeta

__all__ = ["as_traced", "call", "compiled_module", "CONTRACTS", "on_this_cpu", "OnThisCPU", "resolve", "sharded_by_fsdp",
           "shown_path", "unbindable", "user_frame", "UserFunctions", "idle_dims", "whole_reshards_only"]

#: how vemesh plan and vemesh check call each of the user's functions
CONTRACTS = {
    "--model": "FACTORY(**model_kwargs) returning the nn.Module (no arguments unless --model-kwargs gives some)",
    "--parallelize": "parallelize(model, mesh), mesh being VESCALE_DEVICE_MESH, returning the model to train (with "
                     "PP: this PP rank's PipelineStage objects)",
    "--step": "step(model, micro_batch_size): one forward and backward of a micro-batch",
    "--loss": "loss_fn(output, target), as torch's pipeline schedules call it",
    "--before-optimizer": "before_optimizer(model), after the last backward and before optimizer.step()",
}


def resolve(ref: Any, flag: str) -> tuple[Callable[..., Any], str]:
    """A callable and its name from ``ref``: a callable, or ``MODULE:FUNCTION`` (``module:`` first for ``--model``)."""
    if callable(ref):
        return ref, f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', repr(ref))}"

    text = str(ref)
    head, _, rest = text.partition(":")
    if flag == "--model" and head in ("gpt", "llama3") and not rest.isidentifier():  # not a gpt.py's function
        raise ValueError(f"--model {text}: a preset of vemesh plan; here give your own model's factory, "
                         "module:MODULE:FUNCTION (e.g. module:mymodel:make), with its --parallelize and --step")
    body = text.removeprefix("module:") if flag == "--model" else text
    module, colon, name = body.rpartition(":")
    if not colon or not module or not name:
        example = "module:mymodel:make" if flag == "--model" else f"mymodel:{flag.strip('-').replace('-', '_')}"
        raise ValueError(f"{flag} {text!r}: expected {'module:' if flag == '--model' else ''}MODULE:FUNCTION, a "
                         f"dotted module importable from the current directory or a file path (e.g. {example}, "
                         f"./mymodel.py:{example.rsplit(':', 1)[1]})")
    return load_object(module, name, f"{flag} {text}"), text


@dataclass(frozen=True)
class UserFunctions:
    """The user's functions (three, and with PP the loss, and the step's end) and the names they were given by."""

    factory: Callable[[], nn.Module]
    parallelize: Callable[[nn.Module, Any], nn.Module] | None
    step: Callable[[nn.Module, int], Any]
    names: tuple[str, str, str]
    #: the mesh keeps a DP dim of size 1 (as the GPT example's ``--mesh-shape 1,2`` does), not only the dims > 1
    keep_dp: bool = False
    #: with PP: ``loss_fn(output, target)`` as torch's schedules take it, and the schedule's name
    loss: Callable[..., Any] | None = None
    pp_schedule: str = "1f1b"
    #: ``FUNCTION(model)`` after the last micro-batch's backward, before ``optimizer.step()``, on what the
    #: parallelize function returned: what the training loop does there (torch's ``clip_grad_norm_``, an
    #: all-reduce of the loss), so that its work and its collectives are in the step
    before_optimizer: Callable[[Any], Any] | None = None
    before_optimizer_name: str = ""
    #: the planner's presets (whose cut is theirs): ``FUNCTION(pp_rank, pp, n_blocks)``, what that PP rank's stages
    #: are when a model of ``n_blocks`` blocks (None: the preset's own depth) is cut
    #: (:func:`vemesh.models.gpt.stages.stage_kinds`); it stands for building each rank's stages to compare them
    stage_kinds: Callable[[int, int, int | None], tuple] | None = None
    #: the loop averages the gradients over DP on every micro-batch's backward (torchtitan's loop: FSDP2 reduce-scatters
    #: after each one), not only the last's (the habit of DDP's ``no_sync``, which FSDP2 pays for by holding every
    #: unsharded gradient until the last backward)
    sync_each: bool = False

    @classmethod
    def of(cls, model: Any, parallelize: Any, step: Any, loss: Any = None, pp_schedule: str | None = None,
           before_optimizer: Any = None) -> UserFunctions:
        if step is None:
            raise ValueError("--parallelize needs --step MODULE:FUNCTION too: the planner runs your step (one forward "
                             "and backward of a micro-batch) to count the activations")
        (f, fn), (p, pn), (s, sn) = resolve(model, "--model"), (resolve(parallelize, "--parallelize") if parallelize
                                                                else (None, "")), resolve(step, "--step")
        b, bn = resolve(before_optimizer, "--before-optimizer") if before_optimizer is not None else (None, "")
        return cls(f, p, s, (fn, pn, sn), loss=resolve(loss, "--loss")[0] if loss is not None else None,
                   pp_schedule=pp_schedule or "1f1b", before_optimizer=b, before_optimizer_name=bn)


def user_frame(error: BaseException | None = None) -> str:
    """`` at file:line in function`` of the innermost frame outside torch and vemesh (from the current directory
    when it is under it) of ``error``'s traceback, or of the stack where it is called without one; or ''."""
    frames = traceback.extract_tb(error.__traceback__) if error is not None else traceback.extract_stack()
    for frame in reversed(frames):
        if "/torch/" not in frame.filename and "/vemesh/" not in frame.filename and "<" not in frame.filename:
            return f" at {shown_path(frame.filename)}:{frame.lineno} in {frame.name}"
    return ""


def shown_path(path: str) -> str:
    """``path`` from the current directory where it is under it, else whole."""
    where = os.path.relpath(path)
    return path if where.startswith("..") else where


def unbindable(what: str, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> str | None:
    """One line saying how ``fn``'s parameters differ from how vemesh calls it, when ``fn(*args, **kwargs)`` cannot
    bind (a step written without ``micro_batch_size``, a parallelize function without ``mesh``); else None."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function without a signature: let the call say
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        bare = signature.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                             for p in signature.parameters.values()],
                                 return_annotation=inspect.Signature.empty)
        return (f"{what} {name} takes {bare}, but is called as {CONTRACTS.get(what, what)} ({e}); give it "
                "those parameters")
    return None


def call(what: str, name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; its failure becomes one line naming the function, the user's frame and the exception."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    if (wrong := unbindable(what, name, fn, *args)) is not None:
        raise ValueError(wrong)
    try:
        return fn(*args)
    except MissingMeta:  # a stage's input shapes come from a rank not traced yet: traced again after it
        raise
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise ValueError(f"{what} {name} needs a tensor's values{user_frame(e)} ({e.func}): a plan runs on fake "
                         "tensors, which have shapes but no values; keep .item(), .tolist(), printing and "
                         "value-dependent shapes out of it") from None
    except ValueError as e:
        if str(e).startswith(("--", "the step ran")):
            raise
        raise ValueError(f"{what} {name} failed{user_frame(e)}: {type(e).__name__}: {worded(e)}") from e
    except Exception as e:
        raise ValueError(f"{what} {name} failed{user_frame(e)}: {type(e).__name__}: {worded(e)}") from e


def compiled_module(parts: list[nn.Module]) -> str | None:
    """The name of the first module in ``parts`` that the user's functions compiled (``torch.compile(module)``,
    ``module.compile()``: torchtitan's parallelize compiles each block), else None."""
    from torch._dynamo.eval_frame import OptimizedModule

    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None:
                return name or type(module).__name__
    return None


@contextlib.contextmanager
def as_traced(device: str) -> Iterator[None]:
    """The user's code as the trace runs it:

    * what the user's functions compiled runs eagerly (``torch.compiler.set_stance("force_eager")``): dynamo would
      compile it on the trace's fake tensors under the planner's modes, and fail there, and the trace is of the eager
      step (``--compile`` times inductor's fusion on it);
    * for ``device`` "cuda", the user's ``torch.autocast("cuda", ...)`` (and ``torch.cuda.amp.autocast``) is CPU
      autocast of the same dtype: the trace's tensors are fake CPU ones, on which torch disables CUDA autocast (CUDA
      is not available) and the step ran in fp32, twice the activations of the run it plans. CPU autocast's op lists
      stand in for CUDA's: matmuls, linear and attention in the low precision, softmax, norms and losses in fp32 on
      both. For any other device the user's autocast is left as torch runs it;
    * for any device but "cpu", ``torch.autograd.graph.save_on_cpu`` moves what autograd saves off the device, as it
      does there (:func:`_offloads_saved`): on the trace's fake CPU tensors it kept them where they were (or, pinned,
      copied them beside), and the plan counted the step's activations whole on the device;
    * for any device but "cpu", the device the step names is the CPU the trace runs on (:class:`OnThisCPU`)."""
    cls = torch.amp.autocast_mode.autocast
    original, saving = cls.__init__, torch.autograd.graph.save_on_cpu.__init__

    def on_cpu(self: Any, device_type: str, dtype: Any = None, *args: Any, **kwargs: Any) -> None:
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype or torch.get_autocast_dtype("cuda")
        original(self, device_type, dtype, *args, **kwargs)

    if device == "cuda":
        cls.__init__ = on_cpu
    if device != "cpu":
        torch.autograd.graph.save_on_cpu.__init__ = _offloads_saved
    try:
        with torch.compiler.set_stance("force_eager"), OnThisCPU() if device != "cpu" else contextlib.nullcontext():
            yield
    finally:
        cls.__init__, torch.autograd.graph.save_on_cpu.__init__ = original, saving


def _offloads_saved(self: Any, pin_memory: bool = False, device_type: str = "cuda") -> None:
    """``save_on_cpu(pin_memory, device_type)`` as it runs on an accelerator, on the trace's fake tensors: a saved
    tensor leaves the device when it is packed (the autograd graph keeps only its shape: the host's copy is not the
    device's memory), and is a new device tensor of its shape when the backward unpacks it (torch's copy back)."""
    def pack(t: torch.Tensor) -> tuple:
        return t.size(), t.stride(), t.dtype, t.device

    def unpack(saved: tuple) -> torch.Tensor:
        size, stride, dtype, device = saved
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    torch.autograd.graph.saved_tensors_hooks.__init__(self, pack, unpack)


def sharded_by_fsdp(parts: list[nn.Module], name: str) -> bool:
    """Whether FSDP2 shards any module of ``parts`` (the model, or a PP rank's stage modules). Raises ``ValueError``
    (one line) where it offloads to the CPU (``CPUOffloadPolicy``): its parameters, gradients and optimizer state then
    live in host memory, and the trace's tensors are all one device's, so the plan would count them as the device's
    (and not the copies offloading makes of them): silently another job's peak."""
    from torch.distributed.fsdp import FSDPModule

    units = [(n, m) for part in parts for n, m in part.named_modules() if isinstance(m, FSDPModule)]
    for unit, module in units:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None and any(p.offload_to_cpu for p in group.fsdp_params):
            raise ValueError(f"--parallelize {name} sharded {unit or 'the model'} with FSDP2's CPUOffloadPolicy, whose "
                             "parameters, gradients and optimizer state live in host memory: the planner does not "
                             "plan CPU offload (it would count them as the device's); plan the job without "
                             "offload_policy, an upper bound of the device memory it holds")
    return bool(units)


#: what a mesh dim that the user's functions leave idle needs: (the dim, what its ranks would duplicate, the call)
_IDLE = (("TP", "hold and compute the whole model", "apply a TP plan: parallelize_module(model, mesh['TP'], plan)"),
         ("CP", "compute whole sequences", "run the forward and backward inside vemesh.parallel.context_parallel("
                "mesh['CP'], ...) (or torch's)"),
         ("EP", "hold every expert", "shard the experts: parallelize_module(experts, mesh['EP'], ExpertParallel())"))


def idle_dims(parts: list[nn.Module], sent: dict[str, int], degrees: dict[str, int], names: tuple[str, ...]) -> None:
    """Raises ``ValueError`` (one line) for a TP, CP or EP dim of the mesh that the user's functions (``names``: the
    factory's, parallelize's and step's) left idle: no parameter of ``parts`` is a DTensor over it and the step
    (``sent``: its bytes by mesh dim) ran no collective on it. Its ranks would each do what their peers do, and a plan
    of that mesh (a search's too) would be of another job than the one asked for, e.g. TP 2 given to a parallelize
    function written for data parallelism alone."""
    from torch.distributed.tensor import DTensor

    dims = {d for part in parts for p in part.parameters() if isinstance(p, DTensor)
            for d in p.device_mesh.mesh_dim_names or ()}
    for dim, work, fix in _IDLE:
        if degrees.get(dim, 1) > 1 and dim not in dims and not sent.get(dim):
            what = (f"--step {names[2]} ran no collective on CP" if dim == "CP" else f"--parallelize {names[1]} "
                    f"sharded no parameter over {dim} and the step ran no collective on it")
            raise ValueError(f"the mesh has {dim} {degrees[dim]}, but {what}: every {dim} rank would {work}, as its "
                             f"{dim} peers do; {fix}, or plan with --{dim.lower()} 1")


@contextlib.contextmanager
def whole_reshards_only() -> Iterator[None]:
    """Inside, FSDP2's ``reshard_after_forward=N`` (an int: each unit resharded over groups of N ranks after its
    forward, gathered from them in backward) raises ``ValueError`` (one line): those groups are no mesh dim, which
    the planner cannot name or time. (FSDP2 builds their mesh from the rank tensor, which under the plan's fake
    tensors has no values: unrefused, the user was told their own function had read one.)"""
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    real = _fsdp_init._get_post_forward_mesh_info

    def refused(reshard_after_forward: Any, mesh_info: Any) -> Any:
        size = mesh_info.shard_mesh_size
        if type(reshard_after_forward) is int and 1 < reshard_after_forward < size and size % reshard_after_forward == 0:
            raise ValueError(f"FSDP2's reshard_after_forward={reshard_after_forward} reshards each unit over groups of "
                             f"{reshard_after_forward} of its {size} ranks after forward, groups that are no mesh dim: "
                             "the planner does not plan it; plan with reshard_after_forward=True (each unit's 1/"
                             f"{size} kept between forward and backward, where this keeps 1/{reshard_after_forward}) "
                             "or False (the whole unit)")
        return real(reshard_after_forward, mesh_info)

    for module in (_fsdp_init, _fully_shard):  # _fully_shard holds it by name
        module._get_post_forward_mesh_info = refused
    try:
        yield
    finally:
        for module in (_fsdp_init, _fully_shard):
            module._get_post_forward_mesh_info = real


def outside_fsdp(parts: list[nn.Module]) -> list[str]:
    """The names of the trainable parameters of ``parts`` (the model, or a PP rank's stage modules) under no FSDP2
    unit, where FSDP2 shards some of them (``fully_shard`` on the blocks and not on the root: the rest is never
    averaged over the data-parallel ranks); else []."""
    from torch.distributed.fsdp import FSDPModule

    held = {id(p) for part in parts for m in part.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    return [plain_name(n) for part in parts for n, p in part.named_parameters()
            if p.requires_grad and id(p) not in held] if held else []


def fsdp_covers(parts: list[nn.Module], name: str, ranks: int, dim: str) -> None:
    """Raises ``ValueError`` (one line) where FSDP2 shards some of ``parts`` over ``ranks`` data-parallel ranks
    (``dim``) and leaves trainable parameters under no unit (:func:`outside_fsdp`): they would train unaveraged."""
    if left := outside_fsdp(parts):
        raise ValueError(f"--parallelize {name} sharded modules with FSDP2, but {len(left)} trainable parameters "
                         f"({', '.join(left[:3])}{' and more' if len(left) > 3 else ''}) are under no FSDP2 unit: "
                         f"their gradients would never be averaged over the {ranks} data-parallel ranks ({dim}); "
                         "call fully_shard on the root too, after its blocks (as torchtitan does)")


def made_gradients(parts: list[nn.Module], name: str) -> None:
    """Raises ``ValueError`` (one line) where the step left no trainable parameter of ``parts`` a gradient (no
    ``loss.backward()``): a plan of it would be of a forward alone, without the backward's memory or the optimizer's."""
    if not any(p.grad is not None for part in parts for p in part.parameters() if p.requires_grad):
        raise ValueError(f"--step {name} computed no gradient (no parameter has one after it), but a plan is of a "
                         "training step, its backward and its optimizer's state included: call loss.backward() in it")


#: the accelerators a training step names its device by (``device="cuda"``, ``.to("cuda")``, ``.cuda()``)
_ACCELERATORS = frozenset({"cuda", "xpu", "hpu", "npu", "mtia", "mps"})
#: the tensor methods that move a tensor to an accelerator or pin it: on the CPU, the tensor itself
_MOVES = frozenset({torch.Tensor.cuda, torch.Tensor.xpu, torch.Tensor.mtia, torch.Tensor.pin_memory})


def _accelerator(device: Any) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type in _ACCELERATORS


class OnThisCPU(TorchFunctionMode):
    """A step written for an accelerator, run on this machine's CPU, where the plan's trace and ``vemesh check`` run
    it: a device the step names (``torch.randint(..., device="cuda")``, ``batch.to("cuda")``, ``.cuda()``,
    ``model.to(device)``) is the CPU, where its tensors are, and pinning is nothing. Before, the step failed there:
    "Torch not compiled with CUDA enabled", or, in a plan, "found at least two devices, cpu and cuda:0".
    ``torch.cuda``'s own functions (``synchronize``, ``current_device``, events) still need CUDA: patching them is
    not for a library (dynamo keeps a map of torch's functions, made at its first compile, which a stand-in spoils).

    A module moved to the device (``model.cuda()``, ``model.to("cuda")``, nothing else changed) stays where it is:
    ``nn.Module._apply`` swaps a fake parameter with its moved copy, which the plan's trackers (holding weak
    references to it) forbid ("Couldn't swap Embedding.weight")."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = device  #: where an accelerator's tensors go: the CPU, or the meta device of the plan's template

    def __enter__(self) -> OnThisCPU:
        self._module = (nn.Module.to, nn.Module.cuda)
        to = nn.Module.to

        def module_to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            if device is not None and device.type in _ACCELERATORS:
                kept = {k: v for k, v in (("dtype", dtype), ("memory_format", memory_format)) if v is not None}
                return to(module, **kept) if kept else module
            return to(module, *args, **kwargs)

        nn.Module.to, nn.Module.cuda = module_to, lambda module, *args, **kwargs: module
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        nn.Module.to, nn.Module.cuda = self._module
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        # under ``with torch.device("cuda"):`` torch's DeviceContext, which sits below every other mode, would give a
        # constructor without a device its own: given ours here
        default = kwargs.get("device") is None and _accelerator(_device.CURRENT_DEVICE) and \
            func in _device._device_constructors()
        moved = func in _MOVES or _accelerator(kwargs.get("device")) or default
        if func in _MOVES:
            return args[0].view_as(args[0])
        if moved:
            kwargs["device"] = self.device
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            given = args
            args = tuple(self.device if _accelerator(a) or (i == 1 and isinstance(a, int) and not isinstance(a, bool))
                         else a for i, a in enumerate(args))
            moved = moved or args != given
        out = func(*args, **kwargs)
        # a move to the device is a new tensor there (a module's ``_apply`` swaps a fake parameter with it, and a
        # tensor cannot be swapped with itself): here a view of the same storage, no bytes more, autograd kept
        return out.view_as(out) if moved and func is torch.Tensor.to and out is args[0] else out


def on_this_cpu(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under :class:`OnThisCPU`: how ``vemesh check`` calls the user's functions."""
    with OnThisCPU():
        return fn(*args, **kwargs)
