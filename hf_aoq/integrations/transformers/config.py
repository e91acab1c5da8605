"""`AOQConfig`: what transformers should quantize while loading, or how to load an "aoq"
checkpoint; its config.json form (`quantization_config`) and the older names it still reads."""
from __future__ import annotations

import os
import re
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from ...configs import AOQBaseConfig, Float8StaticActivationFloat8WeightConfig, FqnToConfig, recipe_from_dict, recipe_to_dict
from ...core.errors import AOQError, FormatError

QUANT_METHOD = "aoq"
# Version of the "quantization_config" JSON written to config.json (not of the tensor format).
CONFIG_VERSION = 1

_CONFIG_KEYS = (
    "quant_method",
    "version",
    "quant_type",
    "modules_to_not_convert",
    "include_input_output_embeddings",
    "include_embeddings",  # the name before 0.1.1; still read from config.json files
    "untie_embedding_weights",
    "dequantize",
    "calibration",
    "calibration_tokens",
    "target_bits_per_weight",
    "candidates",
    "calibration_method",
    "stored_transposed",
    "gptq_order",
    "refine_rounds",
)
# The schemes mixed precision chooses among when AOQConfig(target_bits_per_weight=...) names none.
DEFAULT_CANDIDATES = ("int4:g64", "int4", "int8")
CALIBRATION_METHODS = ("gptq", "awq", "smoothquant")  # hf_aoq.calibration has the same
GPTQ_ORDERS = ("act", "sequential")  # hf_aoq.calibration.quantize_with_calibration's act_order True / False


