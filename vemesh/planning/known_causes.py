"""torch failures whose own words hide the user's mistake, and what to write instead: :func:`known_cause`, added to
the one line that names the user's function and frame (:func:`vemesh.planning.user_code.call`, ``vemesh check``'s
ranks)."""

from __future__ import annotations

import traceback

__all__ = ["FSDP1_INSTEAD", "INPLACE_ON_TP_OUTPUT", "known_cause", "said", "worded"]

#: what to write instead of torch's FSDP1, which vemesh plan and vemesh check do not take
FSDP1_INSTEAD = ("vemesh plan and vemesh check take FSDP2, torch's successor to it, which shards each unit's parameters "
                 "over the data ranks alike: call vemesh.parallel.fully_shard (or torch's fully_shard) on each block, "
                 "then on the root")

#: FSDP2's CPU offload, pinned (its default), traced for the CPU (``--device-type cpu``), or run where no function of
#: the user's is under :class:`vemesh.planning.user_code.OnThisCPU`
_PINNED = ("FSDP2's CPUOffloadPolicy pins the offloaded shards in host memory (pin_memory=True, its default), which "
           "needs an accelerator, and the planner does not plan CPU offload: plan the job without offload_policy, an "
           "upper bound of the device memory it holds")


#: torch failures whose words do not say the user's mistake: (the torch function the error left, the exception's
#: words it starts with) and what to write instead
_KNOWN = {
    ("_sync_params_and_buffers", "aten.cat.default got mixed torch.Tensor and DTensor"):
        "torch's DistributedDataParallel broadcasts the parameters in flat buffers, which cannot hold TP's DTensors "
        "beside plain tensors: wrap the model in vemesh.ddp.DistributedDataParallel(model, mesh['DP']) (an instance "
        "of torch's class, the group its second argument), which takes TP-sharded DTensor parameters, or shard it with "
        "vemesh.parallel.fully_shard",
    ("_verify_param_shape_across_processes", "The tensor has a non-zero number of elements"):
        "torch's DistributedDataParallel was built outside your parallelize function, where its check of the ranks' "
        "parameter shapes reads values a plan's fake tensors do not have: build it in the function --parallelize "
        "names, where the planner runs it as it is (vemesh.planning.torch_ddp)",
    ("_init_sharding_spec_tp", "Invariant encountered"):
        "FSDP2's fully_shard was given a mesh without dim names for a parameter that TP already shards (torch's "
        "fully_shard without mesh= shards over every rank of the world, TP peers included); shard over the data "
        "dims beside TP: vemesh.parallel.fully_shard(module), which takes this rank's, or torch's "
        "fully_shard(module, mesh=VESCALE_DEVICE_MESH['DP'])",
    ("_init_sharding_spec_tp", "Cannot concatenate overlapping meshes"):
        "FSDP2's fully_shard was given a mesh that holds a dim TP already shards this parameter over (mesh['TP']): "
        "FSDP2 shards over the data dims beside TP: vemesh.parallel.fully_shard(module), which takes this rank's, or "
        "torch's fully_shard(module, mesh=VESCALE_DEVICE_MESH['DP'])",
    ("parallelize_module", "`placements` must have the same length as `device_mesh.ndim`!"):
        "torch's TP styles split a module over one mesh dim, and parallelize_module was given the whole mesh: give it "
        "the TP dim, parallelize_module(module, mesh['TP'], plan)",
    ("parallelize_module", "Cannot distribute a DTensor with device mesh"):
        "a TP style met a parameter that is already a DTensor over another mesh (FSDP2's fully_shard, or another "
        "style, ran on it first): apply the TP plan first and then fully_shard, as torchtitan does",
    ("_init_sharded_param", "Cannot access accelerator device when none is available"): _PINNED,
    ("_init_sharded_param", "NYI: aten._pin_memory.default"): _PINNED,
    ("__torch_dispatch__", "Trying to backward an extra time. You are only allowed to backward once on any region "
     "computed under selective activation checkpoint"):
        "a zero-bubble schedule (interleaved-zb, zbv, dualpipev) runs two backward passes through each stage, the "
        "input's and then the weights', and torch's selective activation checkpoint allows one; checkpoint those "
        "blocks whole (torch.utils.checkpoint without a context_fn), or choose gpipe, 1f1b or interleaved-1f1b",
}


