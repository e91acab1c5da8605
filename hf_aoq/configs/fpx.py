"""Config of FPxTensor: sub-byte float weights (torchao's FPx, fp6 e3m2 by default)."""
from __future__ import annotations

from dataclasses import dataclass

from ..core.registry import register_config_type
from ..tensors import FPxTensor
from ..tensors import fpx
from .recipe import AOQBaseConfig


@register_config_type
@dataclass(frozen=True)
class FPXWeightOnlyConfig(AOQBaseConfig):
    """Weight-only sub-byte floats (FPxTensor): 1 sign bit, `ebits` exponent and `mbits` mantissa
    bits per weight, one scale per output row (row max / the format's largest value). (ebits,
    mbits) is one of tensors.fpx.FORMATS: (3, 2) fp6 e3m2 (the default here; torchao's config has
    none), (2, 3) fp6 e2m3, (2, 2) and (3, 1) fp5, (3, 0) and (2, 1) fp4. Fused MoE experts
    [E, N, K] are quantized expert by expert into one 3-D FPxTensor. torchao's
    `set_inductor_config` has no counterpart (hf_aoq sets no inductor options) and is not a field."""

    ebits: int = fpx.DEFAULT_FORMAT[0]
    mbits: int = fpx.DEFAULT_FORMAT[1]

    def __post_init__(self):
        fpx.check_format(self.ebits, self.mbits, type(self).__name__)

    def quantize_weight(self, weight, *, name="weight"):
        return FPxTensor.from_float(weight, self.ebits, self.mbits, name=name)
