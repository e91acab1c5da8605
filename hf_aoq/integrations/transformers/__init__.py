"""hf_aoq as a transformers quantizer: `AOQConfig` and the "aoq" `HfQuantizer`.

`import hf_aoq` registers both with transformers under the quant method "aoq"; then

    from_pretrained(path, quantization_config=AOQConfig(...))   quantizes each weight as it is read
    save_pretrained(out)                                        writes safetensors + hf_aoq metadata
    from_pretrained(out)                                        rebuilds the quantized tensors
    model.dequantize()                                          returns to a float model

Which parameter gets which config is decided once, on the empty (meta) model, before any weight
is read (`_plan_quantization`, `_read_checkpoint`); the loader then hands over one tensor at a
time to `AOQQuantize` or `AOQLoad`. Everything else is delegated: configs and their JSON to
hf_aoq.configs, tensor layouts to the tensor types, the file format to hf_aoq.serialization.
docs/transformers.md describes the behaviour for users.

The package is split as transformers splits a quantization method: `config` (AOQConfig and its
config.json form), `quantizer` (AOQHfQuantizer: the plan, the checkpoint's metadata, the loading
hooks, saving), `ops` (the per-tensor conversion ops), `sizes` (the size probe behind the plan's
byte counts); this module registers the first two with transformers.
"""
from __future__ import annotations

from transformers.quantizers import register_quantization_config, register_quantizer
from transformers.quantizers import auto as _auto

from ...core.errors import AOQError
from .config import CONFIG_VERSION, QUANT_METHOD, AOQConfig
from .ops import AOQLoad, AOQQuantize
from .quantizer import AOQHfQuantizer

__all__ = ["AOQConfig", "AOQHfQuantizer", "AOQLoad", "AOQQuantize", "CONFIG_VERSION", "QUANT_METHOD", "register"]


# ---------------------------------------------------------------------- registration
def register() -> None:
    """Register AOQConfig and AOQHfQuantizer with transformers under "aoq" (idempotent)."""
    for table, cls, hook in (
        (_auto.AUTO_QUANTIZATION_CONFIG_MAPPING, AOQConfig, register_quantization_config),
        (_auto.AUTO_QUANTIZER_MAPPING, AOQHfQuantizer, register_quantizer),
    ):
        existing = table.get(QUANT_METHOD)
        if existing is None:
            hook(QUANT_METHOD)(cls)
        elif existing is not cls:
            owner = f"{existing.__module__}.{existing.__name__}"
            raise AOQError(f"transformers already has {owner} registered as {QUANT_METHOD!r}")
    # transformers copies loading attributes (ours: `dequantize`) from the config given to
    # from_pretrained onto the checkpoint's only for the config types in this tuple, and has no
    # public hook to extend it. Without this, AOQConfig(dequantize=True) would be ignored with
    # a warning; tests/integrations/test_transformers.py checks that it is honoured.
    loading_types = getattr(_auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
    if isinstance(loading_types, tuple) and AOQConfig not in loading_types:
        _auto.LOADING_ATTRIBUTES_CONFIG_TYPES = loading_types + (AOQConfig,)


register()
