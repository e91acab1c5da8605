"""Converters from other quantization libraries' checkpoints to hf_aoq checkpoints.

    torchao.py          checkpoints written by torchao's safetensors support (docs/torchao.md)
    torchao_format.py   the strict reader of torchao's tensors and metadata that it uses
"""
from .torchao import ConversionSummary, TensorConversion, convert_torchao_checkpoint

__all__ = ["ConversionSummary", "TensorConversion", "convert_torchao_checkpoint"]
