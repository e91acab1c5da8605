"""Digests of hf_aoq's own sources, for the caches that must not outlive a change to them.

torch.compile's on-disk caches key a graph on the traced program. AOT autograd's cache sees
`torch.nn.functional.linear` rather than hf_aoq's kernel code: `AOQTensor._stable_hash_for_caching`
adds `package_source_digest()` so that another hf_aoq (other kernels, other op arguments) never
reuses a graph compiled by this one. Inductor's FX graph cache sees hf_aoq's ops by name and
arguments, not their schemas: a graph traced anew whose calls read the same as an older hf_aoq's
took that hf_aoq's compiled code, which filled in the old schema's arguments (found when an op lost
an optional argument: "expected at most 9 argument(s) but received 10"). `tag_compile_caches`
puts the digest in torch's cache key tag, which both caches (and every graph compiled in a process
that imported hf_aoq) are keyed on. The C++ extension's build cache (kernels/cpu_ext.py) keys its
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


TAG_PREFIX = "hf_aoq-"


def tag_compile_caches() -> None:
    """Adds `hf_aoq-<package_source_digest>` to torch.compiler.config.cache_key_tag (the
    TORCH_COMPILE_CACHE_KEY_TAG a user may set too: its words are kept, an earlier hf_aoq word is
    replaced). Called when hf_aoq is imported (core/tensor.py)."""
    import torch

    config = torch.compiler.config
    kept = [w for w in config.cache_key_tag.split(" ") if w and not w.startswith(TAG_PREFIX)]
    config.cache_key_tag = " ".join(kept + [TAG_PREFIX + package_source_digest()[:32]])
