"""transformers' checkpoint conversion mapping and hf_aoq's stored names.

A model's conversion mapping (transformers.conversion_mapping) renames checkpoint keys on load
(Mixtral: `block_sparse_moe.` -> `mlp.`) and converts others (per-expert weights merged into a
fused 3-D tensor); save_pretrained reverses it. hf_aoq stores a quantized tensor as its fields
(`<name>:<field>`), named by the metadata, so:
  - a quantized tensor is stored under the name the reverse *renamings* give it (`stored_names`),
    which is the name a load of the checkpoint renames back to the model's (`load_renaming`);
  - a reverse *conversion* never touches it: fused experts stay one quantized 3-D tensor on disk
    (docs/format.md "Fused experts"), which loads without any conversion. `guard_conversions`
    makes save_pretrained's reversal leave every field key (a key with hf_aoq's separator, which
    transformers' own keys never hold) exactly as hf_aoq wrote it.
"""
from __future__ import annotations

from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, WeightRenaming, apply_renamings

from ... import serialization


def _saved_conversions(model) -> list:
    """The conversions save_pretrained reverses for `model` (as transformers chooses them)."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return list(conversions)


def stored_names(model, names) -> dict[str, str]:
    """{model name: the name save_pretrained's renamings store it under} for `names`."""
    reverse = [c.reverse_transform() for c in _saved_conversions(model)[::-1]]
    renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
    return {n: apply_renamings(n, renamings) if renamings else n for n in names}


def load_renaming(model):
    """stored name -> the model's name for it (the renamings a load of `model` applies)."""
    renamings = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]
    return (lambda stored: apply_renamings(stored, renamings)) if renamings else (lambda stored: stored)


class _LeavesFieldKeys:
    """Mixed into a transform's class: keys of quantized fields pass through unchanged, and so
    they do through the reversed transform (save_pretrained reverses before renaming)."""

    __slots__ = ()

    def rename_source_key(self, source_key: str):
        if serialization.SEPARATOR in source_key:
            return source_key, None
        return super().rename_source_key(source_key)

    def reverse_transform(self):
        return _guarded(super().reverse_transform())


_GUARDED: dict[type, type] = {}


def _guarded(transform):
    cls = type(transform)
    if issubclass(cls, _LeavesFieldKeys):
        return transform
    if cls not in _GUARDED:
        _GUARDED[cls] = type(f"FieldKeysKept{cls.__name__}", (_LeavesFieldKeys, cls), {"__slots__": ()})
    transform.__class__ = _GUARDED[cls]  # same slots, so the object keeps its state
    return transform


def guard_conversions(model) -> None:
    """Make save_pretrained's reversal of `model`'s conversions leave hf_aoq's field keys alone."""
    conversions = _saved_conversions(model)
    if conversions:
        model._weight_conversions = [_guarded(c) for c in conversions]
