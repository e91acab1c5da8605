"""A checkpoint as a set of safetensors files, read by the rules of docs/format.md: which files
make it (one `model.safetensors`, or the shards its index lists, each in the checkpoint's folder),
whether they come from one save (save ids), and the union of their keys and hf_aoq metadata,
checked before any tensor is built. Every hf_aoq load path reads checkpoints through here:
`open_checkpoint` (a folder or a file), `read_loader_files` (the files transformers resolved)."""
from __future__ import annotations

import os
import re
import secrets
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..core.errors import AOQError, FormatError
from .common import NAME_LIMIT, error, loads_strict, short
from .metadata import METADATA_KEY, TensorEntry, read_metadata
from .reader import Header, Stored, read_header, read_tensors
from .state_dict import assemble, key_problems

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SAVE_ID_KEY = "hf_aoq_save_id"  # in each shard's __metadata__, and in the index's "metadata"
_SAVE_ID = re.compile(r"[0-9a-f]{32}")
_INDEX_KEYS = frozenset({"metadata", "weight_map"})


def new_save_id() -> str:
    """A fresh identifier for one save: every file it writes carries it."""
    return secrets.token_hex(16)


def check_save_id(value, source: str) -> str:
    if type(value) is not str or not _SAVE_ID.fullmatch(value):
        raise error(source, f"{SAVE_ID_KEY} must be 32 lowercase hex digits, got {short(value)}")
    return value


# ---------------------------------------------------------------------- which files
@dataclass(frozen=True)
class Index:
    """A `model.safetensors.index.json`, checked."""

    path: str
    shards: tuple[str, ...]  # file names in the index's folder, in order of first mention
    weight_map: dict[str, str]  # storage key -> file name
    save_id: str | None


def _plain_file_name(name) -> bool:
    return (
        type(name) is str
        and name.endswith(".safetensors")
        and not any(c in name for c in "/\\:\0")
        and name not in (".", "..")
        and not os.path.isabs(name)
    )


