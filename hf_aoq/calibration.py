"""Calibrated quantization of a whole model: GPTQ (hf_aoq.gptq) block by block on a small text sample.

`quantize_with_calibration(model, config, batches)` records the inputs of the first decoder
block once, then goes block by block: the block runs on its recorded inputs to collect the
inputs of its linears (so each block sees the blocks before it already quantized), each linear
is quantized by GPTQ from the Gram matrix of its inputs (H = X^T X, K x K, float32), and the
quantized block runs once more to make the next block's inputs. Memory is the float model, the
block inputs and one block's Gram matrices; time is about two forward passes plus the GPTQ sweeps.
GPTQ takes each weight's columns in act order (by descending input energy) unless `act_order=False`
asks for left to right (SmolLM2, bf16 30.99: int4 g128 mse 35.85 against 39.14, Int4DQ g32 31.12
against 31.94).
The weights are exactly what their config's tensor type stores (same format, same kernels).

Weights of hf_aoq.gptq.GPTQ_CONFIGS (Int4WeightOnlyConfig, IntxWeightOnlyConfig,
Int4DQWeightOnlyConfig) are calibrated by GPTQ (`quantize_planned(..., calibrate=names)`
limits it to some); static float8 activation scales
(`Float8StaticActivationFloat8WeightConfig(scale=None)`) are chosen first, on the float model
(hf_aoq.activation_scales); other configs in a recipe are quantized as `quantize_` would.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from .activation_scales import with_activation_scales
from .configs import (
    AOQBaseConfig,
    FqnToConfig,
    Int4DQWeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
)
from .core.errors import AOQError
from .gptq import GPTQ_CONFIGS, gptq_quantize
from .quantize import Decision, carry_out, plan, set_quantized
from .tensors.int4 import Int4Tensor


@dataclass
class CalibrationReport:
    """What calibration cost: wall time, tokens seen, peak Gram-matrix memory, layers done."""

    seconds: float = 0.0
    tokens: int = 0
    layers: int = 0
    gram_bytes_peak: int = 0
    calibrated: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"calibrated {len(self.calibrated)} weights by GPTQ in {self.layers} stages on {self.tokens} tokens "
            f"in {self.seconds:.1f} s (Gram matrices: {self.gram_bytes_peak / 2**20:.0f} MiB at most)"
        )


def gptq_int4(weight: torch.Tensor, gram: torch.Tensor, config: Int4WeightOnlyConfig, *, damping: float = 0.01,
              name: str = "weight") -> Int4Tensor:
    """GPTQ for an Int4WeightOnlyConfig weight (hf_aoq.gptq.gptq_quantize, kept under its old name)."""
    if not isinstance(config, Int4WeightOnlyConfig):
        raise AOQError(f"{name}: gptq_int4 takes an Int4WeightOnlyConfig, got {type(config).__name__}")
    return gptq_quantize(weight, gram, config, damping=damping, name=name)


# ---------------------------------------------------------------------- whole models
# The outermost numbered ModuleList in a name: `model.layers.3.mlp.experts.2.up_proj` is in block
# 3 of `model.layers` (its experts are calibrated together, inside that block).
_LAYER_INDEX = re.compile(r"^(.*?)\.(\d+)\.")


class _Stop(Exception):
    pass


def quantize_with_calibration(
    model: nn.Module,
    config: AOQBaseConfig | FqnToConfig,
    batches: Iterable[torch.Tensor],
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    damping: float = 0.01,
    log: Callable[[str], None] | None = None,
    method: str = "gptq",
    act_order: bool = True,
) -> CalibrationReport:
    """Quantize `model` in place like `quantize_(model, config, filter_fn)`, choosing every
    GPTQ_CONFIGS weight of a linear layer by GPTQ on `batches` (token id tensors [B, T] that `model(ids)`
    accepts). Returns what it cost.

    `method` picks what the calibration text chooses: "gptq" (this module), "awq" (activation-aware
    scales for Int4 and Int4DQ weights, hf_aoq.awq) or "smoothquant" (scales that move activation
    outliers into int8-dynamic weights, hf_aoq.smoothquant); the last two fold per-channel scales
    into llama-style blocks and return their own report (channel_scales.ScaleReport).

    Linears inside numbered blocks (`<prefix>.<i>.`, e.g. `model.layers.3.mlp.up_proj`) are done
    block by block: the inputs of block 0 are recorded once, and each block then runs on the
    outputs of the block before it, already quantized. Other calibrated linears are calibrated on a
    full forward pass at the end. `act_order` (default True): GPTQ takes each weight's columns in
    descending order of their input energy (hf_aoq.gptq.gptq_sweep); the groups and tensor types
    stay. False: left to right, what it did before (on SmolLM2, worse: Int4DQ g32 31.94 against
    31.12 in act order, bf16 30.99)."""
    if method != "gptq":
        return _scale_method(method)(model, config, batches, filter_fn=filter_fn, log=log)
    return quantize_planned(model, plan(model, config, filter_fn=filter_fn), batches, damping=damping,
                            act_order=act_order, log=log)


def quantize_planned(
    model: nn.Module,
    decisions: dict[str, Decision],
    batches: Iterable[torch.Tensor],
    *,
    calibrate: Iterable[str] | None = None,
    damping: float = 0.01,
    act_order: bool | Iterable[str] = True,
    log: Callable[[str], None] | None = None,
) -> CalibrationReport:
    """Carry out `decisions` (a plan of hf_aoq.quantize.plan) on `model` in place, the weights of
    GPTQ_CONFIGS that linears read chosen by GPTQ on `batches`, block by block (see
    quantize_with_calibration). `calibrate`: only these weight names are calibrated (None: all
    that can be); the rest are quantized as quantize_ would. `act_order`: GPTQ takes the columns
    in act order (hf_aoq.gptq.gptq_sweep) for every calibrated weight (True, the default), for
    none (False: left to right) or for these weight names."""
    batches = [b if b.ndim == 2 else b.unsqueeze(0) for b in batches]
    if not batches:
        raise AOQError("calibration needs at least one batch of token ids")
    report = CalibrationReport(tokens=sum(b.numel() for b in batches))
    start_time = time.perf_counter()
    device = next(model.parameters()).device
    batches = [b.to(device) for b in batches]
    decisions = with_activation_scales(model, decisions, batches)  # on the float model, before any change
    targets = _gptq_linears(model, decisions, None if calibrate is None else set(calibrate))
    in_act_order = (lambda n: act_order) if isinstance(act_order, bool) else (
        lambda n, names=frozenset(act_order): f"{n}.weight" in names)

    blocks: dict[str, dict[int, list[str]]] = {}
    rest = []
    for name in targets:
        m = _LAYER_INDEX.match(name)
        if m and isinstance(model.get_submodule(m.group(1)), nn.ModuleList):
            blocks.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(name)
        else:
            rest.append(name)

    with torch.no_grad():
        for prefix, by_index in blocks.items():
            layers = model.get_submodule(prefix)
            inputs = _record_inputs(model, layers[0], batches)
            for i in range(len(layers)):
                names = by_index.get(i, [])
                if names:
                    grams = _grams(targets, names, lambda: [layers[i](*a, **k) for a, k in inputs])
                    _quantize_from_grams(model, targets, names, grams, damping, in_act_order, report)
                    if log is not None:
                        log(f"calibrated {prefix}.{i} ({len(names)} weights)")
                if i + 1 < len(layers):
                    inputs = [_next_inputs(layers[i](*a, **k), a, k) for a, k in inputs]
            del inputs
        if rest:
            grams = _grams(targets, rest, lambda: [model(ids) for ids in batches])
            _quantize_from_grams(model, targets, rest, grams, damping, in_act_order, report)

    # Everything else in the plan (other configs, weights not only linears read) as quantize_ does.
    carry_out(model, {n: d for n, d in decisions.items() if n.removesuffix(".weight") not in targets})
    report.seconds = time.perf_counter() - start_time
    return report


CALIBRATION_METHODS = ("gptq", "awq", "smoothquant")


def calibrated_configs(method: str) -> tuple[type, ...]:
    """The config types whose weights `method` chooses (the rest are quantized as quantize_ does)."""
    if method == "gptq":
        return GPTQ_CONFIGS
    if method == "awq":
        return (Int4WeightOnlyConfig, Int4DQWeightOnlyConfig)
    if method == "smoothquant":
        return (Int8DynamicActivationInt8WeightConfig,)
    raise AOQError(f"calibration method must be one of {CALIBRATION_METHODS}, got {method!r}")


def _scale_method(method: str):
    if method == "awq":
        from .awq import quantize_with_awq
        return quantize_with_awq
    if method == "smoothquant":
        from .smoothquant import quantize_with_smoothquant
        return quantize_with_smoothquant
    raise AOQError(f"calibration method must be one of {CALIBRATION_METHODS}, got {method!r}")


def _gptq_linears(model, decisions: dict[str, Decision], only: set[str] | None) -> dict[str, tuple[nn.Linear, Decision]]:
    """{module name: (linear, decision)} for the planned GPTQ_CONFIGS weights that linears alone
    read (and that `only` names, when given)."""
    targets = {}
    for name, decision in decisions.items():
        module_fqn, _, leaf = name.rpartition(".")
        if only is not None and name not in only:
            continue
        if leaf == "weight" and decision.place and type(decision.config) in GPTQ_CONFIGS:
            targets[module_fqn] = (model.get_submodule(module_fqn), decision)
    return targets


def _record_inputs(model, first_layer, batches) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) the model passes to its first block, for each batch."""
    recorded = []

    def hook(module, args, kwargs):
        kwargs = dict(kwargs)
        for key in ("past_key_values", "past_key_value"):
            if key in kwargs:
                kwargs[key] = None  # no cache: each block runs once per batch, on its own
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        recorded.append((args, kwargs))
        raise _Stop()

    handle = first_layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in batches:
            try:
                try:
                    model(ids, use_cache=False)
                except TypeError as e:  # a plain nn.Module that takes no use_cache
                    if "use_cache" not in str(e):
                        raise
                    model(ids)
            except _Stop:
                pass
    finally:
        handle.remove()
    if len(recorded) != len(batches):
        raise AOQError("calibration: the model never reached its first block")
    return recorded


def _next_inputs(output, args, kwargs):
    hidden = output[0] if isinstance(output, (tuple, list)) else output
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _grams(targets, names, run) -> dict[str, torch.Tensor]:
    """X^T X of the inputs of each named linear over whatever `run()` feeds them."""
    grams: dict[str, torch.Tensor] = {}

    def collect(name):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            g = grams.get(name)
            grams[name] = x.t() @ x if g is None else g.addmm_(x.t(), x)
        return hook

    handles = [targets[n][0].register_forward_pre_hook(collect(n)) for n in names]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in grams]
    if missing:
        raise AOQError(f"calibration never reached {missing[:3]}")
    return grams


def _quantize_from_grams(model, targets, names, grams, damping, in_act_order, report) -> None:
    report.gram_bytes_peak = max(report.gram_bytes_peak, sum(g.numel() * 4 for g in grams.values()))
    for name in names:
        module, decision = targets[name]
        q = gptq_quantize(module.weight.data, grams.pop(name), decision.config, damping=damping,
                          act_order=in_act_order(name), name=f"{name}.weight")
        set_quantized(model, f"{name}.weight", decision, q)
        report.calibrated.append(name)
    report.layers += 1
