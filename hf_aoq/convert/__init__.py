"""Converters from other quantization libraries' checkpoints to hf_aoq checkpoints.

    torchao.py          checkpoints written by torchao's safetensors support (docs/torchao.md)
    torchao_format.py   the strict reader of torchao's tensors and metadata that it uses
    compressed_tensors.py  hf_aoq tensors <-> compressed-tensors' stored form (docs/compressed_tensors.md)
    gguf_file.py        the GGUF container, read and written from the spec (docs/gguf.md)
    gguf.py             hf_aoq tensors <-> GGUF blocks (Q4_0, Q4_1, Q8_0; Q4_K, Q6_K read)
    gguf_meta.py        GGUF tensor names, llama and tokenizer metadata
    gguf_checkpoint.py  export to / convert from one GGUF file (hf-aoq export --format gguf, convert)
    mxfp4.py            transformers' Mxfp4 checkpoints (gpt-oss *_blocks / *_scales) -> MXTensor experts
"""
from .torchao import ConversionSummary, TensorConversion, convert_torchao_checkpoint

__all__ = ["ConversionSummary", "TensorConversion", "convert_torchao_checkpoint"]
