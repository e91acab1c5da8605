"""The model card (README.md) of a quantized checkpoint, rendered from model_cards/quantized_model.md.

Every `save_pretrained` of a model quantized by hf_aoq writes one into the folder: a new card
when the folder has none, otherwise the card is kept and its "Quantization" section (between
the two `hf_aoq:quantization` markers) is added or replaced, so saving again changes nothing
else. `push_to_hub` does the same to the card it uploads. The content comes from the saved
files themselves (hf_aoq.checkpoint): sizes, what each layer group is stored as, versions.
"""
from __future__ import annotations

import functools
import json
import os
import re
import secrets
import string
import warnings
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from .checkpoint import CheckpointInfo, TensorInfo, format_bytes, read_checkpoint

CARD_NAME = "README.md"
TEMPLATE_NAME = "quantized_model.md"
START = "<!-- hf_aoq:quantization:start"
END = "<!-- hf_aoq:quantization:end -->"
# The card transformers writes when it has nothing better; it is replaced, not extended.
_TRANSFORMERS_DEFAULT = "This is the model card of a 🤗 transformers model that has been pushed on the Hub."
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def template() -> str:
    """The card template: package data, which in a source checkout is model_cards/ itself."""
    here = resources.files("hf_aoq").joinpath("model_cards", TEMPLATE_NAME)
    try:
        return here.read_text(encoding="utf-8")
    except FileNotFoundError:  # a checkout where the package-data link was not kept
        return (Path(__file__).resolve().parent.parent / "model_cards" / TEMPLATE_NAME).read_text(encoding="utf-8")


# ---------------------------------------------------------------------- layer groups
def _ranges(numbers: list[int]) -> str:
    numbers = sorted(set(numbers))
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(parts)


def _split(name: str) -> tuple[str, tuple[int, ...]]:
    parts = name.removesuffix(".weight").split(".")
    return ".".join("*" if p.isdigit() else p for p in parts), tuple(int(p) for p in parts if p.isdigit())


def layer_groups(tensors: list[TensorInfo]) -> list[tuple[str, str, int]]:
    """(layer pattern, scheme, tensor count) for the quantized tensors, in checkpoint order.

    Names that differ only in their numbers (layer, expert) and share a scheme form one group,
    written with `*` ("model.layers.*.self_attn.q_proj") when the scheme covers every such name
    in the checkpoint; otherwise the first number is listed ("model.layers.{0-3,7}.mlp.down_proj").
    """
    everyone: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    members: dict[tuple[str, str], list[tuple[int, ...]]] = {}
    for t in tensors:
        pattern, numbers = _split(t.name)
        everyone[pattern].add(numbers)
        if t.quantized:
            members.setdefault((pattern, t.scheme), []).append(numbers)
    out = []
    for (pattern, scheme), numbers in members.items():
        if "*" in pattern and set(numbers) != everyone[pattern]:
            listed = _ranges([n[0] for n in numbers])
            pattern = pattern.replace("*", listed if listed.isdigit() else "{" + listed + "}", 1)
        out.append((pattern, scheme, len(numbers)))
    return out


# ---------------------------------------------------------------------- rendering
def _front_matter(base_model: str | None, schemes: list[str]) -> str:
    lines = ["library_name: transformers"]
    if base_model and _is_hub_id(base_model):
        lines += [f"base_model: {json.dumps(base_model)}", "base_model_relation: quantized"]
    tags = ["hf_aoq", "quantized"] + sorted({s.split()[0] for s in schemes})
    lines.append("tags:")
    lines += [f"- {json.dumps(t)}" for t in dict.fromkeys(tags)]
    return "\n".join(lines)


def _is_hub_id(name: str) -> bool:
    """"owner/name" that is not also a local path (the card's front matter wants Hub ids only)."""
    return bool(_HUB_ID.fullmatch(name)) and not os.path.exists(name)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _values(
    info: CheckpointInfo, base_model: str | None, load_name: str | None, quality: Mapping[str, Any] | None
) -> dict[str, str]:
    from . import __version__

    quantized = info.quantized
    groups = layer_groups(info.tensors)
    rows = "\n".join(f"| `{_cell(p)}` | {n} | {_cell(s)} |" for p, s, n in groups) or "| (none) | 0 | |"
    floats = [t for t in info.tensors if not t.quantized]
    if floats:
        dtypes = ", ".join(sorted({t.scheme for t in floats}))
        nbytes = sum(t.bytes_after for t in floats)
        float_note = (
            f"The other {len(floats)} tensors (embeddings, norms, and any layer the recipe skips) are "
            f"stored unquantized ({dtypes}, {format_bytes(nbytes)})."
        )
    else:
        float_note = "Every tensor is quantized."
    if quality:
        quality_text = "| measure | value |\n| --- | --- |\n" + "\n".join(
            f"| {_cell(k)} | {_cell(v)} |" for k, v in quality.items()
        )
    else:
        quality_text = (
            "Not measured for this card. `hf-aoq inspect THIS_FOLDER --error FLOAT_FOLDER` reports the "
            "quantization error (SQNR) of every layer against the float weights."
        )
    before, after = info.bytes_before, info.bytes_after
    base = base_model or "unknown"
    recipe = info.quantization_config
    return {
        "front_matter": _front_matter(base_model, [s for _, s, _ in groups]),
        "title": f"{base.rstrip('/').split('/')[-1]} (hf_aoq quantized)",
        "base_model_line": f"[{base}](https://huggingface.co/{base})" if _is_hub_id(base) else f"`{base}`",
        "base_model": f"`{base}`",
        "size_before": format_bytes(before),
        "size_after": format_bytes(after),
        "ratio": f"{after / before:.2f}x" if before else "n/a",
        "quantized_count": str(len(quantized)),
        "tensor_count": str(len(info.tensors)),
        "hf_aoq_version": ", ".join(info.writers) or __version__,  # the release that wrote the files
        "format_version": ", ".join(str(v) for v in info.format_versions) or "none (no hf_aoq metadata)",
        "recipe_rows": rows,
        "float_note": float_note,
        "recipe_json": "(no quantization_config in config.json)" if recipe is None else json.dumps(recipe, indent=2),
        "quality": quality_text,
        "load_name": load_name or str(info.path),
    }


