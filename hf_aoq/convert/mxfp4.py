"""transformers' Mxfp4 checkpoints (gpt-oss) -> hf_aoq MXTensor, bit for bit.

transformers (integrations/mxfp4.py, quantizers/quantizer_mxfp4.py) stores each quantized fused
experts weight `P` (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) as two uint8 tensors:

    P_blocks  [E, N, K/32, 16]   two e2m1 codes a byte, element 2j in the low nibble of byte j
    P_scales  [E, N, K/32]       e8m0: the block's scale is 2^(code - 127)

where [E, N, K] is the weight as a linear layer sees it, [experts, out, in]: blocks of 32 run
along the input dimension K. transformers decodes a byte through the 16-entry e2m1 table
(0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; bit 3 is the sign), multiplies by the scale
(torch.ldexp) and transposes to its parameter layout [E, K, N] (gpt-oss's experts compute
x @ w[e]). gate_up_proj's N = 2I output rows interleave gate and up (gate at even rows); that
order is kept as stored, so nothing about it changes here.

That is exactly MXTensor's MXFP4 layout for the [E, N, K] weight: `qdata` = the blocks with
their last two dims merged ([E, N, K/2], the same nibble order), `scale` = the scales. The one
difference is scale code 255: transformers computes 2^128 = inf (inf or NaN weights), hf_aoq's
e8m0 reads it as NaN; a weight cannot be either, so it is refused. The hf_aoq model holds the
MXTensor as its [E, K, N] transpose (a TransposedExperts view, `stored_transposed` in the
AOQConfig), so gpt-oss's experts run it on hf_aoq's MXFP4 kernels, one linear per expert.
"""
from __future__ import annotations

import torch

from ..core.errors import FormatError
from ..tensors import MXTensor
from ..tensors import mx

QUANT_METHOD = "mxfp4"
BLOCKS, SCALES = "_blocks", "_scales"
BYTES_PER_BLOCK = mx.BLOCK_SIZE // 2  # 16: 32 e2m1 codes


class Mxfp4ConversionError(FormatError):
    """A transformers Mxfp4 checkpoint that cannot be converted (malformed blocks or scales)."""


def mx_from_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str,
                   source: str = "<memory>") -> MXTensor:
    """The weight-only MXFP4 MXTensor [E, N, K] of transformers' `name_blocks` [E, N, K/32, 16] and
    `name_scales` [E, N, K/32] (module docstring); `dtype` is the float dtype it computes in."""
    where = f"{source}: {name}"
    for what, t in (("blocks", blocks), ("scales", scales)):
        if t.dtype != torch.uint8:
            raise Mxfp4ConversionError(f"{where}{BLOCKS if what == 'blocks' else SCALES}: dtype {t.dtype}, "
                                       f"expected uint8")
    if blocks.ndim != 4 or blocks.shape[-1] != BYTES_PER_BLOCK or 0 in blocks.shape:
        raise Mxfp4ConversionError(f"{where}{BLOCKS}: shape {tuple(blocks.shape)}, expected [experts, out, in/32, "
                                   f"{BYTES_PER_BLOCK}] (fused experts, 16 bytes per block of 32)")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise Mxfp4ConversionError(f"{where}{SCALES}: shape {tuple(scales.shape)} does not match {name}{BLOCKS} "
                                   f"{tuple(blocks.shape)}; expected {tuple(blocks.shape[:-1])} (one scale per block)")
    if bool((scales == mx.E8M0_NAN).any()):
        raise Mxfp4ConversionError(f"{where}{SCALES}: holds the e8m0 code 255 (NaN; transformers decodes it as "
                                   f"2^128 = inf), which no finite weight has")
    e, n, g, _ = blocks.shape
    k = g * mx.BLOCK_SIZE
    qdata = blocks.reshape(e, n, g * BYTES_PER_BLOCK).contiguous()
    return MXTensor(qdata, scales.contiguous(), mx.FP4, (1, 1, mx.BLOCK_SIZE), (e, n, k), dtype)


