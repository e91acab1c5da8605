"""Checkpoint files: atomic writes (`save_file`, `save_shards`, `write_atomic`, `replace_folder`) and loads that
place tensors for a device (`load_file`, `load_checkpoint`), reading through `shards`."""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Callable, Mapping

import safetensors
import safetensors.torch
import torch

from ..core.tensor import AOQTensor
from .common import error, gc_paused, short
from .metadata import SEPARATOR
from .shards import INDEX_NAME, SAVE_ID_KEY, WEIGHTS_NAME, check_save_id, new_save_id, open_checkpoint, read_shards
from .state_dict import flatten_state_dict


# ---------------------------------------------------------------------- writing
def write_atomic(path, data: bytes | str) -> None:
    """Write `data` (str is written as UTF-8) to `path` atomically: the file is either the
    complete new content or, if anything fails, left as it was, with no temporary left behind.
    An OSError names `path`."""
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(payload)

    _replace_atomically(os.fspath(path), write)


def replace_folder(staging, out) -> None:
    """Put the complete folder `staging` at `out`, replacing whatever was there as a whole: the
    old `out` is moved aside, and removed only once the new one is in place (put back if the
    move fails), so `out` is never a mix of the two."""
    staging, out = Path(staging), Path(out)
    if not out.exists():
        os.replace(staging, out)
        return
    old = out.parent / f".{out.name}.{secrets.token_hex(6)}.old"
    os.replace(out, old)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()


def save_file(
    state_dict: Mapping[str, torch.Tensor],
    path,
    *,
    extra_metadata: Mapping[str, str] | None = None,
    save_id: str | None = None,
) -> None:
    """Write `state_dict` to one safetensors file, atomically: the file at `path` is either the
    complete new checkpoint or, if anything fails, left as it was (and no temporary is left).
    `save_id` (from `new_save_id`) marks the files of one sharded save (docs/format.md)."""
    tensors, metadata = flatten_state_dict(state_dict)
    path = os.fspath(path)
    extra = dict(extra_metadata or {})
    if save_id is not None:
        extra[SAVE_ID_KEY] = check_save_id(save_id, path)
    for k, v in extra.items():
        if type(k) is not str or type(v) is not str:
            raise error(path, f"extra_metadata must map str to str, got {k!r}: {short(v)}")
        if k in metadata and metadata[k] != v:
            raise error(path, f"extra_metadata may not set the reserved key {k!r}")
        metadata[k] = v
    _replace_atomically(path, lambda tmp: _write_safetensors(tensors, tmp, metadata))


def _write_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    safetensors.torch.save_file(tensors, path, metadata=metadata)


def _replace_atomically(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` to a temporary in `path`'s folder, flush it to disk, rename it over `path`."""
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
    try:
        # O_EXCL: never write through someone else's file. 0o666 lets the umask choose the file's
        # permissions (safetensors alone would make it 0o600); they are put back after the write.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as e:
        raise _naming(e, path) from e
    try:
        mode = os.stat(tmp).st_mode & 0o777
        write(tmp)
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, (OSError, safetensors.SafetensorError)):
            raise _naming(e, path) from e
        raise
    _fsync_directory(directory)


def _naming(e: Exception, path: str) -> OSError:
    """An OSError that says which file could not be written (a full disk, say), keeping errno."""
    code = getattr(e, "errno", None)
    if code is None:  # safetensors reports an I/O error as text: "... Os { code: 28, ..."
        found = re.search(r"code: (\d+)", str(e))
        code = int(found.group(1)) if found else None
    reason = getattr(e, "strerror", None) or str(e)
    if code is None:
        return OSError(f"cannot write {path}: {reason}")
    return OSError(code, f"cannot write {path}: {reason}")


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


def _nbytes(t: torch.Tensor) -> int:
    fields = t.tensor_fields().values() if isinstance(t, AOQTensor) else (t,)
    return sum(f.numel() * f.element_size() for f in fields)


def save_shards(state_dict: Mapping[str, torch.Tensor], folder, max_shard_size: int) -> None:
    """Write `state_dict` into the folder `folder` as `model.safetensors`, or, when larger than
    `max_shard_size` bytes, as shards of whole tensors (each shard's metadata describes its own
    quantized tensors, so each loads on its own) and the index, written last. One save id marks
    every file. The folder must not hold a checkpoint already."""
    folder = os.fspath(folder)
    for name in (WEIGHTS_NAME, INDEX_NAME):
        if os.path.exists(os.path.join(folder, name)):
            raise error(folder, f"already holds {name}; save_shards writes into a folder without a checkpoint")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, t in state_dict.items():
        n = _nbytes(t)
        if shards[-1] and size + n > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
        total += n
    save_id = new_save_id()
    if len(shards) == 1:
        save_file(state_dict, os.path.join(folder, WEIGHTS_NAME), save_id=save_id)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, file), save_id=save_id)
        for name, t in shard.items():
            keys = [f"{name}{SEPARATOR}{f}" for f in t.tensor_fields()] if isinstance(t, AOQTensor) else [name]
            weight_map.update({k: file for k in keys})
    index = {"metadata": {"total_size": total, SAVE_ID_KEY: save_id}, "weight_map": weight_map}
    write_atomic(os.path.join(folder, INDEX_NAME), json.dumps(index, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------- loading
def load_file(path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A state dict from one safetensors file (hf_aoq or plain), on `device`, quantized tensors
    placed for that device's fastest kernel. Never unpickles anything.

    On CPU the tensors view a private map of the file (pages are read when first used); a
    quantized tensor whose `place()` repacks it, or puts its large buffers on huge pages
    (kernels/hugepages.py), gets its own memory."""
    with gc_paused():  # the whole load: see gc_paused
        return _placed(read_shards([os.fspath(path)]).state_dict(), device)


def load_checkpoint(path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """`load_file` for a whole checkpoint: a folder's `model.safetensors`, or the shards its index
    lists, read and checked as one set (docs/format.md), or one .safetensors file."""
    with gc_paused():
        return _placed(open_checkpoint(path).state_dict(), device)


def _placed(state_dict: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    device = torch.device(device)
    move = device.type != "cpu"
    for name, t in state_dict.items():
        if move:
            t = t.to(device)
        if isinstance(t, AOQTensor):
            t = t.place()
        state_dict[name] = t
    return state_dict
