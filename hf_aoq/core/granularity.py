"""Granularities: which elements of a weight share one scale (and zero point).

A granularity is turned into a `block_size` tuple for a given shape; the quantization
primitives only ever see block sizes, so there is one code path for all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import AOQError


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor."""

    def block_size(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)


@dataclass(frozen=True)
class PerRow:
    """One scale per output row (the last dimension is reduced)."""

    def block_size(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (1,) * (len(shape) - 1) + (shape[-1],)


@dataclass(frozen=True)
class PerGroup:
    """One scale per `group_size` consecutive elements of a row."""

    group_size: int

    def __post_init__(self):
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise AOQError(f"PerGroup.group_size must be a positive int, got {self.group_size!r}")

    def block_size(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if shape[-1] % self.group_size != 0:
            raise AOQError(
                f"group_size {self.group_size} does not divide the input dimension {shape[-1]} "
                f"of a weight of shape {tuple(shape)}"
            )
        return (1,) * (len(shape) - 1) + (self.group_size,)


Granularity = PerTensor | PerRow | PerGroup
