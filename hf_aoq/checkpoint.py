"""What a saved checkpoint folder holds, tensor by tensor: scheme, shape, bytes before and after
quantization, and whether each tensor loads; the quantization error against float weights.

Used by `hf-aoq inspect` and by the model card. Files are read with hf_aoq's checkpoint reader
(`serialization.open_checkpoint`: never pickle), which checks the shards as one set; the tensors
view a private map of the files, so reading a large checkpoint costs little memory.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import serialization
from . import tensors  # noqa: F401  (registers the tensor types a checkpoint may name; `hf-aoq` imports no more)
from .core import registry
from .core.errors import AOQError, FormatError

CONFIG_FILE = "config.json"


@dataclass
class TensorInfo:
    """One stored tensor: a quantized one (from its metadata) or a plain one."""

    name: str
    scheme: str  # "int4 g32 asym", "int8 per-row", ... or the dtype of a plain tensor ("bf16")
    shape: tuple[int, ...]
    bytes_before: int  # the tensor in its float dtype
    bytes_after: int  # what the checkpoint stores for it
    quantized: bool
    error: str | None = None  # why it does not load; None when it does


@dataclass
class CheckpointInfo:
    path: Path
    files: list[Path]
    tensors: list[TensorInfo]
    format_versions: list[int] = field(default_factory=list)  # hf_aoq format versions in the metadata
    writers: list[str] = field(default_factory=list)  # hf_aoq releases that wrote it
    problems: list[str] = field(default_factory=list)  # checkpoint-level errors (a key no tensor claims...)
    quantization_config: dict[str, Any] | None = None  # config.json's, when there is one
    built: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # quantized tensors that loaded

    @property
    def bytes_before(self) -> int:
        return sum(t.bytes_before for t in self.tensors)

    @property
    def bytes_after(self) -> int:
        return sum(t.bytes_after for t in self.tensors)

    @property
    def loads(self) -> bool:
        return not self.problems and all(t.error is None for t in self.tensors)

    @property
    def quantized(self) -> list[TensorInfo]:
        return [t for t in self.tensors if t.quantized]


def short_dtype(dtype: torch.dtype) -> str:
    return registry.SHORT_DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def describe(entry: serialization.TensorEntry, field_dtypes: dict[str, torch.dtype]) -> str:
    """A short name for how a quantized tensor is stored, from its metadata alone."""
    attrs = entry.attributes
    shape = tuple(attrs.get("shape") or ())
    block = tuple(attrs.get("block_size") or ())
    if len(shape) == 3 and len(block) == 3 and block[0] == 1:  # fused experts: each expert's 2-D layout
        shape, block = shape[1:], block[1:]
    if len(shape) == 2 and len(block) == 2:
        if block == shape:
            grain = "per-tensor"
        elif block[0] == 1 and block[1] == shape[1]:
            grain = "per-row"
        elif block[0] == 1:
            grain = f"g{block[1]}"
        else:
            grain = f"block {block[0]}x{block[1]}"
    else:
        grain = f"block {block}" if block else ""
    kind = {"Int4Tensor": "int4", "Int4DQTensor": "int4dq", "Int8Tensor": "int8", "Float8Tensor": "fp8",
            "NVFP4Tensor": "nvfp4 e2m1"}.get(
        entry.type_name, entry.type_name
    )
    if kind == "fp8" and "qdata" in field_dtypes:
        kind = f"fp8 {short_dtype(field_dtypes['qdata'])}"
    if entry.type_name == "MXTensor" and isinstance(attrs.get("elem_dtype"), torch.dtype):
        kind = f"mx {short_dtype(attrs['elem_dtype'])}"
    if entry.type_name == "Float8SemiSparseTensor":
        kind = "fp8-sparse 2:4 e4m3"
    if entry.type_name == "IntxTensor" and type(attrs.get("bits")) is int:
        kind = f"intx{attrs['bits']}"
    if entry.type_name == "FPxTensor" and type(attrs.get("ebits")) is int and type(attrs.get("mbits")) is int:
        kind = f"fp{1 + attrs['ebits'] + attrs['mbits']} e{attrs['ebits']}m{attrs['mbits']}"
    parts = [kind, grain]
    if entry.type_name in ("Int4Tensor", "IntxTensor"):
        parts.append("asym" if "zero" in entry.keys else "sym")
    act, act_dtype = attrs.get("act_quant"), attrs.get("act_dtype")
    if act == "static":
        parts.append(f"static-act {short_dtype(act_dtype) if isinstance(act_dtype, torch.dtype) else 'fp8'}")
    elif act:
        parts.append(f"dyn-act {act}")
        if entry.type_name == "Int4Tensor" and isinstance(act_dtype, torch.dtype):
            parts.append(short_dtype(act_dtype))
        if entry.type_name == "Float8SemiSparseTensor":  # its activations default to e4m3
            parts.append(short_dtype(act_dtype) if isinstance(act_dtype, torch.dtype) else "e4m3")
    if entry.type_name == "MXTensor" and isinstance(attrs.get("act_dtype"), torch.dtype):
        parts.append(f"dyn-act mx {short_dtype(attrs['act_dtype'])}")
    return " ".join(p for p in parts if p)


def checkpoint_files(path) -> list[Path]:
    """The .safetensors files of a checkpoint folder (its model.safetensors, or the shards its
    index lists), or the one file given."""
    return [Path(f) for f in serialization.checkpoint_files(path)[1]]


def read_quantization_config(path) -> dict[str, Any] | None:
    """config.json's "quantization_config" in a checkpoint folder, or None."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FormatError(f"{config}: not readable JSON ({e})") from None
    q = data.get("quantization_config") if isinstance(data, dict) else None
    return q if isinstance(q, dict) else None


