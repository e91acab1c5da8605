"""One checkpoint file: an atomic `save_file` and a `load_file` that places tensors for a device."""
from __future__ import annotations

import os
import secrets
from typing import Mapping

import safetensors.torch
import torch

from ..core.tensor import AOQTensor
from .common import error, short
from .metadata import parse_metadata
from .reader import read_safetensors
from .state_dict import assemble, flatten_state_dict


def save_file(
    state_dict: Mapping[str, torch.Tensor], path, *, extra_metadata: Mapping[str, str] | None = None
) -> None:
    """Write `state_dict` to one safetensors file, atomically: the file at `path` is either the
    complete new checkpoint or, if anything fails, left as it was (and no temporary is left)."""
    tensors, metadata = flatten_state_dict(state_dict)
    path = os.fspath(path)
    for k, v in (extra_metadata or {}).items():
        if type(k) is not str or type(v) is not str:
            raise error(path, f"extra_metadata must map str to str, got {k!r}: {short(v)}")
        if k in metadata and metadata[k] != v:
            raise error(path, f"extra_metadata may not set the reserved key {k!r}")
        metadata[k] = v
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
    # O_EXCL: never write through someone else's file. 0o666 lets the umask choose the file's
    # permissions (safetensors alone would make it 0o600); they are put back after the write.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        mode = os.stat(tmp).st_mode & 0o777
        _write_safetensors(tensors, tmp, metadata)
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _write_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    safetensors.torch.save_file(tensors, path, metadata=metadata)


def _fsync_directory(directory: str) -> None:
    """Make the rename durable where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_file(path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A state dict from one safetensors file (hf_aoq or plain), on `device`, quantized tensors
    placed for that device's fastest kernel. Never unpickles anything.

    On CPU the tensors view a private map of the file (pages are read when first used); a
    quantized tensor whose `place()` repacks it gets its own memory."""
    source = os.fspath(path)
    device = torch.device(device)
    tensors, metadata = read_safetensors(source)
    state_dict = assemble(tensors, parse_metadata(metadata, source=source), source)
    move = device.type != "cpu"
    for name, t in state_dict.items():
        if move:
            t = t.to(device)
        if isinstance(t, AOQTensor):
            t = t.place()
        state_dict[name] = t
    return state_dict
