"""quantize_: quantize the weights of any nn.Module in place, by a config or a per-layer recipe."""
from __future__ import annotations

import warnings
from typing import Callable

from torch import nn

from .configs import AOQBaseConfig, FqnToConfig
from .core.errors import AOQError
from .core.tensor import AOQTensor


def _default_filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear)


def quantize_(
    model: nn.Module,
    config: AOQBaseConfig | FqnToConfig,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Replace weights of `model` with quantized tensors, in place; returns `model`.

    A single config applies to the 2-D `weight` of every module for which
    `filter_fn(module, fqn)` is true (default: every nn.Linear). An FqnToConfig decides per parameter (see
    hf_aoq.configs); `filter_fn`, when given, further restricts which modules it touches.
    A tensor shared by several modules (tied weights) is quantized once and stays shared.
    """
    if not isinstance(config, (AOQBaseConfig, FqnToConfig)):
        raise AOQError(f"quantize_ needs a quantization config or FqnToConfig, got {type(config).__name__}")
    plans = []  # (module, param name, fqn, config)
    users: dict[int, list[nn.Module]] = {}
    seen_keys: set[str] = set()
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            users.setdefault(id(param), []).append(module)
            fqn = f"{module_fqn}.{pname}" if module_fqn else pname
            if isinstance(config, FqnToConfig):
                hit, cfg = config.resolve(fqn, module_fqn, module, pname)
                if hit:
                    seen_keys.update({fqn, module_fqn})
            if isinstance(param, AOQTensor):
                continue  # already quantized (e.g. by calibration), counted as seen above
            if isinstance(config, FqnToConfig):
                if filter_fn is not None and not filter_fn(module, module_fqn):
                    cfg = None
            else:
                wanted = pname == "weight" and param.ndim == 2
                cfg = config if wanted and (filter_fn or _default_filter)(module, module_fqn) else None
            if cfg is not None:
                plans.append((module, pname, fqn, param, cfg))

    if isinstance(config, FqnToConfig):
        unused = config.exact_keys() - seen_keys
        if unused:
            warnings.warn(f"FqnToConfig names that match no parameter or module: {sorted(unused)}", stacklevel=2)

    done: dict[int, tuple[object, nn.Parameter]] = {}
    for module, pname, fqn, param, cfg in plans:
        if id(param) in done:
            first_cfg, new_param = done[id(param)]
            if first_cfg != cfg:
                raise AOQError(f"{fqn} is shared with another module but resolves to a different config")
        else:
            q = cfg.quantize_weight(param.detach(), name=fqn)
            if all(isinstance(m, nn.Linear) for m in users[id(param)]):
                q = q.place()
            new_param = nn.Parameter(q, requires_grad=False)
            done[id(param)] = (cfg, new_param)
        setattr(module, pname, new_param)
    return model