def render_card(
    info: CheckpointInfo,
    *,
    base_model: str | None = None,
    load_name: str | None = None,
    quality: Mapping[str, Any] | None = None,
) -> str:
    """The whole card for the checkpoint `info` describes."""
    return string.Template(template()).substitute(_values(info, base_model, load_name, quality))


def section(card: str) -> str:
    """The quantization section of a card (markers included)."""
    start, end = card.find(START), card.find(END)
    if start < 0 or end < start:
        raise ValueError("the card has no hf_aoq quantization section")
    return card[start : end + len(END)]


def merge(existing: str, new_card: str) -> str:
    """`existing` with the quantization section of `new_card` put in place of its own, or
    appended when it has none; transformers' placeholder card is replaced by `new_card`."""
    if not existing.strip() or _TRANSFORMERS_DEFAULT in existing:
        return new_card
    part = section(new_card)
    start, end = existing.find(START), existing.find(END)
    if start >= 0 and end > start:
        return existing[:start] + part + existing[end + len(END) :]
    return existing.rstrip("\n") + "\n\n" + part + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_model_card(
    directory,
    *,
    base_model: str | None = None,
    load_name: str | None = None,
    quality: Mapping[str, Any] | None = None,
    info: CheckpointInfo | None = None,
) -> Path | None:
    """Write or update README.md in the checkpoint folder `directory` (atomically). Returns its
    path, or None when the folder holds no quantized tensor (nothing to describe)."""
    directory = Path(directory)
    info = info or read_checkpoint(directory, build=False)
    if not info.quantized:
        return None
    card = render_card(info, base_model=base_model, load_name=load_name, quality=quality)
    path = directory / CARD_NAME
    if path.exists():
        card = merge(path.read_text(encoding="utf-8"), card)
    _write_atomic(path, card)
    return path


# ---------------------------------------------------------------------- the save and push hooks
QUALITY_ATTR = "_hf_aoq_card_quality"


def set_quality(model, figures: Mapping[str, Any] | None) -> None:
    """Quality figures ({measure: value}) for the cards that later saves of `model` write."""
    setattr(model, QUALITY_ATTR, dict(figures) if figures else None)


def _is_aoq_model(model) -> bool:
    config = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    return getattr(config, "quant_method", None) == "aoq"


def _card_for(model, directory, load_name: str | None) -> None:
    try:
        write_model_card(
            directory,
            base_model=getattr(model.config, "_name_or_path", None) or None,
            load_name=load_name,
            quality=getattr(model, QUALITY_ATTR, None),
        )
    except Exception as e:  # the checkpoint itself is saved; a card problem must not undo that
        warnings.warn(f"hf_aoq: could not write the model card in {directory}: {type(e).__name__}: {e}", stacklevel=3)


def install_save_hooks() -> None:
    """Make transformers' save_pretrained and push uploads write the card of aoq models.

    transformers has no hook that sees the save folder, so the two methods are wrapped once, on
    PreTrainedModel; for any model not quantized by hf_aoq they do exactly what they did.
    `push_to_hub` overwrites README.md with the Hub's card (or transformers' placeholder) after
    saving, so the upload step adds the section again.
    """
    from transformers import PreTrainedModel

    if getattr(PreTrainedModel.save_pretrained, "_hf_aoq_card", False):
        return
    save = PreTrainedModel.save_pretrained
    upload = PreTrainedModel._upload_modified_files

    @functools.wraps(save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        result = save(self, save_directory, *args, **kwargs)
        is_main = kwargs.get("is_main_process", args[0] if args else True)
        if is_main and _is_aoq_model(self) and os.path.isdir(save_directory):
            _card_for(self, save_directory, os.fspath(save_directory))
        return result

    @functools.wraps(upload)
    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        if _is_aoq_model(self):
            _card_for(self, working_dir, repo_id)
        return upload(self, working_dir, repo_id, *args, **kwargs)

    save_pretrained._hf_aoq_card = True
    PreTrainedModel.save_pretrained = save_pretrained
    PreTrainedModel._upload_modified_files = _upload_modified_files