class AOQConfig(QuantizationConfigMixin):
    """How transformers should quantize a model while loading it, or load an "aoq" checkpoint.

    quant_type               a quantization config (for every nn.Linear weight) or an FqnToConfig
    modules_to_not_convert   module names or regexes never quantized, matched as transformers does
                             (from the start of a name up to a dot, or as a suffix)
    include_input_output_embeddings
                             also quantize the input embedding and the output embedding (lm_head),
                             TorchAoConfig's name (`include_embeddings` is the older name, accepted)
    untie_embedding_weights  when the model ties them, give the output embedding its own weight
    dequantize               load an "aoq" checkpoint as a float model (quant_type may be None)
    calibration              a UTF-8 text file: load the float weights, then choose every int4
                             linear weight by GPTQ on its first `calibration_tokens` tokens
                             (hf_aoq.calibration), and the activation scale of every
                             Float8StaticActivationFloat8WeightConfig without one (which needs
                             it); slower, and the float model is in memory once
    calibration_tokens       how many tokens of `calibration` to use (default 2048)
    target_bits_per_weight   mixed precision (hf_aoq.mixed_precision): load the float weights, measure
                             each candidate on each planned weight with `calibration`, and give each
                             weight the candidate that minimises the predicted loss increase at an
                             average of at most this many bits per weight; quant_type then only says
                             which weights are planned (default: every linear, as the first candidate).
                             Once done, quant_type is the chosen FqnToConfig (what config.json stores)
    candidates               the scheme names to choose among (hf_aoq.sensitivity.parse_candidate:
                             "int4", "int4:g64", "int8", "int4-plain:g128", "bf16", ...; default
                             DEFAULT_CANDIDATES)
    calibration_method       what `calibration` chooses: "gptq" (default: int4 weights),
                             "awq" (activation-aware scales for int4 and Int4DQ, hf_aoq.awq) or
                             "smoothquant" (for int8-dynamic, hf_aoq.smoothquant)
    gptq_order               the order GPTQ quantizes each weight's columns in: "act" (default:
                             by descending input energy, the Gram matrix's diagonal) or
                             "sequential" (left to right, what calibration did before; on SmolLM2
                             act order is better: Int4DQ g32 31.12 against 31.94); mixed
                             precision's "+gptq" / "+gptq-act" candidates name their own order
    refine_rounds            with target_bits_per_weight: rounds of hf_aoq.mixed_precision.refine_recipe
                             (measure the report again with the chosen recipe applied, choose
                             again, keep the recipe of least calibration loss); default 0, none.
                             Each round costs about one more report
    stored_transposed        names of 3-D parameters stored as the transpose of the model's (a
                             quantized [E, out, in] for gpt-oss's [E, in, out] experts: what
                             `hf-aoq convert` makes of transformers' Mxfp4 checkpoints, whose MX
                             blocks run along "in", and what quantize-on-load sets for the
                             experts hf_aoq.quantize.stored_in_by_out names); they load as the
                             transposed view (hf_aoq.tensors.experts.TransposedExperts)
    """

    def __init__(
        self,
        quant_type: AOQBaseConfig | FqnToConfig | None = None,
        modules_to_not_convert: list[str] | None = None,
        include_input_output_embeddings: bool | None = None,
        untie_embedding_weights: bool = False,
        dequantize: bool = False,
        calibration: str | None = None,
        calibration_tokens: int = 2048,
        include_embeddings: bool | None = None,
        target_bits_per_weight: float | None = None,
        candidates: list[str] | None = None,
        calibration_method: str = "gptq",
        stored_transposed: list[str] | None = None,
        gptq_order: str = "act",
        refine_rounds: int = 0,
    ):
        include_input_output_embeddings = _one_of_two_names(include_input_output_embeddings, include_embeddings)
        for name, value in (
            ("include_input_output_embeddings" if include_embeddings is None else "include_embeddings",
             include_input_output_embeddings),
            ("untie_embedding_weights", untie_embedding_weights),
            ("dequantize", dequantize),
        ):
            if not isinstance(value, bool):
                raise AOQError(f"AOQConfig.{name} must be True or False, got {value!r}")
        candidates = _check_mixed_precision(target_bits_per_weight, candidates, calibration)
        if quant_type is None and target_bits_per_weight is not None:
            from ...sensitivity import parse_candidates

            quant_type = next(c.config for c in parse_candidates(candidates) if c.config is not None)
        if quant_type is None and not dequantize:
            raise AOQError("AOQConfig needs a quant_type: a quantization config or an FqnToConfig")
        if quant_type is not None and not isinstance(quant_type, (AOQBaseConfig, FqnToConfig)):
            kind = type(quant_type).__name__
            raise AOQError(f"AOQConfig.quant_type must be a quantization config or an FqnToConfig, got {kind}")
        if modules_to_not_convert is not None:
            skips = modules_to_not_convert
            if isinstance(skips, str) or not all(isinstance(m, str) for m in skips):
                raise AOQError(f"AOQConfig.modules_to_not_convert must be a list of strings, got {skips!r}")
            for pattern in skips:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise AOQError(f"AOQConfig.modules_to_not_convert: {pattern!r} is not a valid regex: {e}") from None
            modules_to_not_convert = list(skips)
        if calibration is not None and not isinstance(calibration, (str, os.PathLike)):
            raise AOQError(f"AOQConfig.calibration must be the path of a text file, got {calibration!r}")
        if isinstance(calibration_tokens, bool) or not isinstance(calibration_tokens, int) or calibration_tokens < 2:
            raise AOQError(f"AOQConfig.calibration_tokens must be an int >= 2, got {calibration_tokens!r}")
        if calibration is not None and untie_embedding_weights:
            raise AOQError("AOQConfig: calibration with untie_embedding_weights is not supported; untie before saving "
                           "the float checkpoint, or quantize without calibration")
        if calibration is None and not dequantize and _static_scale_missing(quant_type):
            raise AOQError("AOQConfig: Float8StaticActivationFloat8WeightConfig.scale is None and there is no "
                           "calibration; give scale=<a positive number> or calibration=<a text file>")
        if calibration_method not in CALIBRATION_METHODS:
            raise AOQError(f"AOQConfig.calibration_method must be one of {CALIBRATION_METHODS}, got {calibration_method!r}")
        self.calibration_method = calibration_method
        if gptq_order not in GPTQ_ORDERS:
            raise AOQError(f"AOQConfig.gptq_order must be one of {GPTQ_ORDERS}, got {gptq_order!r}")
        self.gptq_order = gptq_order
        if isinstance(refine_rounds, bool) or not isinstance(refine_rounds, int) or refine_rounds < 0:
            raise AOQError(f"AOQConfig.refine_rounds must be a non-negative integer, got {refine_rounds!r}")
        if refine_rounds and target_bits_per_weight is None:
            raise AOQError("AOQConfig.refine_rounds refines a mixed-precision choice: give target_bits_per_weight too")
        self.refine_rounds = refine_rounds
        if stored_transposed is not None and (isinstance(stored_transposed, str)
                                              or not all(isinstance(n, str) and n for n in stored_transposed)):
            raise AOQError(f"AOQConfig.stored_transposed must be a list of parameter names, got {stored_transposed!r}")
        self.stored_transposed = None if not stored_transposed else sorted(set(stored_transposed))
        self.calibration = None if calibration is None else os.fspath(calibration)
        self.calibration_tokens = calibration_tokens
        self.target_bits_per_weight = None if target_bits_per_weight is None else float(target_bits_per_weight)
        self.candidates = candidates
        self.quant_method = QUANT_METHOD
        self.quant_type = quant_type
        self.modules_to_not_convert = modules_to_not_convert
        self.include_input_output_embeddings = include_input_output_embeddings
        self.untie_embedding_weights = untie_embedding_weights
        self.dequantize = dequantize

    def to_dict(self) -> dict[str, Any]:
        """The whole recipe as strict JSON-ready data (what config.json stores)."""
        skips = self.modules_to_not_convert
        return {
            "quant_method": QUANT_METHOD,
            "version": CONFIG_VERSION,
            "quant_type": None if self.quant_type is None else recipe_to_dict(self.quant_type),
            "modules_to_not_convert": None if skips is None else list(skips),
            "include_input_output_embeddings": self.include_input_output_embeddings,
            "untie_embedding_weights": self.untie_embedding_weights,
            "dequantize": self.dequantize,
            # Written only when used, so that older readers still read every other config.
            **({"calibration": self.calibration, "calibration_tokens": self.calibration_tokens}
               if self.calibration is not None else {}),
            **({"target_bits_per_weight": self.target_bits_per_weight, "candidates": list(self.candidates)}
               if self.target_bits_per_weight is not None else {}),
            **({"calibration_method": self.calibration_method} if self.calibration_method != "gptq" else {}),
            **({"stored_transposed": list(self.stored_transposed)} if self.stored_transposed else {}),
            **({"gptq_order": self.gptq_order} if self.gptq_order != "act" else {}),
            **({"refine_rounds": self.refine_rounds} if self.refine_rounds else {}),
        }

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs):
        """Inverse of `to_dict`. Strict: an unknown key, type or value is a FormatError.

        `kwargs` naming an AOQConfig argument override the dict (transformers' convention); the
        rest are returned when `return_unused_kwargs` is set.
        """
        where = "quantization_config"
        if not isinstance(config_dict, dict):
            raise FormatError(f"{where} must be a JSON object, got {type(config_dict).__name__}")
        unknown = sorted(set(config_dict) - set(_CONFIG_KEYS))
        if unknown:
            raise FormatError(f"{where}: unknown key(s) {unknown}; an aoq config has {list(_CONFIG_KEYS)}")
        method = config_dict.get("quant_method")
        if method != QUANT_METHOD:
            raise FormatError(f"{where}: quant_method must be {QUANT_METHOD!r}, got {method!r}")
        version = config_dict.get("version", CONFIG_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= CONFIG_VERSION:
            raise FormatError(
                f"{where}: version {version!r} is not one this hf_aoq reads (1..{CONFIG_VERSION}); "
                f"a newer hf_aoq may have written it"
            )
        if "quant_type" not in config_dict:
            raise FormatError(f"{where}: missing quant_type")
        args: dict[str, Any] = {}
        recipe = config_dict["quant_type"]
        args["quant_type"] = None if recipe is None else recipe_from_dict(recipe, where=f"{where}.quant_type")
        skips = config_dict.get("modules_to_not_convert")
        if skips is not None and not (isinstance(skips, list) and all(isinstance(s, str) for s in skips)):
            raise FormatError(f"{where}.modules_to_not_convert: expected a list of strings or null, got {skips!r}")
        args["modules_to_not_convert"] = skips
        for key in ("include_input_output_embeddings", "include_embeddings", "untie_embedding_weights", "dequantize"):
            if key not in config_dict and key.startswith("include"):
                continue  # either name may be missing (include_embeddings: files before 0.1.1)
            value = config_dict.get(key, False)
            if not isinstance(value, bool):
                raise FormatError(f"{where}.{key}: expected true or false, got {value!r}")
            args[key] = value
        calibration = config_dict.get("calibration")
        if calibration is not None and not isinstance(calibration, str):
            raise FormatError(f"{where}.calibration: expected a file path or null, got {calibration!r}")
        args["calibration"] = calibration
        tokens = config_dict.get("calibration_tokens", 2048)
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise FormatError(f"{where}.calibration_tokens: expected an integer, got {tokens!r}")
        args["calibration_tokens"] = tokens
        bits = config_dict.get("target_bits_per_weight")
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, (int, float))):
            raise FormatError(f"{where}.target_bits_per_weight: expected a number or null, got {bits!r}")
        args["target_bits_per_weight"] = bits
        candidates = config_dict.get("candidates")
        if candidates is not None and not (isinstance(candidates, list) and all(isinstance(c, str) for c in candidates)):
            raise FormatError(f"{where}.candidates: expected a list of scheme names or null, got {candidates!r}")
        args["candidates"] = candidates
        calibration_method = config_dict.get("calibration_method", "gptq")
        if calibration_method not in CALIBRATION_METHODS:
            raise FormatError(f"{where}.calibration_method: expected one of {CALIBRATION_METHODS}, "
                              f"got {calibration_method!r}")
        args["calibration_method"] = calibration_method
        gptq_order = config_dict.get("gptq_order", "act")
        if gptq_order not in GPTQ_ORDERS:
            raise FormatError(f"{where}.gptq_order: expected one of {GPTQ_ORDERS}, got {gptq_order!r}")
        args["gptq_order"] = gptq_order
        rounds = config_dict.get("refine_rounds", 0)
        if isinstance(rounds, bool) or not isinstance(rounds, int):
            raise FormatError(f"{where}.refine_rounds: expected an integer, got {rounds!r}")
        args["refine_rounds"] = rounds
        transposed = config_dict.get("stored_transposed")
        if transposed is not None and not (isinstance(transposed, list) and all(isinstance(n, str) for n in transposed)):
            raise FormatError(f"{where}.stored_transposed: expected a list of parameter names or null, got {transposed!r}")
        args["stored_transposed"] = transposed
        unused = {}
        for key, value in kwargs.items():
            if key in args:
                args[key] = value
            else:
                unused[key] = value
        try:
            config = cls(**args)
        except FormatError:
            raise
        except AOQError as e:
            raise FormatError(f"{where}: {e}") from None
        return (config, unused) if return_unused_kwargs else config

    @property
    def include_embeddings(self) -> bool:
        """The older name of `include_input_output_embeddings`."""
        return self.include_input_output_embeddings

    @include_embeddings.setter
    def include_embeddings(self, value: bool) -> None:
        self.include_input_output_embeddings = value

    def get_loading_attributes(self) -> dict[str, Any]:
        """What a config passed to from_pretrained may change on a checkpoint's config."""
        return {"dequantize": self.dequantize}

    def __eq__(self, other):
        return isinstance(other, AOQConfig) and self.to_dict() == other.to_dict()

    __hash__ = None