#: what autograd says where a TP style's output, a view made by ``DTensor.to_local()``, is changed in place
INPLACE_ON_TP_OUTPUT = "of _ToTorchTensor is a view and is being modified inplace"
#: torch.cuda's own functions on this CUDA-less machine
_NO_CUDA = ("vemesh plan and vemesh check run your functions on this machine's CPU: a device they name (device='cuda', "
            ".to('cuda'), .cuda(), model.to(device)) is the CPU there, but torch.cuda's own functions "
            "(torch.cuda.synchronize(), current_device(), set_device(), events, streams, memory statistics) need "
            "CUDA: keep them out of the factory, the parallelize function and the step")
#: where torch fails in these, its text past the first line is about other uses than a plan's
_FIRST_LINE_ONLY = ("_verify_param_shape_across_processes",)
#: torch failures known by a phrase of their message wherever they are raised (autograd's, from C++) -> what to write
_KNOWN_ANYWHERE = {
    "FSDP needs a non-CPU accelerator device":
        "torch's FullyShardedDataParallel (FSDP1) needs an accelerator, and your functions run on this machine's CPU "
        f"here; {FSDP1_INSTEAD}",
    "Torch not compiled with CUDA enabled": _NO_CUDA,
    "Tried to instantiate dummy base class": _NO_CUDA,  # torch.cuda.Event, torch.cuda.Stream
    "has no attribute '_cuda_": _NO_CUDA,  # torch.cuda's memory statistics
    "FlexAttention does not support backward on CPU":
        "vemesh check runs on this machine's CPU and vemesh plan traces on fake CPU tensors, where torch's "
        "FlexAttention has no backward: check and plan the model with SDPA attention (HF's "
        "attn_implementation='sdpa', a factory argument), which holds what flex's fused kernel holds (the output and "
        "its log-sum-exp) and computes the same attention under a causal mask",
    INPLACE_ON_TP_OUTPUT:
        "a TP style's output (DTensor.to_local(), a view made inside an autograd Function) is written in place by the "
        "model at that line (Falcon adds its attention's output into its MLP's with +=), which autograd refuses: "
        "have the module whose output is written return a copy, "
        "module.register_forward_hook(lambda module, args, out: out.clone()) (one activation copied a call; "
        "vemesh check tries it on the RowwiseParallel Linears there)",
}


def known_cause(error: BaseException) -> str:
    """``"; <what to write instead>"`` when ``error`` is a torch failure whose own words hide the user's mistake
    (FSDP2's fully_shard over the whole world on a TP-sharded model raises ``Invariant encountered: value was None``;
    Falcon's in-place add onto a TP style's output, autograd's ``is a view and is being modified inplace``); else
    ''."""
    text = str(error)
    for phrase, say in _KNOWN_ANYWHERE.items():
        if phrase in text:
            return f"; {say}"
    for frame in traceback.extract_tb(error.__traceback__):
        for (function, start), say in _KNOWN.items():
            if frame.name == function and text.startswith(start):
                return f"; {say}"
    return ""


def said(error: BaseException) -> str:
    """``error``'s text, its first line only where torch's failure there is one a known cause explains (torch's DDP
    on fake tensors goes on about custom kernels and Caffe2)."""
    text = str(error)
    if any(frame.name in _FIRST_LINE_ONLY for frame in traceback.extract_tb(error.__traceback__)):
        return text.strip().splitlines()[0] if text.strip() else text
    return text


def worded(error: BaseException) -> str:
    """``error``'s text (:func:`said`) and its known cause (:func:`known_cause`), if any, after it."""
    cause = known_cause(error)
    return f"{said(error).rstrip().rstrip('.!')}{cause}" if cause else said(error)