def read_checkpoint(path, *, build: bool = True) -> CheckpointInfo:
    """Every tensor of the checkpoint at `path` (a folder or one .safetensors file).

    With `build`, each quantized tensor is rebuilt from its stored fields, which runs every check
    a load runs; a tensor that fails gets its error, and the others are still reported. A file
    that is not valid safetensors, or metadata that does not parse, raises FormatError.
    """
    path = Path(path)
    ckpt = serialization.open_checkpoint(path)  # FormatError for anything wrong with the set
    files = [Path(f) for f in ckpt.files]
    stored = ckpt.tensors()
    entries = ckpt.entries
    info = CheckpointInfo(path, files, [], list(ckpt.format_versions), list(ckpt.writers))
    row_errors: dict[str, str] = {}
    for name, problem in ckpt.problems():
        if name in entries:
            row_errors.setdefault(name, str(problem))
        else:
            info.problems.append(str(problem))
    if path.is_dir():
        info.quantization_config = read_quantization_config(path)

    for name, entry in entries.items():
        fields = {f: stored.get(k) for f, k in entry.keys.items()}
        attrs = entry.attributes
        shape = tuple(attrs.get("shape") or ())
        dtype = attrs.get("dtype")
        itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
        present = {f: t for f, t in fields.items() if t is not None}
        row = TensorInfo(
            name=name,
            scheme=describe(entry, {f: t.dtype for f, t in present.items()}),
            shape=shape,
            bytes_before=math.prod(shape) * itemsize,
            bytes_after=sum(t.numel() * t.element_size() for t in present.values()),
            quantized=True,
        )
        row.error = row_errors.get(name)
        if row.error is None and build:
            try:
                info.built[name] = entry.build(present, source=ckpt.file_of(entry))
            except (AOQError, FormatError) as e:
                row.error = str(e)
        info.tensors.append(row)
    for key, t in stored.items():
        if serialization.SEPARATOR in key or key in entries:
            continue
        nbytes = t.numel() * t.element_size()
        info.tensors.append(TensorInfo(key, short_dtype(t.dtype), tuple(t.shape), nbytes, nbytes, False))
    info.tensors.sort(key=lambda r: _natural_key(r.name))
    return info


def _natural_key(name: str):
    """Sort "layers.10" after "layers.9"."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; inf when identical."""
    ref = reference.detach().float()
    noise = (ref - approx.detach().float()).pow(2).mean()
    if noise == 0:
        return float("inf")
    signal = ref.pow(2).mean()
    if signal == 0:
        return float("-inf")
    return float(10 * torch.log10(signal / noise))


def weight_errors(info: CheckpointInfo, float_path) -> dict[str, float]:
    """{quantized tensor: SQNR in dB of its dequantized weight against the float weight of the
    same name in the checkpoint at `float_path`}. Tensors with no float counterpart of the same
    shape are left out."""
    float_tensors = serialization.open_checkpoint(float_path).tensors()
    out = {}
    for name, q in info.built.items():
        ref = float_tensors.get(name)
        if ref is None or tuple(ref.shape) != tuple(q.shape):
            continue
        out[name] = sqnr(ref, q.dequantize(torch.float32))
    return out


def quality_summary(errors: dict[str, float]) -> dict[str, str]:
    """Figures for a model card from `weight_errors`."""
    if not errors:
        return {}
    finite = [v for v in errors.values() if math.isfinite(v)]
    mean = sum(finite) / len(finite) if finite else float("inf")
    worst_name = min(errors, key=errors.get)
    return {
        "weight SQNR, mean over quantized tensors": f"{mean:.1f} dB ({len(errors)} tensors)",
        "weight SQNR, worst tensor": f"{errors[worst_name]:.1f} dB ({worst_name})",
    }


def format_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
