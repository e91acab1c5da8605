"""Digests of hf_aoq's own sources, for the caches that must not outlive a change to them.

torch.compile's on-disk cache keys a graph on the traced program, which holds
`torch.nn.functional.linear` rather than hf_aoq's kernel code: `AOQTensor._stable_hash_for_caching`
adds `package_source_digest()` so that another hf_aoq (other kernels, other op arguments) never
reuses a graph compiled by this one. The C++ extension's build cache (kernels/cpu_ext.py) keys its
binaries with `digest_files` over the sources it compiles.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Iterable

SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def digest_files(files: Iterable[tuple[str, bytes]]) -> str:
    """sha256 of (name, content) pairs, in the order given; a name is part of what is hashed."""
    h = hashlib.sha256()
    for name, content in files:
        h.update(name.encode() + b"\0" + content + b"\0")
    return h.hexdigest()


def source_digest(root: Path) -> str:
    """sha256 of the Python and C++ sources under `root`, with their relative paths, in path order."""
    paths = sorted(p for p in Path(root).rglob("*") if p.suffix in SOURCE_SUFFIXES)
    return digest_files((str(p.relative_to(root)), p.read_bytes()) for p in paths)


@functools.lru_cache(maxsize=None)
def package_source_digest() -> str:
    """The hf_aoq package's `source_digest`, once per process."""
    return source_digest(Path(__file__).resolve().parents[1])
