"""Activation-aware scales for 4-bit weights (AWQ-style), folded into llama-style blocks, or
stored with the weight (its `input_scale`) where no fold is possible.

Input channels whose activations are large matter more to a linear's output than the rest; a
weight quantized as W * s (s larger on those channels) and fed x / s keeps their columns more
precisely. For each foldable pair of a block (hf_aoq.channel_scales) the scales are
s = a ** alpha, a the RMS of each input channel on the calibration text, normalised so that
max(s) * min(s) = 1; alpha is searched on a grid from 0 (no scaling) to 1 and the one kept
minimises the consumers' output error on the calibration inputs,

    sum over consumers of  || X (Q(W * s) / s - W)^T ||^2  =  trace(E H E^T),  E = Q(W * s) / s - W,

computed from the Gram matrix H = X^T X, over a sample of each consumer's rows. Q in the search is
plain round-to-nearest int4 with the config's group size and symmetry and each group's min/max
(both configs' parameter searches cost seconds per weight, 11 candidates x 7 weights x every
block); alpha = 0 (no scaling) is always a candidate. The weights are then quantized by their
own configs (Int4WeightOnlyConfig, Int4DQWeightOnlyConfig) as usual: same tensors, same size.
A linear whose scales cannot fold (a pair hf_aoq.channel_scales' check rejects, every linear of a
block that is not llama-style) gets scales chosen the same way on its own input, and stores them:
its codes hold Q(W * s) and its `input_scale` s makes the forward (x / s) @ Q(W * s)^T, at K
float32 numbers more per weight.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from .channel_scales import ScalePair, ScaleReport, quantize_with_scales
from .configs import AOQBaseConfig, FqnToConfig, Int4DQWeightOnlyConfig, Int4WeightOnlyConfig

ALPHAS = tuple(i / 10 for i in range(11))
# Rows of each consumer the search scores alpha on (evenly spread): the error is a sum over rows,
# so a sample ranks the candidates as the whole weight would, at a fraction of the quantize time.
SEARCH_ROWS = 256


class AWQ:
    """The scale method of `quantize_with_awq` (see the module docstring)."""

    name = "awq"
    stores_scales = True

    def __init__(self, alphas: Iterable[float] = ALPHAS):
        self.alphas = tuple(alphas)

    def accepts(self, config: AOQBaseConfig) -> bool:
        return isinstance(config, (Int4WeightOnlyConfig, Int4DQWeightOnlyConfig))

    def collect(self, x: torch.Tensor, gram):
        return x.t() @ x if gram is None else gram.addmm_(x.t(), x)

    def choose(self, pair: ScalePair, weights, configs, gram):
        rms = pair.reduce(torch.diag(gram).clamp(min=0)).sqrt()
        rms = torch.where(rms > 0, rms, rms[rms > 0].min() if (rms > 0).any() else torch.ones_like(rms))
        weights = {n: w[:: -(-w.shape[0] // SEARCH_ROWS)] for n, w in weights.items()}
        best, best_err, errors = None, None, []
        for alpha in self.alphas:
            s = rms.pow(alpha)
            s = s / (s.max() * s.min()).sqrt()
            err = sum(output_error(w, pair.expand(s), configs[n], gram, name=n) for n, w in weights.items())
            errors.append(err)
            if best_err is None or err < best_err:
                best, best_err = (s, alpha), err
        s, alpha = best
        return s, {"pair": pair.key, "stored": pair.stored, "alpha": alpha, "error_ratio": best_err / max(errors[0], 1e-30)}


def output_error(weight: torch.Tensor, k_scales: torch.Tensor, config, gram: torch.Tensor, *, name="weight") -> float:
    """trace(E H E^T) for E = Q(W * s) / s - W: the squared output error of quantizing `weight`
    [N, K] as `config` would (round to nearest on each group's min/max, `rtn_int4`) after scaling
    its input channels by `k_scales` [K], on inputs whose Gram matrix is `gram` [K, K]."""
    w = weight.float()
    scaled = (w * k_scales).to(weight.dtype).float()
    e = rtn_int4(scaled, config.group_size, getattr(config, "symmetric", False)) / k_scales - w
    return float(((e @ gram) * e).sum())


def rtn_int4(w: torch.Tensor, group_size: int, symmetric: bool) -> torch.Tensor:
    """w [N, K] float32 quantized to 4 bits per group of `group_size` along K (min/max, round to
    nearest) and dequantized: the fast stand-in for a config's quantizer in the alpha search."""
    n, k = w.shape
    pad = -k % group_size
    g = torch.nn.functional.pad(w, (0, pad)).view(n, -1, group_size)
    if pad:  # the padding must not widen the last group's range: repeat its first value
        g[:, -1, group_size - pad:] = g[:, -1, :1]
    if symmetric:
        scale = torch.maximum(g.amax(-1, keepdim=True) / 7, -g.amin(-1, keepdim=True) / 8).clamp(min=1e-10)
        q = (g / scale).round().clamp(-8, 7) * scale
    else:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-10)
        q = ((g - lo) / scale).round().clamp(0, 15) * scale + lo
    return q.reshape(n, -1)[:, :k]


def quantize_with_awq(
    model: nn.Module,
    config: AOQBaseConfig | FqnToConfig,
    batches: Iterable[torch.Tensor],
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    log: Callable[[str], None] | None = None,
    alphas: Iterable[float] = ALPHAS,
) -> ScaleReport:
    """Quantize `model` in place like `quantize_(model, config, filter_fn)`, with AWQ scales in
    front of every int4 / Int4DQ linear of its numbered decoder blocks, chosen on `batches`
    (token id tensors [B, T]): folded into the previous norm or linear where the block allows,
    stored as the weight's input_scale elsewhere (report.stored names those weights)."""
    return quantize_with_scales(model, config, batches, AWQ(alphas), filter_fn=filter_fn, log=log)
