"""Calibrated int4: GPTQ-style error feedback on a small text sample.

For a linear layer with weight W [N, K] and calibration inputs X [T, K], rounding one input
column of W changes the output by (w_col - q_col) x_col. GPTQ quantizes the columns in order
and, after each, spreads its rounding error over the columns not yet quantized so that the
layer's output on X changes as little as possible; the weights are then exactly what
`Int4Tensor` stores (same format, same kernels), only chosen with data.

`quantize_with_calibration(model, config, batches)` records the inputs of the first decoder
block once, then goes block by block: the block runs on its recorded inputs to collect the
inputs of its linears (so each block sees the blocks before it already quantized), each linear
is quantized from the Gram matrix of its inputs (H = X^T X, K x K, float32), and the quantized
block runs once more to make the next block's inputs. Memory is the float model, the block
inputs and one block's Gram matrices; time is about two forward passes plus the GPTQ sweeps.

Only `Int4WeightOnlyConfig` weights are calibrated by GPTQ; static float8 activation scales
(`Float8StaticActivationFloat8WeightConfig(scale=None)`) are chosen first, on the float model
(hf_aoq.activation_scales); other configs in a recipe are quantized as `quantize_` would.
"""
from __future__ import annotations

import contextlib
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
from .core.primitives import pack_int4
from .quantize import Decision, carry_out, plan, set_quantized
from .tensors.int4 import QMAX, QMIN, Int4Tensor, choose_int4_qparams

MID = (QMIN + QMAX + 1) // 2


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
            f"calibrated {len(self.calibrated)} int4 weights in {self.layers} stages on {self.tokens} tokens "
            f"in {self.seconds:.1f} s (Gram matrices: {self.gram_bytes_peak / 2**20:.0f} MiB at most)"
        )


def gptq_int4(
    weight: torch.Tensor,
    gram: torch.Tensor,
    config: Int4WeightOnlyConfig,
    *,
    damping: float = 0.01,
    name: str = "weight",
) -> Int4Tensor:
    """Quantize `weight` [N, K] to an Int4Tensor that minimises the output error on inputs whose
    Gram matrix is `gram` [K, K]. Groups are chosen by `config` (its group size, symmetry and
    parameter search) on the weights as updated by the error feedback so far."""
    n, k = weight.shape
    if gram.shape != (k, k):
        raise AOQError(f"{name}: Gram matrix of shape {tuple(gram.shape)} does not match weight {n}x{k}")
    g = config.group_size
    w = weight.detach().float().clone()
    h = gram.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0  # an input that was always zero: its column cannot matter
    w[:, dead] = 0.0
    h.diagonal().add_(damping * torch.diag(h).mean())
    hinv = _upper_cholesky_of_inverse(h, name)

    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scales, zeros = [], []
    for start in range(0, k, g):
        end = min(start + g, k)
        block = w[:, start:end]  # updated by the feedback from the columns before it
        scale, zero = choose_int4_qparams(block, config, weight.dtype, name=name)
        s = scale.float()
        z = zero.float() if zero is not None else torch.zeros_like(s)
        scales.append(scale)
        zeros.append(zero)
        hb = hinv[start:end, start:end]
        errors = torch.empty_like(block)
        # One column at a time: many tiny ops, which extra threads only slow down (measured
        # 20x slower on a busy 2-core machine); the block update after it uses them all.
        with _single_thread():
            for i in range(end - start):
                col = block[:, i]
                q = torch.round((col - z[:, 0]) / s[:, 0]).add_(MID).clamp_(QMIN, QMAX)
                codes[:, start + i] = q.to(torch.uint8)
                err = (col - ((q - MID) * s[:, 0] + z[:, 0])) / hb[i, i]
                block[:, i:] -= err[:, None] * hb[i, i:][None, :]
                errors[:, i] = err
        w[:, end:] -= errors @ hinv[start:end, end:]
    scale = torch.cat(scales, dim=1)
    zero = None if config.symmetric else torch.cat(zeros, dim=1)
    return Int4Tensor(pack_int4(codes), scale, (1, g), tuple(weight.shape), weight.dtype, zero=zero)


