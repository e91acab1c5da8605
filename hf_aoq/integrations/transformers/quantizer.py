"""`AOQHfQuantizer`, the "aoq" HfQuantizer: plans quantize-on-load with hf_aoq.quantize.plan, reads
a pre-quantized checkpoint's metadata through hf_aoq.serialization, and hands tensors to the ops."""
from __future__ import annotations

import logging
import math
import os
import re
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import WeightConverter
from transformers.quantizers import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

from ... import model_card, serialization
from ...configs import AOQBaseConfig, FqnToConfig
from ...core import memory
from ...core.errors import AOQError, FormatError
from ...core.registry import DTYPES, tensor_type
from ...core.tensor import AOQTensor
from ...decode_attention import route_decode_attention
from ...dense_linear import route_dense_linears
from ...tensors.experts import TransposedExperts
from ...quantize import Decision, placed_for_kernels, plan, tie_groups, transposed_weight
from .config import AOQConfig
from .ops import AOQLoad, AOQQuantize, _parent, _storage_key
from .renames import guard_conversions, load_renaming, stored_names
from .sizes import _quantized_nbytes
from . import transposed as stored_transposed
from .tensor_parallel import TensorParallelLoad, probe_layout, refuse_sharded_calibration, refuse_sharded_save

logger = logging.getLogger(__name__)

# The numbered block a linear is in, as hf_aoq.calibration counts them ("model.layers.3.").
_BLOCK = re.compile(r"^(.*?)\.(\d+)\.")

# Drop the checkpoint's mapped pages after about this many bytes were read from it: bounds what
# the mapping adds to the peak resident size, at a few milliseconds per release.
_RELEASE_EVERY = 16 << 20



def _module_names(model: nn.Module, target: nn.Module | None) -> set[str]:
    if target is None:
        return set()
    return {name for name, module in model.named_modules(remove_duplicate=False) if module is target}



