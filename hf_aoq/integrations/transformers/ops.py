"""The conversion ops transformers runs for each tensor it reads: `AOQQuantize` (quantize-on-load)
and `AOQLoad` (rebuild a stored quantized tensor), both working through the quantizer's state."""
from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.core_model_loading import ConversionOps

from ... import serialization
from ...core.errors import FormatError

if TYPE_CHECKING:
    from .quantizer import AOQHfQuantizer


def _parent(param_name: str) -> tuple[str, str]:
    module_name, _, leaf = param_name.rpartition(".")
    return module_name, leaf



def _storage_key(name: str, field: str) -> str:
    """Where docs/format.md stores field `field` of the quantized tensor `name`."""
    return f"{name}{serialization.SEPARATOR}{field}"



class _QuantizerOp(ConversionOps):
    """An op that works through the quantizer's shared state (its plan, or the checkpoint's
    metadata). transformers deep-copies a converter, ops included, for every key it loads; a copy
    of the op must share the quantizer, not copy it: a copy per key of the metadata of every
    tensor made loading quadratic (12 of 17 s for a 22-layer int4 checkpoint)."""

    def __init__(self, hf_quantizer: AOQHfQuantizer):
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo):
        return type(self)(self.hf_quantizer)


class AOQQuantize(_QuantizerOp):
    """Quantize the weights transformers has just read (one parameter, or the few a conversion
    produced together); an input embedding that is being untied also yields the output weight."""

    def convert(self, input_dict, missing_keys=None, **kwargs):
        q = self.hf_quantizer
        out = {}
        for name, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            target = q._untied.get(name)
            if target is not None and (missing_keys is None or target in missing_keys):
                out[target] = q._quantized(target, value.detach().clone())
            out[name] = q._quantized(name, value)
        q._release_memory([v[0] if isinstance(v, list) else v for v in input_dict.values()])
        return out


class AOQLoad(_QuantizerOp):
    """Rebuild one quantized parameter from its stored fields, or its float value when the
    config says dequantize. Sources are "<leaf>:<field>" suffixes, e.g. "weight:qdata"."""

    def convert(self, input_dict, model=None, full_layer_name=None, **kwargs):
        leaf = _parent(full_layer_name)[1]
        head = _storage_key(leaf, "")
        fields = {}
        for suffix, tensors in input_dict.items():
            if not suffix.startswith(head):
                raise FormatError(f"{full_layer_name}: stored key suffix {suffix!r} does not belong to it")
            if len(tensors) != 1:
                raise FormatError(f"{full_layer_name}: expected one stored tensor for {suffix!r}, got {len(tensors)}")
            fields[suffix[len(head):]] = tensors[0]
        out = {full_layer_name: self.hf_quantizer._build_one(model, full_layer_name, fields)}
        # e.g. the canonical fields that place() just repacked, and the mapped pages read
        self.hf_quantizer._release_memory(list(fields.values()))
        return out
