"""The decode step's attention of transformers models on hf_aoq's CPU kernel.

`ATTENTION` ("hf_aoq_sdpa") is registered with transformers' AttentionInterface (and the sdpa mask
with AttentionMaskInterface): it is transformers' "sdpa" attention, except that one query token on
CPU (a decode step, any batch) runs kernels/cpu_attention.py's kernel, about a tenth of aten's
time there. `route_decode_attention` switches a model whose attention is "sdpa" to it; the
quantizer and `quantize_` call it, as they give the bf16 linears hf_aoq's GEMV (dense_linear.py).

Only the configs' runtime attention choice changes (`config._attn_implementation`, which
transformers never saves): the weights, the saved files and a reloaded model's choice are as
before. A model set to "eager", "flex_attention" or a flash attention keeps it; calls the kernel
does not take (prefill, GPU, dropout while training, a gradient wanted, position biases, other
dtypes) run transformers' sdpa attention unchanged.

Not switched: a model with a parameter off the CPU, and a model whose modeling code compares
`_attn_implementation` with "sdpa" by name (a few do, to pick a mask format or a shortcut: under
another name they would take their eager branch). transformers' continuous batching accepts
"sdpa" by name only: `model.set_attn_implementation("sdpa")` before it.
"""
from __future__ import annotations

import functools
import inspect
import re
import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kernels import cpu_attention

ATTENTION = "hf_aoq_sdpa"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function interface: (attn_output [B, q, H, Dv], None)."""
    if (query.shape[2] == 1 and position_bias is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False) and not (dropout and module.training)
            and cpu_attention.applies(query, key, value, attention_mask)):
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        return cpu_attention.decode_attention(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, position_bias=position_bias, **kwargs)


AttentionInterface.register(ATTENTION, attention_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def _configs(config):
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)


_SDPA_BY_NAME = re.compile(r'_attn_implementation\b[^\n]*"sdpa"')


@functools.lru_cache(maxsize=None)
def _names_sdpa(module_name: str) -> bool:
    """Whether the transformers modeling module `module_name` compares `_attn_implementation` with
    "sdpa" (or sets it) in its source."""
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return True  # no source to read: assume it might
    return bool(_SDPA_BY_NAME.search(source))


def route_decode_attention(model: torch.nn.Module) -> list[str]:
    """Switch every config of `model` (its sub-configs included) whose attention is transformers'
    "sdpa" to ATTENTION; returns the configs' class names it changed (none the second time, none for
    a module without a transformers config, a model with parameters off the CPU, or a model whose
    modeling code names "sdpa")."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation_internal"):
        return []
    if any(p.device.type != "cpu" for p in model.parameters()):
        return []
    modeling = {type(m).__module__ for m in model.modules()}
    if any(_names_sdpa(name) for name in modeling if name.startswith("transformers.models.")):
        return []
    changed = []
    for c in _configs(config):
        if getattr(c, "_attn_implementation_internal", None) == "sdpa":
            c._attn_implementation_internal = ATTENTION
            changed.append(type(c).__name__)
    return changed