class AOQHfQuantizer(HfQuantizer):
    """The "aoq" quantizer. Its state is the per-parameter plan made before weights are read."""

    requires_calibration = False
    quantization_config: AOQConfig

    def __init__(self, quantization_config: AOQConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._configs: dict[str, AOQBaseConfig] = {}  # quantize-on-load: parameter -> config
        self._entries: dict[str, Any] = {}  # pre-quantized: parameter -> serialization.TensorEntry
        self._layouts: dict[str, AOQTensor] = {}  # pre-quantized: parameter -> its tensor on the meta device
        self._nbytes: dict[str, int] = {}  # parameter -> bytes it takes once quantized
        self._plan: dict[str, Decision] = {}  # quantize-on-load: hf_aoq.quantize.plan of the empty model
        self._linear_only: set[str] = set()  # parameters placed for the kernels (quantize.placed_for_kernels)
        self._mismatched: set[str] = set()  # planned, but the checkpoint's value has another shape
        self._untied: dict[str, str] = {}  # input embedding weight -> output weight made from it
        self._serialized: dict[str, list[str]] = {}  # parameter leaf name -> stored key suffixes
        self._source = "<checkpoint>"  # names the checkpoint in errors
        self._files: list[str] = []  # the checkpoint's files, whose mapped pages are released as we go
        self._unreleased = 0  # bytes read from them since their pages were last released
        self._tp: TensorParallelLoad | None = None  # under a tp_plan: cuts what is built to this rank's shard

    # ------------------------------------------------------------------ setup
    def validate_environment(self, device_map=None, **kwargs):
        config = self.quantization_config
        if not self.pre_quantized and config.dequantize:
            raise AOQError(
                "AOQConfig(dequantize=True) loads an aoq checkpoint as float; this checkpoint is not quantized"
            )
        if not self.pre_quantized and config.quant_type is None:
            raise AOQError("AOQConfig needs a quant_type to quantize a float checkpoint")
        calibration = config.calibration
        if calibration is not None and not self.pre_quantized and not os.path.isfile(calibration):
            raise AOQError(f"AOQConfig.calibration: {calibration}: no such text file")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise AOQError(
                "hf_aoq cannot offload quantized weights to disk (device_map has 'disk' entries); "
                "give the model more device or CPU memory, or use a smaller recipe"
            )

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        self._files = [os.fspath(f) for f in checkpoint_files or [] if os.fspath(f).endswith(".safetensors")]
        if self.pre_quantized:
            self._read_checkpoint(model, checkpoint_files)
            self._check_stored_shapes(model)
            groups = tie_groups(model, getattr(model, "all_tied_weights_keys", None) or {})
            self._linear_only = {n for n in self._entries if placed_for_kernels(model, groups.get(n, (n,)))}
        else:
            self._plan_quantization(model)
            self._linear_only = {n for n, d in self._plan.items() if d.place}
        # Calibration loads float weights (transformers shards them) and quantizes afterwards.
        built = self._entries if self.pre_quantized else {} if self._calibrating() else self._configs
        self._tp = TensorParallelLoad(model, self._layout, built)

    def _check_stored_shapes(self, model) -> None:
        """A quantized tensor whose shape is not the model's (config.json edited, or another
        model's checkpoint) is refused before anything is read, as transformers refuses a float
        one; its size-mismatch check skips parameters that a quantizer builds."""
        transposed = set(self.quantization_config.stored_transposed or ())
        stored_transposed.check_listed(transposed, set(self._entries), self._source)
        for name, entry in self._entries.items():
            stored = entry.attributes.get("shape")
            expected = stored_transposed.expected_stored_shape(name, model.get_parameter(name).shape, transposed,
                                                               self._source)
            if stored is not None and tuple(stored) != expected:
                raise FormatError(
                    f"{self._source}: {name} is stored with shape {tuple(stored)}, but the model built from its "
                    f"config expects {expected}; the checkpoint and its config.json do not match"
                )

    # ------------------------------------------------------------------ quantize-on-load plan
    def _plan_quantization(self, model) -> None:
        """hf_aoq.quantize.plan on the empty model, with transformers' skips and ties; then each
        planned weight's quantized size, measured on a probe (which also checks that it fits)."""
        config = self.quantization_config
        embeddings = _module_names(model, model.get_input_embeddings()) | _module_names(
            model, model.get_output_embeddings()
        )
        user_skips = list(config.modules_to_not_convert or [])
        # transformers' own default: the output embedding, the last module and tied weights.
        default_skips = set(self.get_modules_to_not_convert(model, None, model._keep_in_fp32_modules))
        if config.include_embeddings:
            default_skips -= embeddings
        default_skips = sorted(default_skips)
        if config.untie_embedding_weights:
            self._untie_embeddings(model)
        self._plan = plan(
            model,
            config.quant_type,
            skip=lambda module_name, name: _skipped(module_name, name, user_skips),
            default_skip=lambda module_name, name: _skipped(module_name, name, default_skips),
            embeddings=embeddings if config.include_embeddings else (),
            ties=getattr(model, "all_tied_weights_keys", None) or {},
        )
        # Experts stored [E, in, out] (quantize.stored_in_by_out) are quantized as their transpose
        # and load back as its view: config.json lists them.
        transposed = {n for n, d in self._plan.items() if d.transposed}
        if transposed:
            config.stored_transposed = sorted(set(config.stored_transposed or ()) | transposed)
        sizes: dict[tuple, int] = {}
        for name, decision in self._plan.items():
            param = model.get_parameter(name)
            if param.ndim not in (2, 3) or not param.is_floating_point():
                raise AOQError(
                    f"{name}: cannot quantize a {param.ndim}-D {param.dtype} parameter of shape "
                    f"{tuple(param.shape)}; hf_aoq's tensor types hold 2-D float weights and 3-D fused experts"
                )
            cfg = decision.config
            # Only a tie's source is read from the checkpoint; tie_weights shares it afterwards.
            self._configs[name] = cfg
            matrix = tuple(param.shape[-2:])  # fused experts: E matrices, each quantized as a 2-D weight
            if decision.transposed:
                matrix = matrix[::-1]
            key = (cfg, matrix, param.dtype)
            if key not in sizes:
                sizes[key] = _quantized_nbytes(cfg, matrix, param.dtype, name)
            self._nbytes[name] = sizes[key] * (param.shape[0] if param.ndim == 3 else 1)

    def _untie_embeddings(self, model) -> None:
        """Give the output embedding its own weight, made from the input embedding's on load."""
        inputs = {f"{n}.weight" for n in _module_names(model, model.get_input_embeddings())}
        outputs = {f"{n}.weight" for n in _module_names(model, model.get_output_embeddings())}
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        for target, source in list(tied.items()):
            pair = {target, source}
            if pair & inputs and pair & outputs:
                del tied[target]
                src, dst = (source, target) if source in inputs else (target, source)
                self._untied[src] = dst
        if self._untied:
            model.config.get_text_config(decoder=True).tie_word_embeddings = False
            model.config.tie_word_embeddings = False

    # ------------------------------------------------------------------ pre-quantized checkpoint
    def _read_checkpoint(self, model, checkpoint_files) -> None:
        """Read the headers of the checkpoint's shards (no data) with hf_aoq's checkpoint reader,
        which applies docs/format.md to the set (its index, one save id, no key in two shards,
        every listed key stored and every field key listed), and index what is stored for each
        quantized parameter of `model`."""
        files = [os.fspath(f) for f in checkpoint_files or []]
        source = os.path.dirname(files[0]) if files else "<no files>"
        if not files or not all(f.endswith(".safetensors") for f in files):
            raise FormatError(f"{source}: an aoq checkpoint is stored as .safetensors files; got {files}")
        extra = set(getattr(type(model.config), "extra_files", ()))  # other weights transformers adds
        ckpt = serialization.read_loader_files(
            [f for f in files if os.path.basename(f) not in extra],
            folder_hint=getattr(model.config, "name_or_path", None),
        )
        for path in ckpt.without_metadata:
            raise FormatError(f"{path}: config.json says quant_method 'aoq' but this shard has no hf_aoq metadata")
        ckpt.check()
        source, entries = ckpt.source, ckpt.entries

        params = set(model.state_dict())
        renamed = load_renaming(model)  # metadata names the tensors as stored (save renamed them)
        serialized: dict[str, set[str]] = {}
        for name, entry in entries.items():
            target = _model_name(renamed(name), params, model.base_model_prefix)
            if target is None:
                continue  # not part of this model: transformers reports it as unexpected
            # Build the tensor on the meta device from the headers: every check of the stored
            # shapes and dtypes against the metadata runs now, before any data is read.
            fields = {f: _meta_field(k, ckpt.stored(k), ckpt.where[k]) for f, k in entry.keys.items()}
            self._layouts[target] = entry.build(fields, source=ckpt.file_of(entry))
            self._entries[target] = entry
            self._nbytes[target] = sum(t.numel() * t.element_size() for t in fields.values())
            module_name, leaf = _parent(renamed(name))
            head = f"{module_name}." if module_name else ""
            # Every tensor field the type declares may be stored, and (for an old schema) the
            # fields this checkpoint lists.
            cls = tensor_type(entry.type_name)
            fields = set(cls.tensor_data_names) | set(cls.optional_tensor_data_names)
            suffixes = serialized.setdefault(leaf, set())
            suffixes.update(_storage_key(leaf, f) for f in fields)
            suffixes.update(renamed(k).removeprefix(head) for k in entry.keys.values())
        self._serialized = {leaf: sorted(suffixes) for leaf, suffixes in serialized.items()}
        self._source = source

    @property
    def serialized_names(self) -> dict[str, list[str]]:
        """{parameter leaf name: stored key suffixes}, e.g. {"weight": ["weight:qdata", ...]}."""
        return self._serialized

    def get_load_operations(self) -> dict:
        return {"deserialize": AOQLoad, "dequantize": AOQLoad}

    def update_weight_conversions(self, weight_conversions, model):
        # The base class would also route a model's own converters (e.g. the merge of
        # per-expert weights into a fused tensor) through a dequantize op, in case their sources
        # were stored quantized. hf_aoq never stores those: quantized fused experts are stored
        # fused (renames.guard_conversions), so nothing quantized goes through a converter.
        return list(weight_conversions) + self.get_weight_conversions()

    def get_weight_conversions(self):
        if not self.pre_quantized:
            return []
        return [WeightConverter(names, leaf, [AOQLoad(self)]) for leaf, names in self._serialized.items()]

    # ------------------------------------------------------------------ loading hooks
    def _layout(self, name: str) -> AOQTensor:
        """The quantized layout parameter `name` gets (built on the meta device from the
        checkpoint's headers, or a one-row probe of its config), for tensor_parallel.check_plan."""
        if self.pre_quantized:
            return self._layouts[name]
        return probe_layout(self._configs[name], self._plan[name].shape, torch.bfloat16, name)

    def _calibrating(self) -> bool:
        return not self.pre_quantized and self.quantization_config.calibration is not None

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return param_name in self._entries
        if self._calibrating():
            return False  # loaded as float; quantized with calibration after loading
        if param_name in self._mismatched:
            return False  # handed back float: transformers' own size check reports it
        return param_name in self._configs or param_name in self._untied

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        """Bytes per element as loaded: measured per layer for quantized weights."""
        nbytes = self._nbytes.get(param_name)
        if nbytes is None or self._calibrating() or (self.pre_quantized and self.quantization_config.dequantize):
            return param.element_size()
        return nbytes / param.numel()

    def get_quantize_ops(self):
        return AOQQuantize(self)

    def _quantized(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """`weight` quantized by its planned config (placed if only F.linear reads it), or
        `weight` itself when the plan leaves it float, or when its shape is not the planned
        one: transformers then reports a size mismatch, as for a float checkpoint."""
        config = self._configs.get(name)
        if config is None:
            return weight
        if tuple(weight.shape) != self._plan[name].shape:
            self._mismatched.add(name)
            return weight
        decision = self._plan[name]
        q = config.quantize_weight(transposed_weight(weight) if decision.transposed else weight, name=name)
        if self._tp is not None:  # stored transposed: whole experts only (expert parallelism)
            q = self._tp.shard(name, q, transposed=decision.transposed)
        if decision.transposed:
            return nn.Parameter(TransposedExperts(q.place()), requires_grad=False)
        if decision.place:
            q = q.place()
        return nn.Parameter(q, requires_grad=False)

    def _build_one(self, model, name: str, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        entry = self._entries.get(name)
        if entry is None:
            raise FormatError(f"{self._source}: {name} is stored as quantized fields no hf_aoq metadata describes")
        tensor = entry.build(fields, source=self._source)
        transposed = name in (self.quantization_config.stored_transposed or ())
        if self._tp is not None:
            tensor = self._tp.shard(name, tensor, transposed=transposed)
        dtype = model.get_parameter(name).dtype
        if self.quantization_config.dequantize:
            return stored_transposed.dequantized(tensor, dtype) if transposed else tensor.dequantize(dtype)
        if dtype.is_floating_point and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if transposed:
            return stored_transposed.as_parameter(tensor, name)
        if name in self._linear_only:
            tensor = tensor.place()
        return nn.Parameter(tensor, requires_grad=False)

    # ------------------------------------------------------------------ after loading, saving, dequantize
    def _process_model_after_weight_loading(self, model, **kwargs):
        # transformers keeps the conversions used while loading and reverses them on save; ours
        # have no reverse (saving flattens quantized tensors itself), so they are dropped here.
        conversions = getattr(model, "_weight_conversions", None)
        if conversions:
            model._weight_conversions = [
                c for c in conversions if not any(isinstance(op, AOQLoad) for op in getattr(c, "operations", ()))
            ]
        if self._tp is not None:
            self._tp.finish(model)
        if self._calibrating():
            refuse_sharded_calibration(model)
            self._quantize_with_calibration(model)
        self._release_memory(force=True)
        route_dense_linears(model)  # the linears left in bf16 on hf_aoq's GEMV at few CPU rows
        route_decode_attention(model)  # "sdpa" attention on hf_aoq's kernel at one query token on CPU
        model_card.attach(model)  # this model's save_pretrained and push_to_hub write its card
        return model

    def _release_memory(self, tensors=(), force: bool = False) -> None:
        """After `tensors` were read from the checkpoint and used: hand freed heap memory back,
        and drop the checkpoint's mapped pages that hold what was read (transformers keeps the
        files mapped until loading ends, so they would otherwise add the whole float checkpoint
        to the peak resident size; see hf_aoq.core.memory). A tensor that is a view of the
        mapping has its own pages dropped at once; the pages behind a copy transformers made (a
        dtype conversion) are found by scanning the mappings every _RELEASE_EVERY bytes."""
        memory.return_freed_memory()
        if not self._files:
            return
        for t in tensors:
            start = t.data_ptr()
            if t.device.type == "cpu" and memory.release_file_pages(self._files, within=(start, start + t.nbytes)):
                continue
            self._unreleased += t.nbytes
        if force or self._unreleased >= _RELEASE_EVERY:
            memory.release_file_pages(self._files)
            self._unreleased = 0

    def _quantize_with_calibration(self, model) -> None:
        """Quantize the loaded float model by the plan, int4 linears by GPTQ on the text file."""
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        from ... import calibration, perplexity

        config = self.quantization_config
        path = config.calibration
        text = perplexity.read_text(path)
        source = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception as e:
            raise AOQError(f"calibration needs the model's tokenizer, and {source!r} has none that loads "
                           f"({type(e).__name__}); save the tokenizer next to the checkpoint") from None
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if ids.numel() < 2:
            raise AOQError(f"{path}: the calibration text is empty")
        n_tokens = min(config.calibration_tokens, ids.numel())
        window = min(512, n_tokens)
        n_tokens -= n_tokens % window
        batches = perplexity.windows(ids, tokenizer.bos_token_id, n_tokens=n_tokens, window=window)
        if config.target_bits_per_weight is not None:
            self._quantize_mixed_precision(model, batches)
            return
        recipe = FqnToConfig({n: d.config for name, d in self._plan.items() for n in (name, *d.tied)})
        # One step per numbered block with int4 linears (what calibration.py reports through `log`),
        # in transformers' progress style (its tqdm honours disable_progress_bar()).
        method = config.calibration_method
        calibrated = calibration.calibrated_configs(method)
        blocks = {m.group(0) for name, cfg in self._configs.items()
                  if isinstance(cfg, calibrated) and (m := _BLOCK.match(name))}
        with hf_logging.tqdm(total=len(blocks) or None, desc=f"{method.upper()} calibration", unit="block") as bar:
            report = calibration.quantize_with_calibration(
                model, recipe, batches, log=lambda message: (bar.set_postfix_str(message.split(" (")[0]), bar.update()),
                method=method, act_order=config.gptq_order == "act",
            )
        logger.info("hf_aoq: %s", report.summary())

    def _quantize_mixed_precision(self, model, windows) -> None:
        """hf_aoq.mixed_precision over the plan's weights; the chosen FqnToConfig becomes the
        config's quant_type, which config.json stores."""
        from ...mixed_precision import quantize_mixed_precision
        from ...sensitivity import mean_loss

        config = self.quantization_config
        batches = [torch.cat(windows)]  # one pass: every weight is quantized once per candidate
        chosen, _ = quantize_mixed_precision(model, config.target_bits_per_weight, config.candidates, batches,
                                             decisions=self._plan, refine=config.refine_rounds)
        config.quant_type = chosen.recipe
        measured = math.exp(mean_loss(model, batches))
        self.mixed_precision = (chosen, measured)
        logger.info("hf_aoq: %s; calibration-text perplexity predicted %.3f, measured %.3f", chosen.summary(),
                       chosen.predicted_perplexity(), measured)

    def get_state_dict_and_metadata(self, model):
        """Plain tensors plus hf_aoq metadata: quantized weights in their canonical layout."""
        state = {k: stored_transposed.unwrap(v) for k, v in model.state_dict(keep_vars=True).items()}
        refuse_sharded_save(state)
        tied_targets = set(getattr(model, "all_tied_weights_keys", {}) or {})
        owner: dict[int, str] = {}
        for name, value in list(state.items()):
            if not isinstance(value, AOQTensor):
                continue
            if id(value) in owner:
                first = owner[id(value)]
                if name in tied_targets:
                    del state[name]
                elif first in tied_targets:
                    del state[first]
                    owner[id(value)] = name
                else:
                    raise AOQError(
                        f"{first} and {name} share one quantized tensor but the model does not declare them tied"
                    )
            else:
                owner[id(value)] = name
        # Quantized tensors are stored under the names transformers' renamings give them on save,
        # and its reverse conversions leave their field keys alone (renames.py).
        stored = stored_names(model, [k for k, v in state.items() if isinstance(v, AOQTensor)])
        taken = set(state) - set(stored)
        clash = sorted(n for n, s in stored.items() if s != n and s in taken)
        if clash:
            raise AOQError(f"{type(model).__name__}: quantized {clash} would be stored under names other tensors have")
        guard_conversions(model)
        tensors, metadata = serialization.flatten_state_dict({stored.get(k, k): v.detach() for k, v in state.items()})
        # save_pretrained writes this metadata into every shard: one id per save lets a reader
        # tell a complete set from one that an interrupted save left half replaced.
        return tensors, {**metadata, serialization.SAVE_ID_KEY: serialization.new_save_id()}

    def _dequantize(self, model, dtype=None):
        if isinstance(dtype, str):
            dtype = DTYPES.get(dtype.removeprefix("torch."))
        done: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for leaf, param in list(module._parameters.items()):
                inner = stored_transposed.unwrap(param)
                if not isinstance(inner, AOQTensor):
                    continue
                if id(param) not in done:
                    done[id(param)] = nn.Parameter(
                        stored_transposed.dequantized(inner, dtype or inner.dtype) if inner is not param
                        else param.dequantize(dtype or param.dtype))
                module._parameters[leaf] = done[id(param)]
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True



# ---------------------------------------------------------------------- helpers
def _meta_field(key: str, stored, source: str) -> torch.Tensor:
    """A meta tensor with a stored field's shape and dtype, read from the safetensors header."""
    if stored.dtype is None:
        raise FormatError(f"{source}: stored tensor {key!r} has dtype {stored.dtype_name}, which no hf_aoq field uses")
    return torch.empty(stored.shape, dtype=stored.dtype, device="meta")


def _skipped(module_name: str, name: str, patterns: list[str]) -> bool:
    """Whether a skip list names the module or the parameter, by transformers' rules (from the
    start up to a dot, as a regex with the same boundary, or as a suffix)."""
    return bool(patterns) and not (
        should_convert_module(module_name, patterns) and should_convert_module(name, patterns)
    )


def _model_name(name: str, params: set[str], prefix: str) -> str | None:
    """The model's name for a checkpoint tensor, allowing for transformers' base-model prefix
    (a checkpoint of XForCausalLM loaded as XModel, or the other way round)."""
    if name in params:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in params:
        return name[len(prefix) + 1 :]
    if prefix and f"{prefix}.{name}" in params:
        return f"{prefix}.{name}"
    return None
