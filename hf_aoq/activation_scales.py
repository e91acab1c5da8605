"""Static activation scales: the per-tensor float8 scale of each linear's input, chosen on text.

`Float8StaticActivationFloat8WeightConfig(scale=None)` quantizes a linear's activations with a
fixed scale; calibration picks it as max |x| over the linear's inputs on the calibration batches
divided by the float8 format's largest value (nothing the calibration saw clips), running the
float model once with a hook on each such linear. The scale then goes into the config of that
weight, and from there into its Float8Tensor's `act_scale`, which the checkpoint records.

`calibrate_activation_scales` is the public step (a recipe with every scale filled in, for
`quantize_`); `hf_aoq.calibration.quantize_with_calibration` (and so `AOQConfig(calibration=...)`)
runs `with_activation_scales` on its plan before anything is quantized.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch
from torch import nn

from .configs import AOQBaseConfig, Float8StaticActivationFloat8WeightConfig, FqnToConfig
from .core.errors import AOQError
from .quantize import Decision, plan


def _needs_scale(decision: Decision) -> bool:
    cfg = decision.config
    return isinstance(cfg, Float8StaticActivationFloat8WeightConfig) and cfg.scale is None


def with_activation_scales(
    model: nn.Module, decisions: dict[str, Decision], batches: Iterable[torch.Tensor]
) -> dict[str, Decision]:
    """`decisions` (from `quantize.plan`) with every static float8 config that has no scale given
    one, from `model(ids)` (the float model) on each batch of token ids."""
    targets: dict[str, str] = {}  # module name -> parameter name
    for name, decision in decisions.items():
        if not _needs_scale(decision):
            continue
        module_fqn, _, leaf = name.rpartition(".")
        if leaf != "weight" or not decision.place or not isinstance(model.get_submodule(module_fqn), nn.Linear):
            raise AOQError(f"{name}: Float8StaticActivationFloat8WeightConfig calibrates the inputs of nn.Linear "
                           "weights only; give this one a scale or another config")
        targets[module_fqn] = name
    if not targets:
        return decisions
    amax: dict[str, torch.Tensor] = {}

    def record(module_fqn):
        def hook(module, args):
            m = args[0].detach().abs().amax().float()
            amax[module_fqn] = m if module_fqn not in amax else torch.maximum(amax[module_fqn], m)
        return hook

    handles = [model.get_submodule(m).register_forward_pre_hook(record(m)) for m in targets]
    device = next(model.parameters()).device
    seen = 0
    try:
        with torch.no_grad():
            for ids in batches:
                model((ids if ids.ndim == 2 else ids.unsqueeze(0)).to(device))
                seen += 1
    finally:
        for h in handles:
            h.remove()
    if not seen:
        raise AOQError("calibrating static activation scales needs at least one batch of token ids")
    missing = sorted(set(targets) - set(amax))
    if missing:
        raise AOQError(f"calibration never reached {missing[:3]}: their static activation scales cannot be chosen")
    out = dict(decisions)
    for module_fqn, name in targets.items():
        cfg = decisions[name].config
        peak = float(amax[module_fqn])
        if not peak < float("inf"):
            raise AOQError(f"{module_fqn}: its calibration inputs are not finite; no static activation scale fits")
        scale = max(peak, 1e-12) / torch.finfo(cfg.activation_dtype).max
        out[name] = dataclasses.replace(decisions[name], config=dataclasses.replace(cfg, scale=scale))
    return out


def calibrate_activation_scales(
    model: nn.Module,
    config: AOQBaseConfig | FqnToConfig,
    batches: Iterable[torch.Tensor],
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> FqnToConfig:
    """The recipe that `quantize_(model, config, filter_fn)` would follow, as an FqnToConfig of
    exact parameter names, with every Float8StaticActivationFloat8WeightConfig(scale=None)
    given the scale chosen on `batches` (token id tensors [B, T] that `model(ids)` accepts) by
    the float model. Quantize with `quantize_(model, recipe)` afterwards."""
    decisions = with_activation_scales(model, plan(model, config, filter_fn=filter_fn), batches)
    return FqnToConfig({n: d.config for name, d in decisions.items() for n in (name, *d.tied)})
