"""SmoothQuant-style scales for int8 weights with dynamic int8 activations, folded into
llama-style blocks.

Per-token int8 activations lose the small channels of a token whose few outlier channels set its
scale. Dividing the activations by s per input channel (and multiplying the weight's columns by
s) moves that range into the weights, which have a scale per row and room to spare:
s = max|X_j| ** alpha / max|W_j| ** (1 - alpha) per input channel j (X on the calibration text,
W over every consumer's rows), normalised to a geometric mean of 1. For each foldable pair
(hf_aoq.channel_scales) alpha is searched on a grid, and s = 1 (no migration) is always a
candidate; the one kept minimises the consumers' output error with both sides quantized as they
will run, on a sample of the calibration tokens. The folded model has the same tensors and size.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from .channel_scales import ScalePair, ScaleReport, quantize_with_scales
from .configs import AOQBaseConfig, FqnToConfig, Int8DynamicActivationInt8WeightConfig

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
SAMPLE_ROWS = 1024  # calibration tokens kept per pair to score each alpha on


class SmoothQuant:
    """The scale method of `quantize_with_smoothquant` (see the module docstring)."""

    name = "smoothquant"
    stores_scales = False  # Int8Tensor has no input_scale: a pair that cannot fold is refused

    def __init__(self, alphas: Iterable[float] = ALPHAS, sample_rows: int = SAMPLE_ROWS):
        self.alphas = tuple(alphas)
        self.sample_rows = sample_rows

    def accepts(self, config: AOQBaseConfig) -> bool:
        return isinstance(config, Int8DynamicActivationInt8WeightConfig)

    def collect(self, x: torch.Tensor, state):
        amax, rows = state if state is not None else (torch.zeros(x.shape[1], device=x.device), [])
        amax = torch.maximum(amax, x.abs().amax(0))
        kept = sum(r.shape[0] for r in rows)
        if kept < self.sample_rows:
            step = max(1, x.shape[0] // 256)  # spread over the batch, not its first tokens only
            rows.append(x[::step][: self.sample_rows - kept].clone())
        return amax, rows

    def choose(self, pair: ScalePair, weights, configs, state):
        amax, rows = state
        x = torch.cat(rows)
        x_max = pair.reduce(amax, "max").clamp(min=1e-5)
        w_max = torch.stack([pair.reduce(w.float().abs().amax(0), "max") for w in weights.values()]).amax(0)
        w_max = w_max.clamp(min=1e-5)
        exact = {n: x @ w.float().t() for n, w in weights.items()}
        candidates = [(None, torch.ones_like(x_max))]
        for alpha in self.alphas:
            s = x_max.pow(alpha) / w_max.pow(1 - alpha)
            candidates.append((alpha, s / s.log().mean().exp()))
        best = None
        for alpha, s in candidates:
            k = pair.expand(s)
            err = 0.0
            for n, w in weights.items():
                q = configs[n].quantize_weight((w.float() * k).to(w.dtype), name=n)
                y = q.simulate_input_quantization(x / k) @ q.dequantize(torch.float32).t()
                err += float((y - exact[n]).square().sum())
            if best is None or err < best[2]:
                best = (alpha, s, err)
            if alpha is None:
                baseline = err
        alpha, s, err = best
        return s, {"pair": pair.producer, "alpha": alpha, "error_ratio": err / max(baseline, 1e-30)}


def quantize_with_smoothquant(
    model: nn.Module,
    config: AOQBaseConfig | FqnToConfig,
    batches: Iterable[torch.Tensor],
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    log: Callable[[str], None] | None = None,
    alphas: Iterable[float] = ALPHAS,
) -> ScaleReport:
    """Quantize `model` in place like `quantize_(model, config, filter_fn)`, with SmoothQuant scales
    folded in front of every int8-dynamic linear of its llama-style blocks, chosen on `batches`
    (token id tensors [B, T]). Blocks that are not llama-style are refused (AOQError)."""
    return quantize_with_scales(model, config, batches, SmoothQuant(alphas), filter_fn=filter_fn, log=log)
