"""What the serialization modules share: FormatError messages, strict JSON, a GC pause."""
from __future__ import annotations

import gc
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from ..core.errors import FormatError, short

NAME_LIMIT = 200  # how much of a tensor or field name from a file an error message quotes


def error(source: str, problem: str, tensor: str | None = None, part: str | None = None) -> FormatError:
    """`source: tensor 'name', field 'f': problem`; `part` is "field 'f'" or "attribute 'a'".
    The tensor name and the part come from the file, so they are cut to NAME_LIMIT characters."""
    where = source if tensor is None else f"{source}: tensor {short(tensor, NAME_LIMIT)}"
    if part is not None:
        where += f", {part if len(part) <= NAME_LIMIT else part[: NAME_LIMIT - 3] + '...'}"
    return FormatError(f"{where}: {problem}")


def reader_version() -> str:
    from .._version import __version__

    return __version__


@contextmanager
def gc_paused():
    """Pause the cyclic garbage collector. Loading builds thousands of small objects that form
    no cycles; with the collector on, every few hundred of them trigger a collection that walks
    every live object, which costs about a third of the load time. Nothing is leaked: the
    collector only runs later."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _DuplicateKey(ValueError):
    pass


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _DuplicateKey
    return obj


def _no_constant(name: str):
    raise ValueError(f"{name} is not allowed")


def loads_strict(text: str | bytes) -> Any:
    """`json.loads`, refusing duplicate keys and NaN/Infinity. Raises ValueError with a message
    that says what is wrong (and, for a duplicate key, where)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_object, parse_constant=_no_constant)
    except _DuplicateKey:
        try:
            where = _find_duplicate(text)
        except RecursionError:
            where = "a key appears twice in one object"
        raise ValueError(where) from None
    except RecursionError:
        raise ValueError("not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"not valid JSON: {short(str(e), 200)}") from None


def load_json_object(text: str | bytes, source: str, what: str) -> dict:
    """`loads_strict(text)`, which must be a JSON object; otherwise a FormatError naming `source`
    and `what` the text is (e.g. "safetensors header")."""
    try:
        doc = loads_strict(text)
    except ValueError as e:
        raise error(source, f"{what}: {e}") from None
    if type(doc) is not dict:
        raise error(source, f"{what} must be a JSON object, got {short(doc)}")
    return doc


def read_json_file(path, fail: Callable[[str], Exception]) -> dict:
    """The JSON object in the file `path` (a config.json, say), parsed strictly (`loads_strict`);
    otherwise the exception `fail(message)` makes, the message naming `path`."""
    try:
        doc = loads_strict(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise fail(f"{path}: {e}") from None
    if type(doc) is not dict:
        raise fail(f"{path}: expected a JSON object")
    return doc


def _find_duplicate(text: str | bytes) -> str:
    """Where a duplicate key is (error path only): parse again, marking objects that have one."""
    mark = "\0duplicate"

    def hook(pairs):
        obj, seen = {}, set()
        for k, v in pairs:
            if k in seen and mark not in obj:
                obj[mark] = k
            seen.add(k)
            obj[k] = v
        return obj

    def walk(node, path):
        if isinstance(node, dict):
            if mark in node:
                return path, node[mark]
            children = node.items()
        elif isinstance(node, list):
            children = enumerate(node)
        else:
            return None
        for k, v in children:
            found = walk(v, path + [k])
            if found:
                return found
        return None

    path, key = walk(json.loads(text, object_pairs_hook=hook), [])
    place = " / ".join(repr(p) for p in path) if path else "the top level"
    return f"key {key!r} appears twice in one object (at {place})"
