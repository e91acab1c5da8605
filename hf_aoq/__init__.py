"""hf_aoq: quantize Hugging Face transformers models into PyTorch tensor subclasses.

`import hf_aoq` imports the library and registers AOQConfig and the "aoq" quantizer with
transformers, so that from_pretrained reads "aoq" checkpoints. Started as the command line
(`hf-aoq ...` or `python -m hf_aoq ...`), the package defers all of that to the first use of a
name below (or to the command that needs it): `hf-aoq --help` then imports neither torch nor
transformers.
"""
import os as _os
import sys as _sys

from ._version import __version__

__all__ = [
    "AOQBaseConfig",
    "AOQConfig",
    "AOQError",
    "AOQTensor",
    "Float8DynamicActivationFloat8SemiSparseWeightConfig",
    "Float8DynamicActivationFloat8WeightConfig",
    "Float8DynamicActivationInt4WeightConfig",
    "Float8SemiSparseTensor",
    "Float8StaticActivationFloat8WeightConfig",
    "Float8Tensor",
    "Float8WeightOnlyConfig",
    "FormatError",
    "FPXWeightOnlyConfig",
    "FPxTensor",
    "FqnToConfig",
    "GemliteUIntXWeightOnlyConfig",
    "Int4DQTensor",
    "Int4DQWeightOnlyConfig",
    "Int4DynamicActivationInt4WeightConfig",
    "Int4Tensor",
    "Int4WeightOnlyConfig",
    "Int8DynamicActivationInt4WeightConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "Int8DynamicActivationIntxWeightConfig",
    "Int8Tensor",
    "Int8WeightOnlyConfig",
    "IntxDQTensor",
    "IntxDQWeightOnlyConfig",
    "IntxTensor",
    "IntxWeightOnlyConfig",
    "MXDynamicActivationMXWeightConfig",
    "MXFPInferenceConfig",
    "MXTensor",
    "NVFP4InferenceConfig",
    "NVFP4Tensor",
    "NVFP4WeightOnlyConfig",
    "PerGroup",
    "PerRow",
    "PerTensor",
    "calibrate_activation_scales",
    "quantize_",
    "UIntXWeightOnlyConfig",
]


def _import_library() -> None:
    """Import every public name (and so register the "aoq" quantizer with transformers)."""
    from . import configs, core, kernels  # noqa: F401
    from .integrations import transformers as _integration  # registers "aoq" with transformers
    from .quantize import quantize_
    from . import tensors
    from .activation_scales import calibrate_activation_scales

    names = {"quantize_": quantize_, "AOQConfig": _integration.AOQConfig,
             "calibrate_activation_scales": calibrate_activation_scales}
    for module in (configs, core, tensors):
        names.update({n: getattr(module, n) for n in __all__ if hasattr(module, n) and n not in names})
    globals().update(names)


def __getattr__(name: str):
    # Only the public names: submodules (`from . import kernels` while the library imports) are
    # found by the import system once this raises AttributeError.
    if name in __all__:
        _import_library()
        return globals()[name]
    raise AttributeError(f"module 'hf_aoq' has no attribute {name!r}")


def _started_as_command_line() -> bool:
    """Whether this import is the start of `hf-aoq` (the console script) or `python -m hf_aoq`
    (while Python locates a -m module, sys.argv[0] is "-m"; sys.orig_argv names the module)."""
    argv0 = _sys.argv[0] if _sys.argv else ""
    if _os.path.basename(argv0).removesuffix(".exe") == "hf-aoq":
        return True
    orig = list(getattr(_sys, "orig_argv", []))
    return argv0 == "-m" and "-m" in orig and orig[orig.index("-m") + 1 : orig.index("-m") + 2] == [__name__]


if not _started_as_command_line():
    _import_library()
