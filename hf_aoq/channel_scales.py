"""Per-input-channel scales folded into llama-style decoder blocks, chosen block by block on
calibration text: the shared walk of AWQ (hf_aoq.awq) and SmoothQuant (hf_aoq.smoothquant).

A linear computes x @ W^T; for any positive s over its input channels, (x / s) @ (W * s)^T is the
same product, and W * s may quantize better. The division is free where the previous module
produces x channel by channel, so its output channels can be divided by s in its own weights:

    input_layernorm          -> self_attn.q_proj, k_proj, v_proj   (RMSNorm weight / s)
    self_attn.v_proj         -> self_attn.o_proj                   (v rows / s; with grouped
                                                                    KV heads, one s per KV channel,
                                                                    repeated over its query heads)
    post_attention_layernorm -> mlp.gate_proj, up_proj
    mlp.up_proj              -> mlp.down_proj                      (up rows / s: down's input is
                                                                    act(gate) * up)

The pairs are found by name and shape, and every block is then checked by running a float32 copy
of it before and after folding random scales: a pair whose fold does not leave the output
unchanged (a norm computing (1 + weight), an MLP without the product) cannot fold. What happens to
its consumers, and to every linear of a block that is not llama-style, is the method's choice:
a method with `stores_scales` (AWQ) chooses scales for each such linear on its own input and
stores them with the weight (Int4Tensor / Int4DQTensor `input_scale`: the codes hold W * s and the
forward divides its input by s; docs/format.md); one without (SmoothQuant, whose Int8Tensor has no
such field) refuses the block with an AOQError before anything in the model changes. Folded
scales add nothing to the checkpoint; stored ones add K float32 numbers to a weight.

`quantize_with_scales(model, config, batches, method)` records block 0's inputs, then per block:
runs it on its inputs (quantized blocks before it) while `method.collect` summarises each pair's
input activations, asks `method.choose` for each pair's scales, folds them, quantizes the block's
weights by the plan, and runs the quantized block for the next block's inputs.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch
from torch import nn

from .configs import AOQBaseConfig, FqnToConfig
from .core.errors import AOQError
from .quantize import Decision, carry_out, plan, set_quantized
from .tensors.common import with_input_scale

# Relative error allowed between a float32 block and the same block with random scales folded in:
# float32 rounding is about 1e-6; a fold that is wrong is off by tens of percent.
_FOLD_TOLERANCE = 1e-3


@dataclass
class ScalePair:
    """One place to fold scales: `producer` (a norm or a linear) divides its output channels,
    the `consumers` (linear names within the block) multiply their input columns."""

    producer: str  # name within the block, e.g. "input_layernorm" or "self_attn.v_proj"; "" = stored
    consumers: tuple[str, ...]
    repeat: int = 1  # query heads per KV head (v_proj -> o_proj); 1 elsewhere
    head_dim: int = 0

    @property
    def stored(self) -> bool:
        """No producer can absorb the scales: the one consumer keeps them as its input_scale."""
        return not self.producer

    @property
    def key(self) -> str:
        return self.producer or f"{self.consumers[0]} (stored)"

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """The consumers' input scales [K] from the producer's output scales [C]."""
        if self.repeat == 1:
            return s
        return s.view(-1, 1, self.head_dim).expand(-1, self.repeat, -1).reshape(-1)

    def reduce(self, stat: torch.Tensor, how: str = "mean") -> torch.Tensor:
        """A per-input-channel statistic of the consumers [K] as one per producer channel [C]."""
        if self.repeat == 1:
            return stat
        v = stat.view(-1, self.repeat, self.head_dim)
        return v.mean(1).reshape(-1) if how == "mean" else v.amax(1).reshape(-1)


class ScaleMethod(Protocol):
    name: str
    stores_scales: bool  # True: linears whose scales cannot fold keep them as input_scale

    def accepts(self, config: AOQBaseConfig) -> bool: ...
    def collect(self, x: torch.Tensor, state): ...  # x [T, K] float32; returns the new state
    def choose(self, pair: ScalePair, weights: dict[str, torch.Tensor], configs: dict[str, AOQBaseConfig],
               state) -> tuple[torch.Tensor, dict]: ...  # the producer's scales [C] (float32, > 0), and a note


@dataclass
class ScaleReport:
    """What calibration did: wall time, tokens seen, blocks and weights done, the scales' spread."""

    method: str = ""
    seconds: float = 0.0
    tokens: int = 0
    layers: int = 0
    calibrated: list[str] = field(default_factory=list)
    pairs: int = 0
    stored: list[str] = field(default_factory=list)  # weights that keep their scales as input_scale
    choices: list = field(default_factory=list)  # per pair, what `choose` reported (e.g. AWQ's alpha)

    def summary(self) -> str:
        stored = f", stored them with {len(self.stored)} weights" if self.stored else ""
        return (f"{self.method}: folded scales into {self.pairs} places of {self.layers} blocks{stored} for "
                f"{len(self.calibrated)} weights on {self.tokens} tokens in {self.seconds:.1f} s")


