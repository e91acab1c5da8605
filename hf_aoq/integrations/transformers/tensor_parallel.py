"""Loading hf_aoq weights under transformers' tensor parallelism (`tp_plan="auto"` or
`distributed_config=DistributedConfig(tp_plan="auto")`).

transformers makes each sharded parameter a DTensor placeholder and cuts every stored tensor
to the rank's part on read, with the parameter's placement. That is right for a float weight
but not for a quantized one's fields: a per-row scale [N, 1] under a cut of the columns, a
per-tensor float, or Int4DQ's row parameters would be cut too. So for the parameters hf_aoq
builds, `TensorParallelLoad` hides the placeholder from the reader (transformers then hands
over the whole stored value, one parameter at a time), and `local_shard` cuts the built
quantized tensor to this rank's part, codes and scales together, refusing a cut inside a group
(hf_aoq.tensors.sharding). transformers wraps the shard in a DTensor like the placeholder, and
the module runs its forward on the local shard (`_hf_quantized_needs_local_tp`).

The same path loads fused MoE experts [E, N, K] under the MoE plans: TP's `packed_colwise`
(a strided shard of dim 1) and `rowwise` (dim 2) on the experts, and EP's `grouped_gemm`
(dim 0, on the expert-parallel mesh: whole experts per rank).

Quantize-on-load quantizes the whole weight, then cuts it, so every rank's shard is exactly the
single-process model's: the per-tensor parameters (Int4DQ's, a per-tensor float8 scale) are
those of the whole weight.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ...core.errors import AOQError
from ...core.tensor import AOQTensor
from ...tensors import sharding
from ...tensors.experts import TransposedExperts


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return None
    return DTensor


def _ranges(param, name: str) -> dict[int, list[tuple[int, int]]]:
    """{tensor dim: this rank's [start, end) intervals along it} for the DTensor `param`
    (contiguous shards, and the strided shards of fused projections), in order."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    mesh = param.device_mesh
    out: dict[int, list[tuple[int, int]]] = {}
    for mesh_dim, placement in enumerate(param.placements):
        strided = isinstance(placement, _StridedShard)
        if not (strided or placement.is_shard()):
            if placement.is_replicate():
                continue
            raise AOQError(f"{name}: hf_aoq cannot load a quantized weight with placement {placement}")
        dim = placement.dim % param.ndim
        if dim in out:
            raise AOQError(f"{name}: hf_aoq cannot load a quantized weight sharded twice along dim {dim} "
                           f"({list(param.placements)})")
        size, rank, world = param.shape[dim], mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim)
        split = placement.split_factor if strided else 1
        width = -(-size // split)
        intervals = []
        for g in range(split):
            lo, hi = g * width, min((g + 1) * width, size)
            if hi <= lo:
                continue
            n, offset = Shard.local_shard_size_and_offset(hi - lo, world, rank)
            if n:
                intervals.append((lo + offset, lo + offset + n))
        out[dim] = intervals
    return out


def check_plan(layout: AOQTensor, param, name: str) -> None:
    """Refuse, before anything is read, a placement of `param` that would cut a group of the
    quantized weight `layout` (the weight itself, or a probe of fewer rows with its layout)."""
    for dim, intervals in _ranges(param, name).items():
        for start, end in intervals:
            sharding.check_cut(layout.to_canonical(), dim, start, end, name, shape=tuple(param.shape))


def probe_layout(config, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> AOQTensor:
    """`config` applied to a one-row random weight with the input dimension of `shape` (one
    expert of one row for fused experts): the block layout a quantize-on-load weight will have,
    for `check_plan`."""
    gen = torch.Generator().manual_seed(0)
    with torch.device("cpu"):
        probe = torch.randn(*(1,) * (len(shape) - 1), shape[-1], generator=gen).to(dtype)
        return config.quantize_weight(probe, name=name)


def local_shard(tensor: AOQTensor, param, name: str, *, transposed: bool = False) -> AOQTensor:
    """This rank's part of the whole quantized weight `tensor`, cut as the DTensor placeholder
    `param` is sharded; an AOQError naming `name` if the cut would split a group. `transposed`:
    `tensor` is stored as the transpose of the 3-D parameter (stored_transposed experts), which
    only expert parallelism (dim 0, whole experts) may cut."""
    want = tuple(param.shape)[:-2] + tuple(param.shape)[:-3:-1] if transposed else tuple(param.shape)
    if tuple(tensor.shape) != want:
        raise AOQError(f"{name}: a quantized weight of shape {tuple(tensor.shape)} for a parameter of "
                       f"shape {tuple(param.shape)}")
    ranges = _ranges(param, name)
    if transposed and set(ranges) - {0}:
        raise AOQError(f"{name} is stored transposed (quantization_config.stored_transposed); hf_aoq shards such "
                       f"tensors by whole experts only (expert parallelism), not along dims {sorted(set(ranges) - {0})}")
    out = tensor.to_canonical()
    for dim, intervals in ranges.items():
        for start, end in intervals:
            sharding.check_cut(out, dim, start, end, name)
        pieces = [out.slice_fields(dim, start, end) for start, end in intervals]
        if not pieces:
            raise AOQError(f"{name}: this rank holds no part of dim {dim} (size {out.shape[dim]}); "
                           f"use fewer ranks")
        out = pieces[0] if len(pieces) == 1 else sharding.cat_fields(pieces, dim)
    # A slice is a view of the whole weight's fields: copy, so the whole one can be freed.
    return out.apply_to_tensors(lambda t: t.contiguous().clone())


class TensorParallelLoad:
    """While weights load, transformers' view of the model (its state_dict) shows the whole
    meta parameter instead of the DTensor placeholder for the parameters hf_aoq builds, so it
    reads them whole; the placeholders are kept in `targets` for `local_shard`."""

    def __init__(self, model: nn.Module, layouts: Callable[[str], AOQTensor], names):
        self.names = set(names)
        self.layouts = layouts  # name -> the quantized layout it will have (check_plan)
        self.targets: dict[str, torch.Tensor] = {}
        # torch marks the hook it is given, which a bound method cannot take.
        self._handle = model.register_state_dict_post_hook(lambda *args: self._hook(*args))

    def _hook(self, module, state_dict, prefix, local_metadata):
        DTensor = _dtensor_type()
        if DTensor is None:
            return
        for name in sorted(self.names):  # the first one a plan cuts is the one named
            key = prefix + name
            value = state_dict.get(key)
            if isinstance(value, DTensor) and value.device.type == "meta":
                if name not in self.targets:
                    check_plan(self.layouts(name), value, name)
                self.targets[name] = value
                state_dict[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")

    def shard(self, name: str, tensor: AOQTensor, *, transposed: bool = False) -> AOQTensor:
        target = self.targets.get(name)
        return tensor if target is None else local_shard(tensor, target, name, transposed=transposed)

    def finish(self, model: nn.Module) -> None:
        """Stop hiding placeholders; have every module holding a quantized shard run its forward
        on local tensors, as transformers' TP layers do for quantized weights."""
        self._handle.remove()
        DTensor = _dtensor_type()
        if DTensor is None or not self.targets:
            return
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                # transformers' local path would look up ids this rank does not hold; under
                # DTensor a vocabulary shard masks them (aten.embedding in tensors.sharding).
                continue
            for p in module._parameters.values():
                if isinstance(p, DTensor) and isinstance(_stored(p.to_local()), AOQTensor):
                    module._hf_quantized_needs_local_tp = True


def _stored(local):
    """The quantized tensor under a stored_transposed view (TransposedExperts); else `local`."""
    return local.experts if isinstance(local, TransposedExperts) else local


def refuse_sharded_calibration(model: nn.Module) -> None:
    """GPTQ runs the model block by block on the float weights it then replaces: not on shards."""
    DTensor = _dtensor_type()
    if DTensor is not None and any(isinstance(p, DTensor) for p in model.parameters()):
        raise AOQError("AOQConfig(calibration=...) cannot run on a model loaded with a tp_plan: quantize with "
                       "calibration in one process, save, and load that checkpoint with the tp_plan")


def refuse_sharded_save(state: dict) -> None:
    """Saving gathers nothing: a model loaded sharded is saved from the single-process load."""
    DTensor = _dtensor_type()
    sharded = [k for k, v in state.items() if DTensor is not None and isinstance(v, DTensor)
               and isinstance(_stored(v.to_local()), AOQTensor)]
    if sharded:
        raise AOQError(
            f"{sharded[0]} (and {len(sharded) - 1} more) are tensor-parallel shards of quantized weights; hf_aoq "
            f"saves a quantized model loaded in one process (load the checkpoint without tp_plan to save it)"
        )
