"""torchao's quantization formulas, written here independently of hf_aoq (torchao is not
installed in the tests), for tests that check hf_aoq computes what torchao would. Test modules
import it (tests/ is on sys.path through conftest.py)."""
import torch


def torchao_int8_asym_per_token64(x: torch.Tensor) -> torch.Tensor:
    """torchao's IntxUnpackedToInt8Tensor activation_quantization "int8_asym_per_token": per row,
    choose_qparams_affine (ASYMMETRIC, int8 [-128, 127], eps of x's dtype, preserve_zero),
    quantize_affine and dequantize_affine, all of which torchao runs in x's dtype. Computed in
    float64 with each of torchao's operations rounded to x's dtype (float64 then one rounding is
    the dtype's correctly rounded result for bf16, fp16 and fp32); returned in float64."""
    d = x.dtype
    r = lambda t: t.to(d).double()  # noqa: E731
    x64 = x.double()
    lo = x64.min(dim=-1, keepdim=True).values.clamp(max=0)
    hi = x64.max(dim=-1, keepdim=True).values.clamp(min=0)
    scale = r(r(hi - lo) / 255.0).clamp(min=torch.finfo(d).eps)
    zp = (-128 - torch.round(r(lo / scale))).clamp(-128, 127)
    q = r(torch.round(r(x64 * r(1.0 / scale))) + zp).clamp(-128, 127)
    return r((q - zp) * scale)