def llama_pairs(block: nn.Module, where: str) -> list[ScalePair]:
    """The foldable pairs of a llama-style decoder block, or an AOQError that says what is missing."""
    def linear(name):
        m = _get(block, name)
        return m if isinstance(m, nn.Linear) else None

    needed = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
              "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    missing = [n for n in needed if _get(block, n) is None or (n.endswith("_proj") and linear(n) is None)]
    if missing:
        raise AOQError(f"{where}: not a llama-style decoder block (no {', '.join(missing)}); activation-aware "
                       "scales fold into input_layernorm -> q/k/v, v_proj -> o_proj, post_attention_layernorm -> "
                       "gate/up and up_proj -> down_proj; use calibration_method='gptq' or no calibration")
    hidden = linear("self_attn.q_proj").in_features
    for norm in ("input_layernorm", "post_attention_layernorm"):
        w = getattr(_get(block, norm), "weight", None)
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (hidden,):
            raise AOQError(f"{where}.{norm}: expected a norm with a weight of shape ({hidden},), "
                           f"got {None if w is None else tuple(w.shape)}")
    pairs = [ScalePair("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
             ScalePair("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))]
    v, o = linear("self_attn.v_proj"), linear("self_attn.o_proj")
    head_dim = getattr(_get(block, "self_attn"), "head_dim", None)
    if v.out_features == o.in_features:
        pairs.append(ScalePair("self_attn.v_proj", ("self_attn.o_proj",)))
    elif isinstance(head_dim, int) and head_dim > 0 and o.in_features % v.out_features == 0 \
            and v.out_features % head_dim == 0:
        pairs.append(ScalePair("self_attn.v_proj", ("self_attn.o_proj",), o.in_features // v.out_features, head_dim))
    if linear("mlp.up_proj").out_features == linear("mlp.down_proj").in_features:
        pairs.append(ScalePair("mlp.up_proj", ("mlp.down_proj",)))
    return pairs


def _get(block: nn.Module, name: str):
    try:
        return block.get_submodule(name)
    except AttributeError:
        return None


@torch.no_grad()
def fold(block: nn.Module, pair: ScalePair, s: torch.Tensor) -> None:
    """Divide the producer's output channels by `s` and multiply the consumers' inputs by it."""
    producer = block.get_submodule(pair.producer)
    _scale_rows(producer, 1.0 / s)
    k = pair.expand(s)
    for name in pair.consumers:
        w = block.get_submodule(name).weight
        w.data = (w.data.float() * k.to(w.device)).to(w.dtype)


def _scale_rows(module: nn.Module, r: torch.Tensor) -> None:
    w = module.weight
    shape = (-1,) + (1,) * (w.ndim - 1)
    w.data = (w.data.float() * r.to(w.device).view(shape)).to(w.dtype)
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.data = (bias.data.float() * r.to(bias.device)).to(bias.dtype)


def check_folds(block: nn.Module, pairs: list[ScalePair], inputs: tuple[tuple, dict], where: str,
                *, refuse: bool = True) -> list[ScalePair]:
    """The pairs whose folds leave the block's output unchanged (float32, random scales, folded one
    after another); with `refuse`, an AOQError at the first that does not."""
    args, kwargs = _as_float32(inputs)
    probe = copy.deepcopy(block).float()
    kept = []
    with torch.no_grad():
        before = _hidden(probe(*args, **kwargs))
        g = torch.Generator().manual_seed(0)
        for pair in pairs:
            c = probe.get_submodule(pair.producer).weight.shape[0]
            s = torch.exp(torch.randn(c, generator=g) * 0.5).to(before.device)
            fold(probe, pair, s)
            after = _hidden(probe(*args, **kwargs))
            err = (after - before).norm() / before.norm().clamp(min=1e-30)
            if not err <= _FOLD_TOLERANCE and not refuse:
                fold(probe, pair, 1.0 / s)  # undone: the next pairs are checked without it
                continue
            if not err <= _FOLD_TOLERANCE:
                raise AOQError(f"{where}: folding scales from {pair.producer} into {', '.join(pair.consumers)} "
                               f"changes the block's output (relative error {float(err):.2g}): this block is not "
                               "llama-style there; use calibration_method='gptq' or no calibration")
            kept.append(pair)
            before = after
    return kept


def _as_float32(inputs):
    args, kwargs = inputs
    cast = lambda v: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    f = lambda v: tuple(cast(t) for t in v) if isinstance(v, tuple) else cast(v)  # noqa: E731
    return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}


def _hidden(output) -> torch.Tensor:
    return (output[0] if isinstance(output, (tuple, list)) else output).float()


def quantize_with_scales(
    model: nn.Module,
    config: AOQBaseConfig | FqnToConfig,
    batches: Iterable[torch.Tensor],
    method: ScaleMethod,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    log: Callable[[str], None] | None = None,
) -> ScaleReport:
    """Quantize `model` in place like `quantize_(model, config, filter_fn)`, after folding into each
    llama-style block the per-channel scales `method` chooses for the weights whose config it
    accepts, on `batches` (token id tensors [B, T])."""
    from .calibration import _LAYER_INDEX, _next_inputs, _record_inputs

    batches = [b if b.ndim == 2 else b.unsqueeze(0) for b in batches]
    if not batches:
        raise AOQError("calibration needs at least one batch of token ids")
    report = ScaleReport(method=method.name, tokens=sum(b.numel() for b in batches))
    start_time = time.perf_counter()
    decisions = plan(model, config, filter_fn=filter_fn)
    by_block: dict[str, dict[int, dict[str, Decision]]] = {}
    for name, d in decisions.items():
        module_fqn, _, leaf = name.rpartition(".")
        m = _LAYER_INDEX.match(name)
        if leaf == "weight" and d.place and method.accepts(d.config) and m \
                and isinstance(model.get_submodule(m.group(1)), nn.ModuleList):
            local = module_fqn[len(m.group(0)):]
            by_block.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[local] = d
    if not by_block:
        raise AOQError(f"{method.name}: no weight of the plan is one it calibrates (inside numbered decoder blocks)")
    device = next(model.parameters()).device
    batches = [b.to(device) for b in batches]
    done: set[str] = set()
    with torch.no_grad():
        for prefix, by_index in by_block.items():
            layers = model.get_submodule(prefix)
            inputs = _record_inputs(model, layers[0], batches)
            # Every block checked before any changes.
            pairs = {i: block_pairs(layers[i], f"{prefix}.{i}", local, inputs[0], method.stores_scales)
                     for i, local in by_index.items()}
            for i in range(len(layers)):
                local = by_index.get(i, {})
                if local:
                    stored = _calibrate_block(layers[i], pairs[i], local, inputs, method, report)
                    for name, d in local.items():
                        full = f"{prefix}.{i}.{name}.weight"
                        q = d.config.quantize_weight(layers[i].get_submodule(name).weight.data, name=full)
                        if name in stored:
                            q = with_input_scale(q, stored[name], name=full)
                            report.stored.append(full.removesuffix(".weight"))
                        set_quantized(model, full, d, q)
                        done.add(full)
                        report.calibrated.append(full.removesuffix(".weight"))
                    report.layers += 1
                    if log is not None:
                        log(f"calibrated {prefix}.{i} ({len(local)} weights)")
                if i + 1 < len(layers):
                    inputs = [_next_inputs(layers[i](*a, **k), a, k) for a, k in inputs]
            del inputs
    carry_out(model, {n: d for n, d in decisions.items() if n not in done})
    report.seconds = time.perf_counter() - start_time
    return report


def block_pairs(block: nn.Module, where: str, local: dict, inputs, stores: bool) -> list[ScalePair]:
    """The block's foldable pairs, and (when the method `stores` scales) one stored pair for
    every planned linear no kept pair covers; without `stores`, an AOQError for a block or pair
    that cannot fold."""
    try:
        pairs = llama_pairs(block, where)
    except AOQError:
        if not stores:
            raise
        pairs = []
    pairs = check_folds(block, pairs, inputs, where, refuse=not stores) if pairs else []
    if stores:
        covered = {c for p in pairs for c in p.consumers}
        pairs += [ScalePair("", (name,)) for name in local if name not in covered
                  and isinstance(block.get_submodule(name), nn.Linear)]
    return pairs


def _calibrate_block(block, pairs, local, inputs, method, report) -> dict[str, torch.Tensor]:
    """Collect each pair's input statistics on the float block, choose its scales, fold them (or
    scale a stored pair's weight); returns {linear name: its input_scale} for the stored ones."""
    states: dict[str, object] = {}
    live = [p for p in pairs if any(c in local for c in p.consumers)]

    def hook_for(key):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            states[key] = method.collect(x, states.get(key))
        return hook

    handles = [block.get_submodule(p.consumers[0]).register_forward_pre_hook(hook_for(p.key)) for p in live]
    try:
        for a, k in inputs:
            block(*a, **k)
    finally:
        for h in handles:
            h.remove()
    chosen = []
    for p in live:
        names = [c for c in p.consumers if c in local]
        weights = {c: block.get_submodule(c).weight.data for c in names}
        s, info = method.choose(p, weights, {c: local[c].config for c in names}, states[p.key])
        chosen.append((p, s))
        report.choices.append(info)
    # Folding after every choice: each pair was chosen on the float block's own activations.
    stored = {}
    for p, s in chosen:
        if p.stored:
            w = block.get_submodule(p.consumers[0]).weight
            w.data = (w.data.float() * s.to(w.device)).to(w.dtype)
            stored[p.consumers[0]] = s
            continue
        fold(block, p, s)
        report.pairs += 1
    return stored
