"""The jobs behind the `hf-aoq` command line, as a library that scripts import: quantize a
checkpoint while loading it and save it (quantization), push a folder to the Hub (hub),
generate and the demo (generation), export to compressed-tensors and convert
other libraries' checkpoints (export). They raise UsageError (one line saying what to do) for
anything the user can fix; the command line only parses arguments and prints."""
from .common import SIZE_FORM, UsageError, check_model_source, looks_like_a_path, parse_size
from .export import ExportError, convert_checkpoint, convert_compressed_tensors, export_checkpoint
from .generation import Sampling, busy_note, demo, generate, load_for_generation
from .hub import PushTarget, check_push_target, push_folder
from .quantization import DTYPES, LoadOptions, build_aoq_config, load_recipe, quantize_checkpoint
from .target import build_target_config

__all__ = [
    "DTYPES",
    "ExportError",
    "LoadOptions",
    "PushTarget",
    "SIZE_FORM",
    "Sampling",
    "UsageError",
    "build_aoq_config",
    "build_target_config",
    "busy_note",
    "check_model_source",
    "check_push_target",
    "convert_checkpoint",
    "convert_compressed_tensors",
    "demo",
    "export_checkpoint",
    "generate",
    "load_for_generation",
    "load_recipe",
    "looks_like_a_path",
    "parse_size",
    "push_folder",
    "quantize_checkpoint",
]
