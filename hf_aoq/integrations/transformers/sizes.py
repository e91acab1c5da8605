"""What a planned weight will occupy once quantized, measured on a small probe before loading."""
from __future__ import annotations

import dataclasses

import torch

from ...configs import AOQBaseConfig, Float8StaticActivationFloat8WeightConfig
from ...core.errors import AOQError

_PROBE_ROWS = 256


def _quantized_nbytes(cfg: AOQBaseConfig, shape: tuple[int, int], dtype: torch.dtype, name: str) -> int:
    """Bytes of `cfg` applied to a weight of this shape, measured on a small random probe.

    Every layout here stores per-row data plus a constant (codes and per-row or per-group
    scales, or a per-tensor scale), so two probes of _PROBE_ROWS and 2*_PROBE_ROWS rows give
    the exact size of any row count; a weight with fewer rows is measured whole. Quantizing the
    probe also checks the config against the weight (e.g. group size vs input dimension) before
    anything is read from the checkpoint.
    """
    n, k = shape
    gen = torch.Generator().manual_seed(0)
    if isinstance(cfg, Float8StaticActivationFloat8WeightConfig) and cfg.scale is None:
        cfg = dataclasses.replace(cfg, scale=1.0)  # calibration chooses it later; the size is the same

    def measure(rows: int) -> int:
        # transformers builds the model under torch.device("meta"); the probe must be real.
        with torch.device("cpu"):
            probe = torch.randn(rows, k, generator=gen).to(dtype)
        try:
            with torch.device("cpu"):
                q = cfg.quantize_weight(probe, name=f"{rows}-row probe")
        except AOQError as e:
            raise AOQError(f"{name}: {cfg} does not fit this {n}x{k} weight ({e})") from None
        return sum(t.numel() * t.element_size() for t in q.tensor_fields().values())

    if n <= 2 * _PROBE_ROWS:
        return measure(n)
    a, b = measure(_PROBE_ROWS), measure(2 * _PROBE_ROWS)
    return a + (b - a) * (n - _PROBE_ROWS) // _PROBE_ROWS