def _check_mixed_precision(bits, candidates, calibration) -> list[str] | None:
    """The candidates of a mixed-precision config (checked by name), or None without a target."""
    if bits is None:
        if candidates is not None:
            raise AOQError("AOQConfig.candidates are for mixed precision: give target_bits_per_weight too")
        return None
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0 < bits <= 32:
        raise AOQError(f"AOQConfig.target_bits_per_weight must be a number of bits per weight in (0, 32], got {bits!r}")
    if calibration is None:
        raise AOQError("AOQConfig.target_bits_per_weight needs calibration text (calibration=path) to measure "
                       "each layer's sensitivity on")
    if candidates is None:
        candidates = list(DEFAULT_CANDIDATES)
    if isinstance(candidates, str) or not all(isinstance(c, str) for c in candidates):
        raise AOQError(f"AOQConfig.candidates must be a list of scheme names (e.g. ['int4', 'int8']), got {candidates!r}")
    from ...sensitivity import parse_candidates

    parse_candidates(candidates)  # an unknown scheme or group size is an error now, not after loading
    return list(candidates)


def _one_of_two_names(new: bool | None, old: bool | None) -> bool:
    """include_input_output_embeddings, given under its name or the older include_embeddings."""
    if new is not None and old is not None and new != old:
        raise AOQError("AOQConfig: include_embeddings is the older name of include_input_output_embeddings; give one")
    value = new if new is not None else old
    return False if value is None else value




def _static_scale_missing(quant_type) -> bool:
    """Whether a static float8 config in `quant_type` waits for calibration to choose its scale."""
    configs = quant_type.mapping.values() if isinstance(quant_type, FqnToConfig) else (quant_type,)
    return any(isinstance(c, Float8StaticActivationFloat8WeightConfig) and c.scale is None for c in configs)
