"""`hf-aoq quantize --target compressed-tensors|gguf`: the AOQConfig whose checkpoint exports to
that format losslessly by construction (and, for compressed-tensors, runs on vLLM's kernels).

gguf: 4-bit schemes become symmetric Int4 in groups of 32 (GGUF's Q4_0; scales in the model's
dtype, which fp16 holds for bf16 and fp16 models short of scales under 2^-17), int8 becomes
Int8 in groups of 32 with fp16-representable scales (Q8_0); a linear layer whose input size is
not a multiple of 32 stays in float (a GGUF row is whole blocks).

4-bit schemes become symmetric Int4 (compressed-tensors' zero points are integers, hf_aoq's
asymmetric zeros are not) at a group size vLLM's Marlin kernels take (128 unless --group-size
32 or 64), and a linear layer Marlin cannot run (input size not a multiple of 128, output size
not a multiple of 64) is left in float and listed, so the export never needs --requantize. The
layer shapes come from the model's config.json, built on the meta device (no weights loaded).
"""
from __future__ import annotations

from .common import UsageError, log

TARGETS = ("compressed-tensors", "gguf")
EXPORTABLE_SCHEMES = ("int4", "int4-plain", "int8", "int8-dyn", "fp8", "fp8-dyn")  # to compressed-tensors
MARLIN_GROUP_SIZES = (32, 64, 128)
MARLIN_K, MARLIN_N = 128, 64  # what vLLM's Marlin kernels need of in_features / out_features


def linear_shapes(model: str, *, revision=None, token=None, trust_remote_code=False) -> dict[str, tuple[int, int]]:
    """{module name: (out_features, in_features)} of every nn.Linear of `model` (a folder or Hub
    id), from its config alone."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model, revision=revision, token=token, trust_remote_code=trust_remote_code)
        config.quantization_config = None
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise UsageError(f"--target: cannot build {model} from its config.json to see its layer shapes "
                         f"({type(e).__name__}: {e})") from None
    return {name: (m.out_features, m.in_features) for name, m in meta.named_modules() if isinstance(m, nn.Linear)}


def build_target_config(target: str, model: str, scheme: str | None, group_size: int | None, *, recipe=None,
                        skip=None, calibration=None, calibration_tokens: int = 2048, load=None, gptq_order=None):
    """The AOQConfig of `hf-aoq quantize --scheme SCHEME --target TARGET` (see the module
    docstring); `load` (LoadOptions) says how to reach the model's config; `gptq_order` as
    build_aoq_config takes it."""
    from ..configs import FqnToConfig, Int4WeightOnlyConfig
    from .quantization import build_aoq_config

    if target not in TARGETS:
        raise UsageError(f"--target {target}: not one of {', '.join(TARGETS)}")
    if target == "gguf":
        return _gguf_config(model, scheme, group_size, recipe=recipe, skip=skip, calibration=calibration,
                            calibration_tokens=calibration_tokens, load=load, gptq_order=gptq_order)
    if recipe is not None:
        raise UsageError("--target chooses every layer's config itself; give --scheme (and --skip), not --recipe")
    if scheme not in EXPORTABLE_SCHEMES:
        # The others (mx, intN, int8-intN) have no compressed-tensors form: export would refuse them.
        raise UsageError(f"--target needs --scheme {', '.join(EXPORTABLE_SCHEMES[:-1])} or {EXPORTABLE_SCHEMES[-1]}"
                         + ("" if scheme is None else f"; {scheme} has no compressed-tensors form"))
    if scheme not in ("int4", "int4-plain"):
        return build_aoq_config(scheme, group_size, None, skip, calibration, calibration_tokens, gptq_order=gptq_order)
    g = 128 if group_size is None else group_size
    if g not in MARLIN_GROUP_SIZES:
        raise UsageError(f"--target {target} --scheme {scheme}: --group-size {group_size}; vLLM's 4-bit kernels "
                         f"take groups of {', '.join(map(str, MARLIN_GROUP_SIZES))}")
    default = Int4WeightOnlyConfig(group_size=g, symmetric=True)
    opts = load.kwargs() if load is not None else {}
    shapes = linear_shapes(model, revision=opts.get("revision"), token=opts.get("token"),
                           trust_remote_code=opts.get("trust_remote_code", False))
    misfits = {name: None for name, (n, k) in shapes.items() if k % MARLIN_K or k % g or n % MARLIN_N}
    if misfits:
        log(f"--target {target}: {len(misfits)} linear layers stay in float (vLLM's 4-bit kernels need an input "
            f"size that is a multiple of {MARLIN_K} and an output size that is a multiple of {MARLIN_N}): "
            f"{', '.join(sorted(misfits))}")
    return build_aoq_config(None, None, FqnToConfig({**misfits, "_default": default}), skip, calibration,
                            calibration_tokens, gptq_order=gptq_order)


GGUF_BLOCK = 32


def _gguf_config(model, scheme, group_size, *, recipe, skip, calibration, calibration_tokens, load, gptq_order):
    import torch

    from ..configs import FqnToConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig
    from .quantization import build_aoq_config

    if recipe is not None:
        raise UsageError("--target chooses every layer's config itself; give --scheme (and --skip), not --recipe")
    if scheme not in ("int4", "int4-plain", "int8"):
        raise UsageError("--target gguf needs --scheme int4, int4-plain or int8 (GGUF's Q4_0 and Q8_0); the "
                         "float8, MX and dynamic-activation schemes have no GGUF form")
    if group_size not in (None, GGUF_BLOCK):
        raise UsageError(f"--target gguf --scheme {scheme}: --group-size {group_size}; GGUF blocks are "
                         f"{GGUF_BLOCK} values")
    if scheme == "int8":
        default = Int8WeightOnlyConfig(group_size=GGUF_BLOCK, scale_dtype=torch.float16)
    else:
        default = Int4WeightOnlyConfig(group_size=GGUF_BLOCK, symmetric=True)
    opts = load.kwargs() if load is not None else {}
    shapes = linear_shapes(model, revision=opts.get("revision"), token=opts.get("token"),
                           trust_remote_code=opts.get("trust_remote_code", False))
    misfits = {name: None for name, (n, k) in shapes.items() if k % GGUF_BLOCK}
    if misfits:
        log(f"--target gguf: {len(misfits)} linear layers stay in float (a GGUF row is whole blocks of "
            f"{GGUF_BLOCK}): {', '.join(sorted(misfits))}")
    return build_aoq_config(None, None, FqnToConfig({**misfits, "_default": default}), skip, calibration,
                            calibration_tokens, gptq_order=gptq_order)
