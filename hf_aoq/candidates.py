"""Mixed-precision candidates: the ways a sensitivity report (hf_aoq.sensitivity) may store a
weight, named as `hf-aoq analyze --schemes` and `AOQConfig(candidates=...)` take them.

A candidate is a scheme name of hf_aoq.configs.SCHEMES, optionally with ":g<group size>" and
"+gptq" ("int3-asym:g32+gptq": its values chosen by GPTQ, hf_aoq.gptq, on the layer's
calibration inputs) or "+gptq-act" (the same, columns in act order: gptq_sweep's `act_order`),
"bf16" (keep float), or a config. GPTQ changes the values only: the
candidate's config, and so the recipe a mixed-precision choice emits, is an ordinary one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from .configs import AOQBaseConfig, config_for_scheme
from .core.errors import AOQError
from .core.tensor import AOQTensor

FLOAT_NAMES = ("bf16", "float")  # a candidate that leaves the weight as it is
CALIBRATIONS = ("gptq", "gptq-act")  # what a candidate's "+<method>" suffix may name (-act: act order)


@dataclass(frozen=True)
class Candidate:
    """One way to store a weight: `config` (None: leave it in float), under a short `name`;
    `calibration` "gptq": its values chosen by GPTQ (hf_aoq.gptq) on the layer's calibration
    inputs (the tensor type, and so the recipe, is the config's own); "gptq-act": the same with
    the columns in act order."""

    name: str
    config: AOQBaseConfig | None
    calibration: str | None = None

    @property
    def act_order(self) -> bool:
        """Whether GPTQ takes this candidate's columns in act order (hf_aoq.gptq.gptq_sweep)."""
        return self.calibration == "gptq-act"

    def __post_init__(self):
        if self.calibration is None:
            return
        from .gptq import GPTQ_CONFIGS

        if self.calibration not in CALIBRATIONS:
            raise AOQError(f"candidate {self.name!r}: calibration must be one of {CALIBRATIONS}, got {self.calibration!r}")
        if type(self.config) not in GPTQ_CONFIGS:
            raise AOQError(f"candidate {self.name!r}: GPTQ calibrates {', '.join(c.__name__ for c in GPTQ_CONFIGS)} "
                           f"weights (int4, int4-plain, int2..int6[-asym]), not {type(self.config).__name__}")


def parse_candidate(item: "str | AOQBaseConfig | Candidate") -> Candidate:
    """A candidate from a scheme name ("int4", "int8", "int4-plain:g32": a scheme of
    hf_aoq.configs.SCHEMES, optionally with ":g<group size>", optionally with "+gptq": its
    values chosen by GPTQ, e.g. "int3-asym:g32+gptq", or "+gptq-act": GPTQ in act order;
    "bf16": keep float), a config, or a Candidate."""
    if isinstance(item, Candidate):
        return item
    if isinstance(item, AOQBaseConfig):
        return Candidate(repr(item), item)
    if not isinstance(item, str) or not item.strip():
        raise AOQError(f"a candidate is a scheme name (e.g. int4, int8, int4-plain:g32, bf16) or a config, got {item!r}")
    name = item.strip()
    if name in FLOAT_NAMES:
        return Candidate(name, None)
    spec, plus, calibration = name.partition("+")
    if plus and calibration not in CALIBRATIONS:
        raise AOQError(f"candidate {name!r}: after '+' comes a calibration method, one of {CALIBRATIONS} "
                       f"(e.g. int3-asym:g32+gptq)")
    scheme, _, group = spec.partition(":")
    group_size = None
    if group:
        if not (group.startswith("g") and group[1:].isdigit()):
            raise AOQError(f"candidate {name!r}: the group size is written :g<N>, e.g. int4-plain:g32")
        group_size = int(group[1:])
    return Candidate(name, config_for_scheme(scheme, group_size), calibration or None)


def parse_candidates(items: "str | Iterable[str | AOQBaseConfig | Candidate]") -> list[Candidate]:
    """Candidates from a comma-separated string or a list; names must be distinct."""
    if isinstance(items, str):
        items = [s for s in items.split(",") if s.strip()]
    out = [parse_candidate(i) for i in items]
    if not out:
        raise AOQError("sensitivity needs at least one candidate scheme")
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise AOQError(f"candidate names repeat: {names}")
    return out


# ---------------------------------------------------------------------- calibrated candidates
def quantize_candidate(candidate: Candidate, weight: torch.Tensor, *, gram: torch.Tensor | None = None,
                       name: str = "weight") -> AOQTensor:
    """The tensor `candidate` makes of `weight`; a GPTQ candidate needs `gram`, the Gram matrix
    X^T X of its linear's calibration inputs."""
    if candidate.calibration is None:
        return candidate.config.quantize_weight(weight, name=name)
    if gram is None:
        raise AOQError(f"{name}: candidate {candidate.name!r} is chosen by GPTQ and needs its linear's input Gram matrix")
    from .gptq import gptq_quantize

    return gptq_quantize(weight, gram, candidate.config, act_order=candidate.act_order, name=name)


def input_grams(model: nn.Module, names: Iterable[str], batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{weight name: X^T X of the inputs of the one linear that reads it, over `batches`} (a
    forward pass; weights read by several modules, or by an embedding, are left out)."""
    from .calibration import _grams
    from .sensitivity import _logits

    targets, by_module = {}, {}
    for name in names:
        module_name = name.rpartition(".")[0]
        module = model.get_submodule(module_name)
        readers = [m for n, m in model.named_modules(remove_duplicate=False)
                   if getattr(m, "weight", None) is model.get_parameter(name)]
        if isinstance(module, nn.Linear) and len(readers) == 1:
            targets[module_name] = (module, None)
            by_module[module_name] = name
    if not targets:
        return {}
    with torch.no_grad():
        grams = _grams(targets, list(targets), lambda: [_logits(model, ids) for ids in batches])
    return {by_module[m]: g for m, g in grams.items()}