def dequantize_as_transformers(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' parameter [E, K, N] decoded from the stored bytes by the published layout,
    written independently of MXTensor's decoder (the check that the conversion is exact)."""
    table = torch.tensor(mx.E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # element 2j low, 2j + 1 high
    values = table[codes].reshape(*blocks.shape[:-1], mx.BLOCK_SIZE)
    scaled = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - mx.E8M0_BIAS)
    return scaled.reshape(*blocks.shape[:2], -1).to(dtype).transpose(1, 2).contiguous()


def _pairs(tensors: dict[str, torch.Tensor], source: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{parameter name: (blocks, scales)}; a `_blocks` without its `_scales` (or the other way
    round) is an error naming it."""
    names = {k[: -len(BLOCKS)] for k in tensors if k.endswith(BLOCKS)} | {
        k[: -len(SCALES)] for k in tensors if k.endswith(SCALES)}
    out = {}
    for name in sorted(names):
        blocks, scales = tensors.get(name + BLOCKS), tensors.get(name + SCALES)
        if blocks is None or scales is None:
            have, lack = (name + BLOCKS, name + SCALES) if scales is None else (name + SCALES, name + BLOCKS)
            raise Mxfp4ConversionError(f"{source}: {have} has no {lack}; an Mxfp4 weight is stored as both")
        out[name] = (blocks, scales)
    return out


def convert_mxfp4_checkpoint(src, out, *, overwrite: bool = False, max_shard_size: int):
    """Convert transformers' Mxfp4 checkpoint folder `src` (config.json quantization_config
    quant_method "mxfp4") into an hf_aoq checkpoint at `out`: every `P_blocks` / `P_scales` pair
    becomes the MXTensor `P` (weight-only MXFP4, exactly the same values), the other tensors are
    copied, and config.json gets an AOQConfig naming them (stored_transposed: the model holds
    their transpose). Nothing is written when anything is refused."""
    from pathlib import Path

    from .. import model_card
    from ..configs import FqnToConfig, MXFPInferenceConfig
    from ..core.errors import AOQError
    from ..integrations.transformers import AOQConfig
    from ..serialization import open_checkpoint
    from ..workflows import export as wf

    src, out = Path(src), Path(out)
    config = wf._read_config(src)
    if wf._quant_method(config) != QUANT_METHOD:
        raise wf.ExportError(f"{src / wf.CONFIG_NAME}: quantization_config.quant_method is "
                             f"{wf._quant_method(config)!r}, not {QUANT_METHOD!r}")
    wf._check_out(src, out, overwrite)
    dtype = wf._DTYPES.get(config.get("dtype") or config.get("torch_dtype"), torch.bfloat16)
    try:
        stored = open_checkpoint(src).tensors()
        pairs = _pairs(stored, str(src))
    except AOQError as e:
        raise wf.ExportError(f"{e}; nothing was written at {out}") from None
    if not pairs:
        raise wf.ExportError(f"{src}: no *_blocks / *_scales tensors: nothing quantized to convert")
    summary = wf.Summary(str(src), str(out), "hf_aoq")
    packed = {n + suffix for n in pairs for suffix in (BLOCKS, SCALES)}
    state = {k: v for k, v in stored.items() if k not in packed}
    summary.plain = len(state)
    clash = sorted(set(pairs) & set(state))
    if clash:
        raise wf.ExportError(f"{src}: {clash[0]} is stored both as a float tensor and as {clash[0]}{BLOCKS}")
    for name, (blocks, scales) in wf.progress(pairs.items(), total=len(pairs), desc="convert", unit="tensor"):
        try:
            t = mx_from_blocks(blocks, scales, dtype, name, str(src))
            type(t).check_fields(t.fields())
        except AOQError as e:
            raise wf.ExportError(f"{e}; nothing was written at {out}") from None
        for e in range(blocks.shape[0]):  # expert by expert: a whole gpt-oss tensor decoded is gigabytes
            got = t[e].dequantize().t()
            if not torch.equal(got, dequantize_as_transformers(blocks[e : e + 1], scales[e : e + 1], dtype)[0]):
                raise wf.ExportError(f"{src}: {name} (expert {e}): the MXTensor does not decode to transformers' "
                                     f"values; please report this")
        state[name] = t
        what = f"Mxfp4 {name.rpartition('.')[2]} (e2m1, e8m0 scale per 32) -> MXTensor mxfp4"
        summary.groups[what] = summary.groups.get(what, 0) + 1
    weight_only_fp4 = MXFPInferenceConfig(activation_dtype=None, weight_dtype=mx.FP4)
    aoq = AOQConfig(FqnToConfig({n: weight_only_fp4 for n in pairs}), stored_transposed=list(pairs))
    config = dict(config, quantization_config=aoq.to_dict())
    summary.notes.append("the experts are stored [experts, out, in] (MX blocks along in) and load as the transpose "
                         "gpt-oss's modules hold (quantization_config.stored_transposed)")

    def card(folder: Path) -> None:
        model_card.write_model_card(folder, base_model=wf._base_model(src) or str(src), load_name=str(out))

    summary.copied = wf._write_folder(src, out, state, config, max_shard_size, card)
    return summary