def read_index(path) -> Index:
    """Parse an index strictly: an object with `weight_map` (storage key -> shard file name) and
    optionally `metadata`; every shard a plain file name in the index's own folder."""
    source = os.fspath(path)
    with open(source, "rb") as f:
        raw = f.read()
    try:
        doc = loads_strict(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise error(source, "not a checkpoint index: not UTF-8") from None
    except ValueError as e:
        raise error(source, f"not a checkpoint index: {e}") from None
    if type(doc) is not dict:
        raise error(source, f"a checkpoint index must be a JSON object, got {short(doc)}")
    if not doc.keys() <= _INDEX_KEYS or "weight_map" not in doc:
        extra = sorted(doc.keys() - _INDEX_KEYS)
        problem = f"unknown key {short(extra[0])}" if extra else "no 'weight_map'"
        raise error(source, f"checkpoint index: {problem}; an index has 'weight_map' and 'metadata'")
    weight_map = doc["weight_map"]
    if type(weight_map) is not dict or not weight_map:
        raise error(source, f"checkpoint index: 'weight_map' must be a non-empty object, got {short(weight_map)}")
    for key, name in weight_map.items():
        if not _plain_file_name(name):
            raise error(source, f"checkpoint index: {short(key, NAME_LIMIT)} is in shard {short(name)}, which is "
                                f"not a .safetensors file in the index's folder (an index may name only files "
                                f"next to it: no folders, no absolute paths)")
    metadata = doc.get("metadata", {})
    if type(metadata) is not dict:
        raise error(source, f"checkpoint index: 'metadata' must be an object, got {short(metadata)}")
    save_id = metadata.get(SAVE_ID_KEY)
    if save_id is not None:
        check_save_id(save_id, f"{source}: metadata")
    return Index(source, tuple(dict.fromkeys(weight_map.values())), weight_map, save_id)


def checkpoint_files(path) -> tuple[str, list[str], Index | None]:
    """(source, files, index) of a checkpoint folder (its `model.safetensors`, or the shards its
    index lists) or of one .safetensors file. A folder holding both is refused: one of them is
    left over from an older save, and nothing says which."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path, [path], None
    if not os.path.isdir(path):
        raise AOQError(f"{path}: no such folder")
    index, single = os.path.join(path, INDEX_NAME), os.path.join(path, WEIGHTS_NAME)
    has_index, has_single = os.path.isfile(index), os.path.isfile(single)
    if has_index and has_single:
        raise FormatError(
            f"{path}: holds both {WEIGHTS_NAME} and {INDEX_NAME}, so which files are the checkpoint is not "
            f"clear (one is left over from an older save); remove the stale one, or save into an empty folder"
        )
    if has_index:
        idx = read_index(index)
        return path, [os.path.join(path, name) for name in idx.shards], idx
    if has_single:
        return path, [single], None
    raise AOQError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME}; is it a checkpoint folder written by save_pretrained?")


# ---------------------------------------------------------------------- the set
@dataclass
class Checkpoint:
    """The union of a checkpoint's files, checked as a set; `problems()` are the key-level
    disagreements that are left (each about one tensor), `check()` raises the first."""

    source: str  # the folder, or the one file
    files: list[str]
    index: Index | None
    headers: dict[str, Header]  # file -> its header
    where: dict[str, str]  # storage key -> the file that holds it
    entries: dict[str, TensorEntry]  # quantized tensor -> its metadata entry (from any shard)
    save_id: str | None = None
    format_versions: list[int] = field(default_factory=list)
    writers: list[str] = field(default_factory=list)
    without_metadata: list[str] = field(default_factory=list)  # files with no hf_aoq metadata
    duplicates: list[tuple[str, FormatError]] = field(default_factory=list)  # keys in two files

    @property
    def sharded(self) -> bool:
        return self.index is not None or len(self.files) > 1

    def stored(self, key: str) -> Stored:
        """What the header says of one stored tensor (its dtype and shape), read from no data."""
        return self.headers[self.where[key]].tensors[key]

    def file_of(self, entry: TensorEntry) -> str:
        """The file holding the entry's fields, or the checkpoint when they are in several."""
        files = {self.where.get(k) for k in entry.keys.values()}
        return files.pop() if len(files) == 1 and None not in files else self.source

    def problems(self) -> list[tuple[str, FormatError]]:
        """(tensor or key, error) for each disagreement between the stored keys, the metadata
        and the index; empty when the checkpoint is consistent."""
        where = self.where if self.sharded else None
        problems = key_problems(self.where, self.entries, self.source, where) + self.duplicates
        if self.index is not None:
            problems += _weight_map_problems(self.index, self.where)
        return problems

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise problems[0][1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every stored tensor, viewing a private map of its file (data is read when used)."""
        if len(self.files) == 1:
            return read_tensors(self.headers[self.files[0]])
        out: dict[str, torch.Tensor] = {}
        for file in self.files:
            out.update(read_tensors(self.headers[file]))
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Quantized tensors rebuilt (canonical layout) and plain tensors, from all the files."""
        if not self.sharded:  # one file: assemble checks its keys as it goes
            return assemble(self.tensors(), self.entries, self.source)
        self.check()
        return assemble(self.tensors(), self.entries, self.source, self.where)


def open_checkpoint(path) -> Checkpoint:
    """The checkpoint in a folder (or one file), its files found by `checkpoint_files`."""
    source, files, index = checkpoint_files(path)
    return read_shards(files, index=index, source=source)


def read_loader_files(files, *, folder_hint: str | None = None) -> Checkpoint:
    """The checkpoint whose files a loader (transformers' from_pretrained) resolved on its own.
    Their folder is found (where most of them are, else `folder_hint`) and read by the same
    rules as `open_checkpoint`; the loader's files must be the checkpoint's. A folder holding
    neither `model.safetensors` nor an index (files the loader was told to use by name, or
    variants) is read as the files given."""
    files = [os.fspath(f) for f in files]
    counts = Counter(os.path.dirname(f) for f in files)
    candidates = [d for d, _ in counts.most_common()] + ([os.fspath(folder_hint)] if folder_hint else [])
    folder = next((d for d in candidates if os.path.isdir(d) and (
        os.path.isfile(os.path.join(d, INDEX_NAME)) or os.path.isfile(os.path.join(d, WEIGHTS_NAME)))), None)
    if folder is None:  # files the loader was told to use by name
        return read_shards(files, source=os.path.dirname(files[0]) if len(files) > 1 else files[0])
    source, expected, index = checkpoint_files(folder)
    real = {os.path.normpath(os.path.abspath(f)): f for f in expected}
    if index is None and len(files) == 1 and os.path.normpath(os.path.abspath(files[0])) not in real:
        return read_shards(files)  # one file named otherwise (a variant, say) next to model.safetensors
    for f in files:
        if os.path.normpath(os.path.abspath(f)) not in real:
            listed = f"the shards {INDEX_NAME} lists" if index is not None else WEIGHTS_NAME
            raise FormatError(f"{source}: the loader reads {short(f, NAME_LIMIT)}, which is not a file of this "
                              f"checkpoint ({listed})")
    return read_shards(expected, index=index, source=source)


def read_shards(files, *, index: Index | None = None, source: str | None = None) -> Checkpoint:
    """Read the headers of `files` (not their data) and check them as one checkpoint: every
    header well-formed, one save id, every metadata entry parsed and the same wherever it is
    repeated. Raises FormatError naming the files. What is left to check key by key (listed keys
    stored, field keys listed, no key in two files, the index's weight_map exactly what the files
    hold: `Checkpoint.problems`) is checked by `Checkpoint.check` and `Checkpoint.state_dict`."""
    files = [os.fspath(f) for f in files]
    source = source or (files[0] if len(files) == 1 else os.path.dirname(files[0]))
    headers: dict[str, Header] = {}
    for f in files:
        if index is not None and not os.path.isfile(f):
            raise error(f, f"listed in {index.path} but missing")
        headers[f] = read_header(f)
    save_id = _one_save(source, headers, index)
    where: dict[str, str] = {}
    ckpt = Checkpoint(source, files, index, headers, where, {}, save_id)
    for f, header in headers.items():
        before = len(where)
        where.update(dict.fromkeys(header.tensors, f))
        if len(where) != before + len(header.tensors):  # a key of this file is in an earlier one
            for key in header.tensors:
                other = next(g for g in files if key in headers[g].tensors)
                if other != f:
                    where[key] = other
                    problem = f"{short(key, NAME_LIMIT)} is stored in both {_name(other)} and {_name(f)}"
                    ckpt.duplicates.append((key, error(source, problem)))
    seen: set[str] = set()
    described: dict[str, str] = {}  # tensor -> the file whose metadata described it
    for f, header in headers.items():
        metadata = header.metadata or {}
        text = metadata.get(METADATA_KEY)
        if text is None:
            ckpt.without_metadata.append(f)
            continue
        if text in seen:  # save_pretrained writes the same text into every shard: parse it once
            continue
        seen.add(text)
        version, writer, entries = read_metadata(metadata, source=f)
        if version not in ckpt.format_versions:
            ckpt.format_versions.append(version)
        if writer not in ckpt.writers:
            ckpt.writers.append(writer)
        for name, entry in entries.items():
            first = ckpt.entries.setdefault(name, entry)
            if first is not entry and first != entry:
                raise error(f, f"described differently in {_name(described[name])}", name)
            described.setdefault(name, f)
    return ckpt


def _name(path: str) -> str:
    return os.path.basename(path)


def _one_save(source: str, headers: dict[str, Header], index: Index | None) -> str | None:
    """The save id every file carries; an error naming the files when they disagree."""
    ids = {f: (h.metadata or {}).get(SAVE_ID_KEY) for f, h in headers.items()}
    for f, value in ids.items():
        if value is not None:
            check_save_id(value, f"{f}: __metadata__")
    found = set(ids.values())
    if index is not None and index.save_id is not None:  # transformers writes indexes without one
        found.add(index.save_id)
    if len(found) <= 1:
        return found.pop() if found else None
    groups: dict[str | None, list[str]] = {}
    for f, value in ids.items():
        groups.setdefault(value, []).append(_name(f))
    parts = []
    for value, names in groups.items():
        names.sort()
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        parts.append(f"{'no save id' if value is None else 'save ' + value[:12]} in {shown}")
    if index is not None and index.save_id is not None:
        parts.append(f"save {index.save_id[:12]} in {INDEX_NAME}")
    raise FormatError(
        f"{source}: the checkpoint's files come from different saves ({'; '.join(parts)}), as when a save over "
        f"an older checkpoint was interrupted; loading them together would mix two models: save the model again"
    )


def _weight_map_problems(index: Index, where: dict[str, str]) -> list[tuple[str, FormatError]]:
    """The index must list exactly the stored keys, each in the file that holds it: a stale index
    (not written by the save that wrote the shards) is refused."""
    folder = os.path.dirname(index.path)
    out = []
    for key, name in index.weight_map.items():
        f = where.get(key)
        if f is None:
            out.append((key, error(index.path, f"lists {short(key, NAME_LIMIT)} in {name}, but no shard holds it")))
        elif _name(f) != name or os.path.dirname(f) != folder:
            out.append((key, error(index.path, f"lists {short(key, NAME_LIMIT)} in {name}, but it is in {_name(f)}")))
    if len(where) != len(index.weight_map) or out:
        for key, f in where.items():
            if key not in index.weight_map:
                out.append((key, error(f, f"holds {short(key, NAME_LIMIT)}, which {INDEX_NAME} does not list")))
    return out
