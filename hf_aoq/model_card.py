"""The model card (README.md) of a quantized checkpoint, built with huggingface_hub's `ModelCard`
and `ModelCardData` from the Jinja template model_cards/quantized_model.md.

Every `save_pretrained` of a model quantized by hf_aoq writes one into the folder: a new card
when the folder has none, otherwise the card is kept, gains the front-matter keys it lacks
(base_model, tags, ...) and its "Quantization" section (between the two `hf_aoq:quantization`
markers) is added or replaced, so saving again changes nothing else. `push_to_hub` does the same
to the card it uploads. The content comes from the saved files themselves (hf_aoq.checkpoint):
sizes, what each layer group is stored as, versions; the base model's license comes from its
own card when that card is on this machine.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import types
import warnings
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from ._version import __version__
from .card_formats import format_notes
from .checkpoint import CheckpointInfo, TensorInfo, format_bytes, read_checkpoint
from .serialization.files import write_atomic

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"
TEMPLATE_NAME = "quantized_model.md"
START = "<!-- hf_aoq:quantization:start"
END = "<!-- hf_aoq:quantization:end -->"
# The card transformers writes when it has nothing better; it is replaced, not extended.
_TRANSFORMERS_DEFAULT = "This is the model card of a 🤗 transformers model that has been pushed on the Hub."
# A folder of the Hub cache: .../models--{owner}--{name}/snapshots/{commit}
_SNAPSHOT = re.compile(r"models--(?P<owner>[\w.-]+?)--(?P<name>[\w.-]+)[/\\]snapshots[/\\][0-9a-f]{40}[/\\]?$")
# Front-matter keys taken from the base model's card.
_LICENSE_KEYS = ("license", "license_name", "license_link")


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


# ---------------------------------------------------------------------- the base model
def is_hub_id(name: str | None) -> bool:
    """A Hub repo id (huggingface_hub's rules) that is not also a path on this machine."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _read_card(path) -> Any | None:
    """The ModelCardData of the card file at `path`, or None when it is missing or unreadable."""
    from huggingface_hub import ModelCard

    if not path or not os.path.isfile(path):
        return None
    try:
        return ModelCard.load(path, ignore_metadata_errors=True).data
    except (OSError, ValueError) as e:
        logger.info("hf_aoq: %s: card not read (%s)", path, e)
        return None


def base_model_of(source: str | None, revision: str | None = None) -> tuple[str | None, Any | None]:
    """(Hub id of the model `source` names, that model's card data) as far as this machine knows,
    without the network: a Hub id with its card from the Hub cache; a Hub-cache snapshot folder;
    or a local folder, whose own card may name its Hub base model (and license)."""
    from huggingface_hub import try_to_load_from_cache

    if not source:
        return None, None
    if is_hub_id(source):
        cached = try_to_load_from_cache(source, CARD_NAME, revision=revision)
        return source, _read_card(cached if isinstance(cached, str) else None)
    folder = os.path.abspath(source)
    card = _read_card(os.path.join(folder, CARD_NAME)) if os.path.isdir(folder) else None
    match = _SNAPSHOT.search(folder)
    if match:
        return f"{match['owner']}/{match['name']}", card
    named = getattr(card, "base_model", None) if card is not None else None
    if isinstance(named, str) and is_hub_id(named):
        return named, card
    return None, card


def _pipeline_tag(directory: Path) -> str | None:
    """The Hub task of the model class config.json names (transformers' own table)."""
    try:
        architectures = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("architectures") or []
        from transformers.modelcard import TASK_MAPPING
    except (OSError, ValueError, ImportError, AttributeError):
        return None
    for task, classes in TASK_MAPPING.items():
        names = {n for v in classes.values() for n in (v if isinstance(v, (list, tuple)) else [v])}
        if any(a in names for a in architectures):
            return task
    return None


# ---------------------------------------------------------------------- rendering
def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def card_data(info: CheckpointInfo, base_model: str | None, base_card=None, pipeline_tag: str | None = None):
    """The front matter (a validated ModelCardData): library, the Hub base model with
    `base_model_relation: quantized`, the base model's license, the task and hf_aoq's tags."""
    from huggingface_hub import ModelCardData

    schemes = [s for _, s, _ in layer_groups(info.tensors)]
    extra = {}
    if base_model:
        extra["base_model_relation"] = "quantized"
    for key in _LICENSE_KEYS:
        value = base_card.get(key) if base_card is not None else None
        if value:
            extra[key] = value
    return ModelCardData(
        library_name="transformers",
        base_model=base_model,
        pipeline_tag=pipeline_tag,
        tags=["hf_aoq", "quantized", *sorted({s.split()[0] for s in schemes})],
        **extra,
    )


def _values(info, source, hub_base, load_name, quality) -> dict[str, str]:
    quantized = info.quantized
    rows = "\n".join(f"| `{_cell(p)}` | {n} | {_cell(s)} |" for p, s, n in layer_groups(info.tensors))
    floats = [t for t in info.tensors if not t.quantized]
    if floats:
        dtypes = ", ".join(sorted({t.scheme for t in floats}))
        float_note = (
            f"The other {len(floats)} tensors (embeddings, norms, and any layer the recipe skips) are "
            f"stored unquantized ({dtypes}, {format_bytes(sum(t.bytes_after for t in floats))})."
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
    source = source or hub_base or "unknown"
    link = f"[{hub_base}](https://huggingface.co/{hub_base})" if hub_base else None
    if link and source != hub_base:
        base_line, base_cell = f"{link} (from the local folder `{source}`)", f"`{hub_base}` (from `{_cell(source)}`)"
    else:
        base_line, base_cell = link or f"`{source}`", f"`{_cell(source)}`"
    before, after = info.bytes_before, info.bytes_after
    recipe = info.quantization_config
    return {
        "title": f"{(hub_base or source).rstrip('/').split('/')[-1]} (hf_aoq quantized)",
        "base_model_line": base_line,
        "base_model_cell": base_cell,
        "size_before": format_bytes(before),
        "size_after": format_bytes(after),
        "ratio": f"{after / before:.2f}x" if before else "n/a",
        "quantized_count": str(len(quantized)),
        "tensor_count": str(len(info.tensors)),
        "hf_aoq_version": ", ".join(info.writers) or __version__,  # the release that wrote the files
        "format_version": ", ".join(str(v) for v in info.format_versions) or "none (no hf_aoq metadata)",
        "recipe_rows": rows or "| (none) | 0 | |",
        "float_note": float_note,
        "format_notes": format_notes(t.scheme for t in quantized),
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
    revision: str | None = None,
) -> str:
    """The whole card for the checkpoint `info` describes; `base_model` is what it was quantized
    from (a Hub id or a local folder)."""
    from huggingface_hub import ModelCard

    hub_base, base_card = base_model_of(base_model, revision)
    data = card_data(info, hub_base, base_card, _pipeline_tag(Path(info.path)))
    values = _values(info, base_model, hub_base, load_name, quality)
    card = ModelCard.from_template(data, template_str=template(), **values)  # parses the front matter back
    text = str(card)
    return text if text.endswith("\n") else text + "\n"


def section(card: str) -> str:
    """The quantization section of a card (markers included)."""
    start, end = card.find(START), card.find(END)
    if start < 0 or end < start:
        raise ValueError("the card has no hf_aoq quantization section")
    return card[start : end + len(END)]


def _with_section(text: str, part: str) -> str:
    start, end = text.find(START), text.find(END)
    if start >= 0 and end > start:
        return text[:start] + part + text[end + len(END) :]
    return text.rstrip("\n") + "\n\n" + part + "\n"


def with_load_name(card: str, load_name: str) -> str:
    """`card` with its section's how-to-load line naming `load_name` (e.g. the Hub repo)."""
    part = section(card)
    line = re.compile(r'(from_pretrained\()"[^"\n]*"(\))')
    return _with_section(card, line.sub(lambda m: f"{m[1]}{json.dumps(load_name)}{m[2]}", part, count=1))


def merge(existing: str, new_card: str) -> str:
    """`existing` with the quantization section of `new_card` put in place of its own (or
    appended), and the front-matter keys of `new_card` it lacks added (tags are joined);
    transformers' placeholder card is replaced by `new_card`. Both cards are parsed by
    huggingface_hub's ModelCard; a card whose front matter does not parse only gets the section."""
    from huggingface_hub import ModelCard

    if not existing.strip() or _TRANSFORMERS_DEFAULT in existing:
        return new_card
    part = section(new_card)
    try:
        card, ours = ModelCard(existing), ModelCard(new_card).data
    except (ValueError, TypeError) as e:  # e.g. a front matter that is not a mapping
        logger.warning("hf_aoq: the existing model card's front matter does not parse (%s); only the section is updated", e)
        return _with_section(existing, part)
    data = card.data
    if data.get("base_model") is None and ours.get("base_model") is not None:
        data["base_model"], data["base_model_relation"] = ours["base_model"], ours.get("base_model_relation")
    data.tags = list(dict.fromkeys([*(data.tags or []), *(ours.tags or [])]))
    for key, value in ours.to_dict().items():
        if key not in ("base_model", "base_model_relation", "tags") and data.get(key) is None:
            data[key] = value
    card.text = _with_section(card.text, part)
    return str(card)


def write_model_card(
    directory,
    *,
    base_model: str | None = None,
    load_name: str | None = None,
    quality: Mapping[str, Any] | None = None,
    info: CheckpointInfo | None = None,
    revision: str | None = None,
) -> Path | None:
    """Write or update README.md in the checkpoint folder `directory` (atomically). Returns its
    path, or None when the folder holds no quantized tensor (nothing to describe)."""
    directory = Path(directory)
    info = info or read_checkpoint(directory, build=False)
    if not info.quantized:
        return None
    card = render_card(info, base_model=base_model, load_name=load_name, quality=quality, revision=revision)
    path = directory / CARD_NAME
    if path.exists():
        card = merge(path.read_text(encoding="utf-8"), card)
    write_atomic(path, card)
    return path


# ---------------------------------------------------------------------- exported folders
# How each engine loads a compressed-tensors folder ({path}: the folder or its Hub id).
ENGINES = {
    "compressed-tensors": (
        ("transformers (`pip install compressed-tensors`; no hf_aoq needed)", "python",
         "from transformers import AutoModelForCausalLM\n\nmodel = AutoModelForCausalLM.from_pretrained(\"{path}\")"),
        ("vLLM", "bash", "vllm serve {path}"),
        ("SGLang", "bash", "python -m sglang.launch_server --model-path {path}"),
    ),
    # {path}: the folder holding model.gguf (the export's OUT)
    "gguf": (
        ("llama.cpp", "bash", "llama-cli -m {path}/model.gguf -p \"The capital of France is\""),
        ("llama.cpp's server (an OpenAI-compatible API)", "bash", "llama-server -m {path}/model.gguf"),
        ("transformers (`pip install gguf`; the weights are dequantized at load; no hf_aoq needed)", "python",
         "from transformers import AutoModelForCausalLM\n\n"
         "model = AutoModelForCausalLM.from_pretrained(\"{path}\", gguf_file=\"model.gguf\")"),
        ("hf_aoq again (the same int4/int8 tensors, bit for bit)", "bash", "hf-aoq convert {path}/model.gguf aoq-folder"),
    ),
}
# What each format's card says after the commands.
_ENGINE_NOTES = {
    "compressed-tensors": (
        "vLLM picks a kernel per layer when it loads: its 4-bit (W4A16, Marlin) kernels want each layer's input "
        "size (per tensor-parallel shard) to be a multiple of 128 and its output size a multiple of 64; "
        "`hf-aoq quantize --target compressed-tensors` makes such checkpoints. `hf-aoq convert` turns this "
        "folder back into an hf_aoq checkpoint."),
    "gguf": (
        "Q4_0, Q4_1 and Q8_0 hold hf_aoq's int4 and int8 at groups of 32 with fp16 scales; `hf-aoq quantize "
        "--target gguf` makes checkpoints that export so without loss. llama.cpp runs the file with its own "
        "kernels (activations rounded its way, so outputs match to its arithmetic, not bit for bit)."),
}


def write_export_card(directory, *, format: str, base_model: str | None, groups: Mapping[str, int],
                      requantized: list[str], load_name: str) -> Path:
    """README.md of a folder exported to another format (hf_aoq.workflows.export): what the
    weights are stored as, which weights were re-quantized (not exact), and the command each
    engine loads it with. It is not an hf_aoq checkpoint, so it gets no hf_aoq section."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(library_name="transformers", base_model=base_model,
                         tags=["hf_aoq", "quantized", format])
    rows = "\n".join(f"| {_cell(what)} | {n} |" for what, n in sorted(groups.items()))
    if requantized:
        exact = ("These weights had no exact form and were **re-quantized** from their dequantized values "
                 "(`--requantize`); they differ from the hf_aoq checkpoint:\n\n"
                 + "\n".join(f"- `{_cell(r)}`" for r in requantized))
    else:
        exact = "Every weight is bit-exactly the hf_aoq checkpoint's (same codes and scales)."
    engines = "\n\n".join(f"{name}:\n\n```{lang}\n{code.format(path=load_name)}\n```" for name, lang, code in ENGINES[format])
    text = (f"---\n{data.to_yaml()}\n---\n\n# {Path(load_name).name} ({format})\n\n"
            f"Exported by [hf_aoq](https://pypi.org/project/hf_aoq/) {__version__} from an hf_aoq checkpoint"
            f"{f' of `{base_model}`' if base_model else ''} to the {format} format.\n\n"
            f"| stored as | weights |\n| --- | --- |\n{rows}\n\n{exact}\n\n## How to load\n\n{engines}\n\n"
            f"{_ENGINE_NOTES[format]}\n")
    ModelCard(text)  # the front matter parses
    path = Path(directory) / CARD_NAME
    write_atomic(path, text)
    return path


# ---------------------------------------------------------------------- the save and push hooks
QUALITY_ATTR = "_hf_aoq_card_quality"
_HOOKED_ATTR = "_hf_aoq_card_hooks"


def set_quality(model, figures: Mapping[str, Any] | None) -> None:
    """Quality figures ({measure: value}) for the cards that later saves of `model` write."""
    setattr(model, QUALITY_ATTR, dict(figures) if figures else None)


def _is_aoq_model(model) -> bool:
    config = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    return getattr(config, "quant_method", None) == "aoq"


def _card_for(model, directory, load_name: str | None) -> None:
    config = getattr(model, "config", None)
    try:
        write_model_card(
            directory,
            base_model=getattr(config, "_name_or_path", None) or None,
            load_name=load_name,
            quality=getattr(model, QUALITY_ATTR, None),
            revision=getattr(config, "_commit_hash", None),
        )
    except Exception as e:  # the checkpoint itself is saved; a card problem must not undo that
        warnings.warn(f"hf_aoq: could not write the model card in {directory}: {type(e).__name__}: {e}", stacklevel=3)


def attach(model) -> None:
    """Make this model's save_pretrained (and the upload step of its push_to_hub) write its card.

    transformers has no hook that sees the save folder, so the two methods are wrapped on this
    instance only (the quantizer calls this after loading); other models and transformers'
    classes are untouched, and after `dequantize()` the wrappers do exactly what transformers
    does. `push_to_hub` overwrites README.md with the Hub's card (or transformers' placeholder)
    after saving, so its upload step, the private `_upload_modified_files`, adds the section
    again; without that method (a transformers rename) the push uploads transformers' card, and
    `hf-aoq push` still writes ours.
    """
    if getattr(model, _HOOKED_ATTR, False):
        return
    cls = type(model)
    save = getattr(cls, "save_pretrained", None)
    if save is None:
        return
    object.__setattr__(model, _HOOKED_ATTR, True)

    @functools.wraps(save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        result = save(self, save_directory, *args, **kwargs)
        is_main = kwargs.get("is_main_process", args[0] if args else True)
        if is_main and _is_aoq_model(self) and os.path.isdir(save_directory):
            _card_for(self, save_directory, os.fspath(save_directory))
        return result

    object.__setattr__(model, "save_pretrained", types.MethodType(save_pretrained, model))
    upload = getattr(cls, "_upload_modified_files", None)
    if upload is None:
        logger.warning("hf_aoq: this transformers has no PreTrainedModel._upload_modified_files; push_to_hub will "
                       "upload transformers' model card (run `hf-aoq push FOLDER REPO` for hf_aoq's)")
        return

    @functools.wraps(upload)
    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        if _is_aoq_model(self):
            _card_for(self, working_dir, repo_id)
        return upload(self, working_dir, repo_id, *args, **kwargs)

    object.__setattr__(model, "_upload_modified_files", types.MethodType(_upload_modified_files, model))