@contextlib.contextmanager
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _upper_cholesky_of_inverse(h: torch.Tensor, name: str) -> torch.Tensor:
    for extra in (0.0, 0.1, 1.0):
        hh = h if extra == 0 else h + torch.eye(h.shape[0], device=h.device) * extra * torch.diag(h).mean()
        chol, info = torch.linalg.cholesky_ex(hh)
        if int(info) == 0:
            inv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0:
                return upper
    raise AOQError(f"{name}: the calibration inputs' Gram matrix is not positive definite even after damping")


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
) -> CalibrationReport:
    """Quantize `model` in place like `quantize_(model, config, filter_fn)`, choosing every int4
    weight of a linear layer by GPTQ on `batches` (token id tensors [B, T] that `model(ids)`
    accepts). Returns what it cost.

    `method` picks what the calibration text chooses: "gptq" (this module), "awq" (activation-aware
    scales for Int4 and Int4DQ weights, hf_aoq.awq) or "smoothquant" (scales that move activation
    outliers into int8-dynamic weights, hf_aoq.smoothquant); the last two fold per-channel scales
    into llama-style blocks and return their own report (channel_scales.ScaleReport).

    Linears inside numbered blocks (`<prefix>.<i>.`, e.g. `model.layers.3.mlp.up_proj`) are done
    block by block: the inputs of block 0 are recorded once, and each block then runs on the
    outputs of the block before it, already quantized. Other int4 linears are calibrated on a
    full forward pass at the end."""
    if method != "gptq":
        return _scale_method(method)(model, config, batches, filter_fn=filter_fn, log=log)
    batches = [b if b.ndim == 2 else b.unsqueeze(0) for b in batches]
    if not batches:
        raise AOQError("calibration needs at least one batch of token ids")
    report = CalibrationReport(tokens=sum(b.numel() for b in batches))
    start_time = time.perf_counter()
    decisions = plan(model, config, filter_fn=filter_fn)
    device = next(model.parameters()).device
    batches = [b.to(device) for b in batches]
    decisions = with_activation_scales(model, decisions, batches)  # on the float model, before any change
    targets = _int4_linears(model, decisions)

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
                    _quantize_from_grams(model, targets, names, grams, damping, report)
                    if log is not None:
                        log(f"calibrated {prefix}.{i} ({len(names)} weights)")
                if i + 1 < len(layers):
                    inputs = [_next_inputs(layers[i](*a, **k), a, k) for a, k in inputs]
            del inputs
        if rest:
            grams = _grams(targets, rest, lambda: [model(ids) for ids in batches])
            _quantize_from_grams(model, targets, rest, grams, damping, report)

    # Everything else in the plan (other configs, weights not only linears read) as quantize_ does.
    carry_out(model, {n: d for n, d in decisions.items() if n.removesuffix(".weight") not in targets})
    report.seconds = time.perf_counter() - start_time
    return report


CALIBRATION_METHODS = ("gptq", "awq", "smoothquant")


def calibrated_configs(method: str) -> tuple[type, ...]:
    """The config types whose weights `method` chooses (the rest are quantized as quantize_ does)."""
    if method == "gptq":
        return (Int4WeightOnlyConfig,)
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


def _int4_linears(model, decisions: dict[str, Decision]) -> dict[str, tuple[nn.Linear, Decision]]:
    """{module name: (linear, decision)} for the planned int4 weights that linears alone read."""
    targets = {}
    for name, decision in decisions.items():
        module_fqn, _, leaf = name.rpartition(".")
        if leaf == "weight" and decision.place and isinstance(decision.config, Int4WeightOnlyConfig):
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


def _quantize_from_grams(model, targets, names, grams, damping, report) -> None:
    report.gram_bytes_peak = max(report.gram_bytes_peak, sum(g.numel() * 4 for g in grams.values()))
    for name in names:
        module, decision = targets[name]
        q = gptq_int4(module.weight.data, grams.pop(name), decision.config, damping=damping, name=f"{name}.weight")
        set_quantized(model, f"{name}.weight", decision, q)
        report.calibrated.append(name)
    report.layers += 1
