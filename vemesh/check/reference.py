"""The one-process run of ``vemesh check`` (:func:`reference`): the model as built, each DP rank's step in turn from
that rank's seed, and the gradients averaged as DP averages them.

A step whose own collectives couple the DP ranks' batches cannot run that way: a contrastive loss over negatives
gathered from every DP rank, or a loss divided by a token count summed over DP. In one process each collective has one
rank, so the two runs would differ whatever the plan, or agree where the plan is wrong. Where the step ran a
collective and DP is more than 1, one process runs the step once more, on the DP ranks' batches together
(:func:`_together`): given ``DP x micro-batch`` rows, each random draw of the step is made as each DP rank's step makes
it, from that rank's seed, on its rows, and joined along the rows (:class:`_RankDraws`). Its gradients are one
process's on the whole batch, whatever the loss's normalization over DP, and each module's output is cut back into
the DP ranks' rows. A draw that cannot be cut by rows leaves the run as it was, and says so."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from vemesh.check.precision import autocast_off
from vemesh.check.record import RANDOM_OPS, Deterministic, Recorder, gradients, plain_name, positions_argument, \
    quiet_shape_inference, unwrap
from vemesh.check.result import CheckInputError, built
from vemesh.check.run import SEED, Spec, UserError, call, dims, loss_of
from vemesh.layout.parallel_dims import ParallelDims
from vemesh.mesh import VESCALE_DEVICE_MESH as mesh
from vemesh.planning.fake_world import _forget_meshes
from vemesh.planning.user_code import user_frame

__all__ = ["reference"]

#: the dispatcher's namespaces of torch's collectives: c10d's (``dist.all_reduce``, ``dist.nn.functional``) and the
#: functional collectives' (``torch.distributed._functional_collectives``, DTensor's)
_COLLECTIVES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


@contextlib.contextmanager
def _one_rank_world(mesh_dims: tuple[str, ...] = ("DP",)) -> Iterator[None]:
    """A world of one gloo rank with ``VESCALE_DEVICE_MESH`` built on it, for a step that asks the mesh (its CP
    degree, its groups): the parallel run's mesh dims (``mesh_dims``), every one of size 1, so that a step that takes
    ``mesh["CP"]`` for ``context_parallel`` runs there as it is written. Undone after."""
    if dist.is_initialized():
        raise CheckInputError("vemesh check runs both worlds itself: call it before init_process_group (or from "
                              "another process), not inside a distributed job")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        ParallelDims(1, mesh_dims=mesh_dims).build("cpu", mesh)
        yield
    finally:
        mesh.reset()
        dist.destroy_process_group()
        _forget_meshes()


def reference(spec: Spec, factory: Any, step: Any, names: tuple[str, str, str]) -> dict:
    """The one-process run, on one thread as each rank of the parallel run is (a kernel's rounding depends on its
    threads: the figures are the same run after run); on the DP ranks' batches together where the step's collectives
    couple them (the module docstring). In what it returns, ``coupled`` names the first of those collectives (or is
    empty), ``apart`` why the DP ranks' batches were run apart all the same (or is empty), and ``unsplit`` counts the
    module outputs of the run together that had no DP rows to cut (not compared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _one_rank_world(dims(spec.world_size, spec.degrees, spec.dp_replicate).mesh_dims):
            ref = _reference_run(spec, factory, step, names)
            if not ref["coupled"] or spec.degrees["DP"] == 1:
                return ref | {"coupled": "", "apart": "", "unsplit": 0}
            if spec.degrees.get("PP", 1) > 1:
                return ref | {"apart": "under PP the step is given a schedule, whose batch the check does not cut",
                              "unsplit": 0}
            together = _together(spec, factory, step, names)
            return ref | {"apart": f"{together} could not be drawn per DP rank", "unsplit": 0} \
                if isinstance(together, str) else \
                together | {"coupled": ref["coupled"], "apart": "", "autocast": ref["autocast"]}
    finally:
        torch.set_num_threads(threads)


def _reference_run(spec: Spec, factory: Any, step: Any, names: tuple[str, str, str]) -> dict:
    torch.manual_seed(SEED)
    model = built(call("--model", names[0], factory, **spec.model_kwargs), names[0])
    dp = spec.degrees["DP"]
    outputs, dropouts, random_ops = [], 0, []
    # under PP the step takes a schedule: here torch's over one stage, the whole model, cutting the batch into the
    # parallel run's micro-batches (each schedule computes the loss of each and scales the gradients alike)
    piped = spec.degrees.get("PP", 1) > 1
    stepped = _whole_model_schedule(spec, model) if piped else model
    summed: dict[torch.nn.Parameter, torch.Tensor] = {}
    collectives, autocast = _Collectives(), set[str]()
    for d in range(dp):
        torch.manual_seed(SEED + 1 + d)
        with torch.compiler.set_stance("force_eager"), Recorder(model) as rec, Deterministic(rec) as det, \
                collectives, _as_wrapped(model), autocast_off(autocast):
            call("--step", names[2], step, stepped, spec.micro_batch_size * spec.micro_batches)
        if piped:  # torch's schedule scales the gradients held by 1 / micro-batches at its end: each DP rank's apart
            for p in model.parameters():
                if p.grad is not None:
                    summed[p] = summed[p] + p.grad if p in summed else p.grad
                    p.grad = None
        outputs.append(rec.outputs)
        dropouts += det.dropouts
        random_ops += det.random_ops
    for p, g in summed.items():
        p.grad = g
    grads = {n: None if g is None else g / dp for n, g in gradients(model).items()}
    return _record(model, rec, outputs, grads, dropouts, random_ops) | {"coupled": collectives.first,
                                                                       "autocast": sorted(autocast)}


def _record(model: torch.nn.Module, rec: Recorder, outputs: list, grads: dict, dropouts: int, random_ops: list) -> dict:
    dtypes = {p.dtype for p in model.parameters()}  # below, for the CP positions hint: an embedding's indices
    embeddings = {plain_name(n): rec.indices.get(plain_name(n)) for n, m in unwrap(model).named_modules()
                  if isinstance(m, torch.nn.Embedding)}
    return {"outputs": outputs, "grads": grads, "dropouts": dropouts, "random_ops": random_ops, "dtypes": dtypes,
            "embeddings": embeddings, "positions_arg": positions_argument(unwrap(model)), "params": rec.params,
            "parts": rec.read_parts}


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


#: the methods a step calls on its data-parallel wrapper (vemesh's or torch's DDP, FSDP2's ``FSDPModule``) and what
#: each is in one process, where nothing is synchronized: the step runs there on the model as built
_WRAPPER_METHODS: dict[str, Any] = {
    "no_sync": contextlib.nullcontext, "finish_grad_sync": _nothing, "set_requires_gradient_sync": _nothing,
    "set_is_last_backward": _nothing, "set_requires_all_reduce": _nothing, "set_reshard_after_forward": _nothing,
    "set_reshard_after_backward": _nothing, "unshard": _nothing, "reshard": _nothing,
}


@contextlib.contextmanager
def _as_wrapped(model: torch.nn.Module) -> Iterator[None]:
    """``model`` answering, for the step, what its data-parallel wrapper answers where it does not itself: the
    methods of :data:`_WRAPPER_METHODS`, ``zero_grad_buffer`` (vemesh DDP's), and ``module`` (DDP's wrapped model,
    the model itself). A step written for the wrapped model (``with model.no_sync():`` on every micro-batch but the
    last) runs in one process as written; before, it raised there ("'Sequential' object has no attribute
    'no_sync'")."""
    given = {name: method for name, method in _WRAPPER_METHODS.items() if not hasattr(model, name)}
    if not hasattr(model, "zero_grad_buffer"):
        given["zero_grad_buffer"] = lambda: model.zero_grad(set_to_none=False)
    if not hasattr(model, "module"):
        given["module"] = model  # in the instance's dict, not a submodule: nothing else of the model sees it
    model.__dict__.update(given)
    try:
        yield
    finally:
        for name in given:
            model.__dict__.pop(name, None)


def _together(spec: Spec, factory: Any, step: Any, names: tuple[str, str, str]) -> dict | str:
    """The step once, on the DP ranks' batches together (``DP x micro-batch`` rows, each rank's drawn from its own
    seed): one process's gradients on the whole batch, and each module's output cut into the DP ranks' rows. A draw
    that could not be made per rank, named, where it could not."""
    dp, micro = spec.degrees["DP"], spec.micro_batch_size
    torch.manual_seed(SEED)
    model = built(call("--model", names[0], factory, **spec.model_kwargs), names[0])
    with torch.compiler.set_stance("force_eager"), Recorder(model) as rec, Deterministic(rec) as det, \
            _RankDraws(rec, dp, micro) as draws, _as_wrapped(model), autocast_off(set()):
        call("--step", names[2], step, model, dp * micro)
    if draws.apart:
        return draws.apart
    outputs: list[dict] = [{} for _ in range(dp)]
    unsplit = 0  # outputs without the rows (a loss over them all, tokens flattened): not compared
    for key, out in rec.outputs.items():
        rows = next((i for i, n in enumerate(out.shape) if n == dp * micro), None)
        unsplit += rows is None
        for d, part in enumerate(out.chunk(dp, rows) if rows is not None else ()):
            outputs[d][key] = part
    return _record(model, rec, outputs, gradients(model), det.dropouts, det.random_ops) | {"unsplit": unsplit}


class _RankDraws(TorchFunctionMode):
    """Each random draw of the step outside every module, made as each DP rank's step makes it: from that rank's
    stream (torch's generator seeded ``SEED + 1 + d``, or the step's own generator as it was at its first draw), with
    the size it gives one rank's rows where the size or a tensor it is given has ``DP x micro-batch`` rows, joined
    along them. :attr:`apart` names a draw that gave the ranks other values it could not join."""

    def __init__(self, recorder: Recorder, dp: int, micro: int) -> None:
        super().__init__()
        self.recorder, self.dp, self.micro = recorder, dp, micro
        self.apart = ""
        default, seeded = torch.get_rng_state(), []
        for d in range(dp):
            torch.manual_seed(SEED + 1 + d)
            seeded.append(torch.get_rng_state())
        torch.set_rng_state(default)
        #: each DP rank's state of each stream: torch's generator (``id(None)``), and a generator of the step's own
        self._states: dict[int, list[torch.Tensor]] = {id(None): seeded}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func not in RANDOM_OPS or self.recorder.stack or self.apart:
            return func(*args, **kwargs)
        gen = kwargs.get("generator")
        get, put = (gen.get_state, gen.set_state) if gen is not None else (torch.get_rng_state, torch.set_rng_state)
        if id(gen) not in self._states:  # the step's own generator, as each rank's step finds it at its first draw
            self._states[id(gen)] = [get()] * self.dp
        states = self._states[id(gen)]
        rows = self.dp * self.micro
        parts, dim = [], None
        name = getattr(func, "__name__", str(func))
        inplace = name.endswith("_")
        for d in range(self.dp):
            put(states[d])
            a, k, dim = _per_rank(args, kwargs, rows, self.micro, d)
            out = func(*a, **k)
            parts.append(out.clone() if inplace and dim is None else out)  # in place on the whole: each rank's apart
            states[d] = get()
        if inplace:  # on each rank's rows of the tensor, or on the whole where every rank drew the same
            if dim is None and any(not torch.equal(parts[0], p) for p in parts[1:]):
                self.apart = _drawn(name)
            return args[0]
        if dim is not None:
            return torch.cat([p + d * self.micro for d, p in enumerate(parts)] if name == "randperm" else parts, dim)
        if any(not torch.equal(parts[0], p) for p in parts[1:]):
            self.apart = _drawn(name)
        return parts[0]


def _drawn(name: str) -> str:
    """``torch.NAME at file:line in function``, the user's line that drew it."""
    return f"torch.{name}{user_frame()}"


def _per_rank(args: tuple, kwargs: dict, rows: int, micro: int, d: int) -> tuple[tuple, dict, int | None]:
    """``args`` and ``kwargs`` as DP rank ``d``'s step gives them: the first size or tensor with ``rows`` along a dim
    given ``micro`` (its part of them); and that dim, or None where nothing had the rows."""
    found: list[int] = []

    def one(v: Any) -> Any:
        if found:
            return v
        if isinstance(v, torch.Tensor) and rows in v.shape:
            found.append(dim := list(v.shape).index(rows))
            return v.narrow(dim, d * micro, micro)
        if isinstance(v, (tuple, list, torch.Size)) and v and all(isinstance(n, int) for n in v) and rows in v:
            found.append(dim := list(v).index(rows))
            return type(v)(micro if i == dim else n for i, n in enumerate(v)) if not isinstance(v, torch.Size) \
                else torch.Size(micro if i == dim else n for i, n in enumerate(v))
        return v

    ints = bool(args) and all(isinstance(a, int) and not isinstance(a, bool) for a in args)
    if ints and rows in args and len(args) > 1:  # torch.randn(rows, 16): the size as separate numbers
        found.append(dim := list(args).index(rows))
        return tuple(micro if i == dim else n for i, n in enumerate(args)), kwargs, dim
    if ints and args == (rows,) and not kwargs.get("size"):  # torch.randperm(rows), torch.randn(rows)
        return (micro,), kwargs, 0
    a = tuple(one(v) for v in args)
    k = {n: one(v) for n, v in kwargs.items()}
    return a, k, found[0] if found else None


class _Collectives(TorchDispatchMode):
    """The first collective the step ran (a barrier aside) and the line of the user's code it came from. A send or
    a receive raises: in one process its peer is no rank, and gloo's receive would wait for it forever."""

    def __init__(self) -> None:
        super().__init__()
        self.first = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d" and func.__name__.startswith(("send", "recv")):
            raise RuntimeError(f"a point-to-point {func.__name__.split('.')[0].strip('_')} with another rank: one "
                               "process, where the check runs the step too, has no other rank, and would wait for it "
                               "forever; keep sends and receives out of the step (under PP, torch's schedule sends "
                               "what its stages need)")
        if not self.first and func.namespace in _COLLECTIVES and "barrier" not in func.__name__:
            self.first = func.__name__.split(".")[0].strip("_") + user_frame()
        return func(*args, **(kwargs or {}))


def _whole_model_schedule(spec: Spec, model: torch.nn.Module) -> Any:
    """torch's GPipe over one stage holding ``model`` on this one-rank world, with the parallel run's micro-batches
    and ``--loss``: what the user's PP step is given in one process."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = PipelineStage(_Logits(model), 0, 1, torch.device("cpu"), group=dist.group.WORLD)
    quiet_shape_inference(stage)
    return ScheduleGPipe(stage, spec.micro_batches, loss_fn=loss_of(spec))


class _Logits(torch.nn.Module):
    """The model as built, as one pipeline stage: a stage returns tensors, so a Hugging Face ``ModelOutput`` gives
    its ``logits`` (a tuple, its first tensor)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def __getattr__(self, name: str) -> Any:
        """The model's own attributes (a step that reads its stages' modules' ``config`` finds the model's)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def forward(self, *args: Any) -> torch.Tensor:
        out = self.model(*args)
        if isinstance(out, torch.Tensor):
            return out
        if getattr(out, "logits", None) is not None:
            return out.logits
        first = next((t for t in (out if isinstance(out, (tuple, list)) else ()) if isinstance(t, torch.Tensor)), None)
        if first is None:
            raise UserError(f"the model as built returned {type(out).__name__}; as the one-process pipeline stage it "
                            "must return the output the loss takes (a tensor, a ModelOutput with logits, or a tuple "
                            "whose first item is it)")
        return first
