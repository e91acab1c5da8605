"""The transformers integration on tiny models built from configs: AOQConfig JSON, quantize-on-load
with per-layer recipes, save/reload through sharded safetensors, dtype and device_map, memory
planning, dequantize, torch.compile and generate, tied embeddings, and what happens without
`import hf_aoq`. MoE models are in test_transformers_moe.py, SmolLM2 in test_transformers_smollm2.py.
"""
import json
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.integrations.accelerate import compute_module_sizes
from transformers.quantizers import AutoHfQuantizer, AutoQuantizationConfig
from transformers.quantizers import auto as hf_auto

import hf_aoq
from hf_aoq import (
    AOQConfig,
    AOQError,
    AOQTensor,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FormatError,
    FqnToConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8Tensor,
    Int8WeightOnlyConfig,
    PerRow,
    PerTensor,
)
from hf_aoq.configs import recipe_from_dict, recipe_to_dict
from hf_aoq.integrations.transformers import AOQHfQuantizer

from conftest import cpu_int4_packing
from models import tiny_llama_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A float bf16 checkpoint of an untied tiny Llama whose linears have biases."""
    path = tmp_path_factory.mktemp("llama")
    tiny_llama_checkpoint(path, vocab=VOCAB, bias=True, tokenizer=False)
    return str(path)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A float bf16 checkpoint of a tiny Llama that ties lm_head to the input embedding."""
    path = tmp_path_factory.mktemp("tied")
    tiny_llama_checkpoint(path, vocab=VOCAB, tie=True, seed=1, tokenizer=False)
    return str(path)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


RECIPE = FqnToConfig(
    {
        "_default": Int4WeightOnlyConfig(group_size=64),
        "re:.*self_attn.*": Int8WeightOnlyConfig(),
        "model.layers.0.mlp.down_proj": None,
        "model.layers.1.mlp.up_proj": Float8WeightOnlyConfig(),
    }
)


def load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def quantized_params(model) -> dict[str, AOQTensor]:
    return {n: p for n, p in model.named_parameters() if isinstance(p, AOQTensor)}


def canonical_bytes(t: AOQTensor) -> int:
    return sum(x.numel() * x.element_size() for x in t.to_canonical().tensor_fields().values())


# ---------------------------------------------------------------------- registration and JSON
def test_import_registers_the_aoq_method():
    assert hf_auto.AUTO_QUANTIZATION_CONFIG_MAPPING["aoq"] is AOQConfig
    assert hf_auto.AUTO_QUANTIZER_MAPPING["aoq"] is AOQHfQuantizer
    config = AOQConfig(Int8WeightOnlyConfig())
    assert isinstance(AutoHfQuantizer.from_config(config.to_dict()), AOQHfQuantizer)
    # Registering again (a second import path) is a no-op, not a "registered twice" error.
    hf_aoq.integrations.transformers.register()


RECIPES = [
    Int4WeightOnlyConfig(group_size=32, symmetric=True),
    Int8WeightOnlyConfig(group_size=64),
    Int8DynamicActivationInt8WeightConfig(),
    Float8WeightOnlyConfig(weight_dtype=torch.float8_e5m2, granularity=PerTensor()),
    Float8DynamicActivationFloat8WeightConfig(
        activation_dtype=torch.float8_e5m2, weight_dtype=torch.float8_e4m3fn, granularity=PerRow()
    ),
    FqnToConfig(
        {
            # Not in sorted order on purpose: regex keys are tried in mapping order.
            "re:.*z": Int8WeightOnlyConfig(),
            "re:.*a": Float8WeightOnlyConfig(granularity=PerTensor()),
            "model.layers.0.mlp.down_proj": None,
            "_default": Int4WeightOnlyConfig(group_size=128),
        }
    ),
]


def test_optional_config_fields_are_written_only_when_set():
    # A field added after its config shipped (metadata OPTIONAL) stays out of the JSON at its
    # default, so the recipe still reads in releases that refuse unknown keys; set, it round-trips.
    from hf_aoq.configs import recipe_from_dict, recipe_to_dict

    assert "scale_dtype" not in recipe_to_dict(Int8WeightOnlyConfig(group_size=32))
    assert recipe_to_dict(Int8WeightOnlyConfig()) == {"type": "Int8WeightOnlyConfig", "group_size": None}
    fp16 = Int8WeightOnlyConfig(group_size=32, scale_dtype=torch.float16)
    data = recipe_to_dict(fp16)
    assert "scale_dtype" in data
    assert recipe_from_dict(json.loads(json.dumps(data))) == fp16


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_config_json_round_trips_exactly(recipe):
    config = AOQConfig(
        recipe,
        modules_to_not_convert=["model.layers.1", "re_not_a_regex_key"],
        include_embeddings=True,
        untie_embedding_weights=True,
    )
    # transformers writes config.json with sort_keys=True; the recipe must survive that.
    text = json.dumps(config.to_dict(), indent=2, sort_keys=True)
    again = AutoQuantizationConfig.from_dict(json.loads(text))
    assert isinstance(again, AOQConfig)
    assert again.to_dict() == config.to_dict()
    assert again.quant_type == recipe
    if isinstance(recipe, FqnToConfig):
        assert list(again.quant_type.mapping.items()) == list(recipe.mapping.items())
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe
    assert type(recipe).from_dict(recipe.to_dict()) == recipe


def _with(d, path, value):
    d = json.loads(json.dumps(d))
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


BAD_JSON = [
    (("extra",), 1, "unknown key(s) ['extra']"),
    (("quant_method",), "torchao", "quant_method must be 'aoq'"),
    (("version",), 2, "version 2"),
    (("quant_type",), KeyError, "missing quant_type"),
    (("include_embeddings",), "yes", "include_embeddings: expected true or false"),
    (("modules_to_not_convert",), "lm_head", "modules_to_not_convert: expected a list"),
    (("quant_type", "type"), "os.system", "unknown config type 'os.system'"),
    (("quant_type", "mapping", 0, 1, "group_size"), True, "group_size: expected int"),
    (("quant_type", "mapping", 0, 1, "gs"), 1, "has no field(s) ['gs']"),
    (("quant_type", "mapping", 0, 1), {"type": "FqnToConfig", "mapping": []}, "cannot be nested"),
    (("quant_type", "mapping", 1, 1, "weight_dtype"), {"dtype": "complex64"}, "unknown dtype 'complex64'"),
    (("quant_type", "mapping", 1, 1, "weight_dtype"), {"dtype": "float32"}, "weight_dtype must be one of"),
    (("quant_type", "mapping", 1, 1, "weight_dtype"), "float8_e4m3fn", "expected dtype"),
    (("quant_type", "mapping", 1, 1, "granularity"), {"granularity": "PerGroup"}, "unknown granularity 'PerGroup'"),
    (("quant_type", "mapping", 1, 1, "granularity"), {"granularity": "PerRow", "x": 1}, "is not a bool"),
    (("quant_type", "mapping", 2), ["a", None, None], "expected a [key, config or null] pair"),
    (("quant_type", "mapping", 2, 0), "re:[", "is not a valid regex"),
    (("quant_type", "mapping", 0, 1, "group_size"), 100, "group_size must be one of"),
]


@pytest.mark.parametrize("path, value, message", BAD_JSON, ids=[m for _, _, m in BAD_JSON])
def test_config_json_is_strict(path, value, message):
    good = AOQConfig(
        FqnToConfig(
            {
                "_default": Int4WeightOnlyConfig(),
                "re:.*a": Float8WeightOnlyConfig(),
                "b": Int8WeightOnlyConfig(),
            }
        )
    ).to_dict()
    AOQConfig.from_dict(good)  # the unmodified dict is fine
    with pytest.raises(FormatError) as e:
        AOQConfig.from_dict(_with(good, path, value))
    assert message in str(e.value)


def test_config_arguments_are_checked():
    with pytest.raises(AOQError, match="needs a quant_type"):
        AOQConfig()
    with pytest.raises(AOQError, match="must be a quantization config or an FqnToConfig"):
        AOQConfig({"_default": Int8WeightOnlyConfig()})
    with pytest.raises(AOQError, match="include_embeddings must be True or False"):
        AOQConfig(Int8WeightOnlyConfig(), include_embeddings=1)
    with pytest.raises(AOQError, match="not a valid regex"):
        AOQConfig(Int8WeightOnlyConfig(), modules_to_not_convert=["("])
    assert AOQConfig(dequantize=True).quant_type is None


# ---------------------------------------------------------------------- quantize on load
def test_per_layer_recipe_follows_fqn_to_config_precedence(llama_dir):
    model = load(llama_dir, quantization_config=AOQConfig(RECIPE))
    kinds = {n: type(p).__name__ for n, p in model.named_parameters()}
    for layer in (0, 1):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert kinds[f"model.layers.{layer}.self_attn.{proj}.weight"] == "Int8Tensor"  # regex
            assert kinds[f"model.layers.{layer}.self_attn.{proj}.bias"] == "Parameter"  # biases never
        assert kinds[f"model.layers.{layer}.mlp.gate_proj.weight"] == "Int4Tensor"  # _default
        assert kinds[f"model.layers.{layer}.input_layernorm.weight"] == "Parameter"  # norms never
    assert kinds["model.layers.0.mlp.down_proj.weight"] == "Parameter"  # exact module -> None
    assert kinds["model.layers.1.mlp.up_proj.weight"] == "Float8Tensor"  # exact beats _default
    assert kinds["model.layers.1.mlp.down_proj.weight"] == "Int4Tensor"
    assert kinds["lm_head.weight"] == "Parameter"  # transformers' default skip
    assert kinds["model.embed_tokens.weight"] == "Parameter"  # embeddings only when asked
    # Weights read only by nn.Linear are placed for this device's kernel, as quantize_ does.
    assert model.model.layers[1].mlp.gate_proj.weight.packing == cpu_int4_packing()
    assert model.config.quantization_config == AOQConfig(RECIPE)


def test_quantize_on_load_matches_quantize_(llama_dir, ids):
    recipe = FqnToConfig({**RECIPE.mapping, "lm_head": None})
    loaded = load(llama_dir, quantization_config=AOQConfig(recipe))
    reference = hf_aoq.quantize_(load(llama_dir), recipe)
    q_loaded, q_reference = quantized_params(loaded), quantized_params(reference)
    assert q_loaded.keys() == q_reference.keys() and len(q_loaded) == 13
    for name, t in q_loaded.items():
        r = q_reference[name]
        assert type(t) is type(r) and getattr(t, "packing", None) == getattr(r, "packing", None), name
        assert torch.equal(t.dequantize(), r.dequantize()), name
    assert torch.equal(logits(loaded, ids), logits(reference, ids))


def test_linears_left_in_bf16_run_hf_aoqs_gemv_and_save_as_before(llama_dir, tied_dir, ids, tmp_path):
    # The lm_head (transformers' default skip) and a layer the recipe skips keep their bf16 weights
    # and nn.Linear's state; their class gives them hf_aoq's GEMV at decode rows on CPU.
    from hf_aoq.dense_linear import DenseLinear

    model = load(llama_dir, quantization_config=AOQConfig(RECIPE))
    assert type(model.lm_head) is DenseLinear and type(model.model.layers[0].mlp.down_proj) is DenseLinear
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear  # its weight is an Int4Tensor
    model.save_pretrained(tmp_path / "q")
    again = load(tmp_path / "q")
    assert type(again.lm_head) is DenseLinear
    assert torch.equal(logits(again, ids), logits(model, ids))
    tied = load(tied_dir, quantization_config=AOQConfig(Int8WeightOnlyConfig()))
    assert type(tied.lm_head) is DenseLinear and tied.lm_head.weight is tied.model.embed_tokens.weight
    one = torch.tensor([[5]])
    with torch.no_grad():
        h = tied.model(one).last_hidden_state
        y = tied(one).logits
    assert torch.allclose(y.float(), torch.nn.functional.linear(h, tied.lm_head.weight).float(), rtol=2 ** -7,
                          atol=2 ** -7)


def test_quantized_logits_are_close_to_float(llama_dir, ids):
    ref = logits(load(llama_dir), ids).float()
    out = logits(load(llama_dir, quantization_config=AOQConfig(Int8WeightOnlyConfig())), ids).float()
    # int8 per-row weights on a random tiny model: within 2% of the logits' range.
    assert (out - ref).abs().max() < 0.02 * ref.abs().max()


def test_modules_to_not_convert_wins_over_every_recipe_key(llama_dir):
    recipe = FqnToConfig({"_default": Int8WeightOnlyConfig(), "model.layers.1.mlp.up_proj": Int8WeightOnlyConfig()})
    model = load(llama_dir, quantization_config=AOQConfig(recipe, modules_to_not_convert=["model.layers.1"]))
    names = set(quantized_params(model))
    assert names and all(n.startswith("model.layers.0.") for n in names)
    assert "model.layers.1.mlp.up_proj.weight" not in names


def test_modules_to_not_convert_matches_suffixes_and_regexes(llama_dir):
    skips = ["down_proj", r"model\.layers\.\d\.self_attn\.q_proj"]  # a suffix and a regex
    config = AOQConfig(Int8WeightOnlyConfig(), modules_to_not_convert=skips)
    names = set(quantized_params(load(llama_dir, quantization_config=config)))
    assert len(names) == 2 * 5
    assert not any("down_proj" in n or "q_proj" in n for n in names)


def test_exact_names_override_transformers_default_skips(llama_dir):
    recipe = FqnToConfig({"lm_head": Int8WeightOnlyConfig()})
    model = load(llama_dir, quantization_config=AOQConfig(recipe))
    assert set(quantized_params(model)) == {"lm_head.weight"}


def test_a_named_bias_is_a_clear_error(llama_dir):
    name = "model.layers.0.self_attn.q_proj.bias"
    with pytest.raises(AOQError, match=rf"{name}: cannot quantize a 1-D"):
        load(llama_dir, quantization_config=AOQConfig(FqnToConfig({name: Int8WeightOnlyConfig()})))


def test_a_group_size_that_does_not_fit_fails_before_loading(llama_dir):
    # int8 groups must tile the row (int4 may end in a partial group): 96 divides neither
    # hidden 128 nor intermediate 256.
    with pytest.raises(AOQError, match=r"q_proj.weight: .*group_size=96.* does not fit this 128x128 weight"):
        load(llama_dir, quantization_config=AOQConfig(Int8WeightOnlyConfig(group_size=96)))


def test_dequantize_true_on_a_float_checkpoint_is_an_error(llama_dir):
    with pytest.raises(AOQError, match="this checkpoint is not quantized"):
        load(llama_dir, quantization_config=AOQConfig(dequantize=True))


# ---------------------------------------------------------------------- save and reload
@pytest.fixture(scope="module")
def saved(llama_dir, ids, tmp_path_factory):
    """The RECIPE model, its logits, and where it was saved in several shards."""
    model = load(llama_dir, quantization_config=AOQConfig(RECIPE))
    out = str(tmp_path_factory.mktemp("saved"))
    model.save_pretrained(out, max_shard_size="60KB")
    return model, logits(model, ids), out


def test_save_writes_several_shards_with_metadata(saved):
    model, _, out = saved
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(shards) >= 3
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    stored = set(index["weight_map"])
    for name, t in quantized_params(model).items():
        fields = {f"{name}:{f}" for f in t.to_canonical().tensor_fields()}
        assert fields <= stored and name not in stored
    for shard in shards:
        with safetensors.safe_open(os.path.join(out, shard), "pt") as f:
            assert hf_aoq.serialization.is_aoq_metadata(f.metadata())
    assert json.load(open(os.path.join(out, "config.json")))["quantization_config"] == AOQConfig(RECIPE).to_dict()


def test_reload_gives_identical_logits_and_layout(saved, ids):
    model, expected, out = saved
    again = load(out)
    assert again.config.quantization_config == AOQConfig(RECIPE)
    assert torch.equal(logits(again, ids), expected)
    before, after = quantized_params(model), quantized_params(again)
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert type(after[name]) is type(t) and after[name].dtype == t.dtype == torch.bfloat16
        assert getattr(after[name], "packing", None) == getattr(t, "packing", None), name
    # Saving the reloaded model again gives the same checkpoint content.
    out2 = out + "_again"
    again.save_pretrained(out2, max_shard_size="60KB")
    assert torch.equal(logits(load(out2), ids), expected)


@pytest.mark.parametrize("device_map", [None, "cpu", "auto", {"": "cpu"}])
def test_reload_with_device_map(saved, ids, device_map):
    _, expected, out = saved
    again = load(out, device_map=device_map)
    assert all(p.device.type == "cpu" for p in again.parameters())
    assert torch.equal(logits(again, ids), expected)


@pytest.mark.parametrize("device_map", ["cpu", "auto"])
def test_quantize_on_load_with_device_map(llama_dir, saved, ids, device_map):
    _, expected, _ = saved
    model = load(llama_dir, quantization_config=AOQConfig(RECIPE), device_map=device_map)
    assert torch.equal(logits(model, ids), expected)


def test_reload_in_another_dtype(saved, ids):
    _, expected, out = saved
    again = load(out, dtype=torch.float32)
    assert {p.dtype for p in again.parameters()} == {torch.float32}
    assert {type(p) for p in quantized_params(again).values()} == {Int4Tensor, Int8Tensor, hf_aoq.Float8Tensor}
    got = logits(again, ids)
    assert got.dtype == torch.float32
    # Same weights, float32 activations instead of bfloat16.
    assert (got - expected.float()).abs().max() < 0.02 * expected.float().abs().max()


def test_memory_planning_uses_real_per_layer_sizes(saved):
    model, _, out = saved
    for loaded in (model, load(out)):
        quantizer = loaded.hf_quantizer
        total = 0
        for name, p in loaded.named_parameters():
            size = quantizer.param_element_size(loaded, name, p) * p.numel()
            real = canonical_bytes(p) if isinstance(p, AOQTensor) else p.numel() * p.element_size()
            assert size == pytest.approx(real), name
            total += real
        total += sum(b.numel() * b.element_size() for b in loaded.buffers())
        assert compute_module_sizes(loaded, quantizer)[0][""] == pytest.approx(total)
    # Per layer, not per model: int4 g64 is 0.5 byte + a bf16 scale and zero per 64 elements,
    # int8 per-row 1 byte + a float32 scale per 128-element row.
    layer = model.model.layers[1]
    int4, int8 = layer.mlp.down_proj.weight, layer.self_attn.o_proj.weight
    assert canonical_bytes(int4) / int4.numel() == 0.5 + 4 / 64
    assert canonical_bytes(int8) / int8.numel() == 1 + 4 / 128


def copy_checkpoint(src_dir, dst_dir, edit):
    """Copy a checkpoint, passing each shard's (tensors, metadata) through `edit`."""
    for f in os.listdir(src_dir):
        src = os.path.join(src_dir, f)
        if f.endswith(".safetensors"):
            with safetensors.safe_open(src, "pt") as h:
                tensors, metadata = edit({k: h.get_tensor(k) for k in h.keys()}, h.metadata())
            safetensors.torch.save_file(tensors, str(dst_dir / f), metadata=metadata)
        else:
            open(dst_dir / f, "wb").write(open(src, "rb").read())
    return str(dst_dir)


VICTIM = "model.layers.1.mlp.down_proj.weight"


def test_missing_field_in_a_shard_is_a_clear_error(saved, tmp_path):
    key = VICTIM + ":scale"
    path = copy_checkpoint(saved[2], tmp_path, lambda t, m: ({k: v for k, v in t.items() if k != key}, m))
    with pytest.raises(FormatError, match=rf"'{VICTIM}', field 'scale': the metadata lists key '{key}', which is in no"):
        load(path)


def test_field_that_contradicts_the_metadata_is_a_clear_error(saved, tmp_path):
    key = VICTIM + ":scale"

    def shrink(tensors, metadata):
        if key in tensors:
            tensors[key] = tensors[key][:, :1].contiguous()
        return tensors, metadata

    with pytest.raises(FormatError, match=rf"{tmp_path}: tensor '{VICTIM}'.*'scale'"):
        load(copy_checkpoint(saved[2], tmp_path, shrink))


def test_unlisted_field_key_is_a_clear_error(saved, tmp_path):
    def add(tensors, metadata):
        tensors["model.layers.0.mlp.up_proj.weight:extra"] = torch.zeros(1)
        return tensors, metadata

    with pytest.raises(FormatError, match=r"field key 'model.layers.0.mlp.up_proj.weight:extra' is in a shard but no"):
        load(copy_checkpoint(saved[2], tmp_path, add))


def test_shard_without_hf_aoq_metadata_is_a_clear_error(saved, tmp_path):
    path = copy_checkpoint(saved[2], tmp_path, lambda t, m: (t, {"format": "pt"}))
    with pytest.raises(FormatError, match=r"model-0000\d-of-0000\d.safetensors: config.json says quant_method 'aoq'"):
        load(path)


# ---------------------------------------------------------------------- a checkpoint is one save
def strip_save_ids(tensors, metadata):
    """What a checkpoint written before save ids existed holds (docs/format.md names the key)."""
    return tensors, {k: v for k, v in metadata.items() if k != "hf_aoq_save_id"}


# The new model (every plain weight doubled) goes through save_pretrained with the same layout
# of shards as the old one; the process kills itself once the first shard has been replaced.
KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import hf_aoq
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM

    src, out = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for p in model.parameters():
            if not isinstance(p, hf_aoq.AOQTensor):
                p.mul_(2)
    write = modeling_utils.safe_save_file

    def write_then_die(*args, **kwargs):
        write(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    modeling_utils.safe_save_file = write_then_die
    model.save_pretrained(out, max_shard_size="60KB")
    """
)


@pytest.mark.parametrize("old_has_ids", [True, False], ids=["old-with-save-ids", "old-without-save-ids"])
def test_interrupted_sharded_save_is_refused_naming_the_shards(saved, tmp_path, old_has_ids):
    _, _, out = saved
    target = tmp_path / "ckpt"
    target.mkdir()
    copy_checkpoint(out, target, (lambda t, m: (t, m)) if old_has_ids else strip_save_ids)
    load(str(target))  # the old checkpoint is good
    run = subprocess.run([sys.executable, "-c", KILLED_SAVE, out, str(target)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    shards = sorted(f for f in os.listdir(target) if f.endswith(".safetensors"))
    assert len(shards) >= 3
    with pytest.raises(FormatError, match=rf"{target}: the checkpoint's files come from different saves \(save "
                                          rf"\w+ in {shards[0]}; .* in {shards[1]}, {shards[2]}"):
        load(str(target))


def test_a_stale_index_is_refused(saved, tmp_path):
    """A save killed after its last shard but before its index: the index describes another split."""
    path = copy_checkpoint(saved[2], tmp_path, lambda t, m: (t, m))
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shards = sorted(set(index["weight_map"].values()))
    key = VICTIM + ":qdata"
    index["weight_map"][key] = next(s for s in shards if s != index["weight_map"][key])
    json.dump(index, open(index_path, "w"))
    with pytest.raises(FormatError, match=rf"model.safetensors.index.json: lists '{key}' in .*, but it is in "):
        load(path)


def test_a_checkpoint_written_before_save_ids_loads(saved, ids, tmp_path):
    _, expected, out = saved
    assert torch.equal(logits(load(copy_checkpoint(out, tmp_path, strip_save_ids)), ids), expected)


def test_a_folder_with_both_a_single_file_and_an_index_is_refused(llama_dir, saved, tmp_path):
    """An int8 single-file checkpoint next to the sharded RECIPE one: transformers would read
    model.safetensors alone, with the RECIPE config."""
    single = tmp_path / "single"
    load(llama_dir, quantization_config=AOQConfig(Int8WeightOnlyConfig())).save_pretrained(single)
    both = tmp_path / "both"
    both.mkdir()
    copy_checkpoint(saved[2], both, lambda t, m: (t, m))
    os.link(single / "model.safetensors", both / "model.safetensors")
    with pytest.raises(FormatError, match=rf"{both}: holds both model.safetensors and model.safetensors.index.json"):
        load(str(both))


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(saved, tmp_path, where):
    path = tmp_path / "ckpt"
    path.mkdir()
    copy_checkpoint(saved[2], path, lambda t, m: (t, m))
    index_path = path / "model.safetensors.index.json"
    index = json.load(open(index_path))
    moved = sorted(set(index["weight_map"].values()))[-1]
    os.replace(path / moved, tmp_path / "x.safetensors")
    name = "../x.safetensors" if where == "parent" else str(tmp_path / "x.safetensors")
    index["weight_map"] = {k: name if v == moved else v for k, v in index["weight_map"].items()}
    json.dump(index, open(index_path, "w"))
    # transformers >= 5.25 refuses such an index itself, naming it and the file, before hf_aoq's reader
    # sees it; with older ones the reader refuses it (its own test: tests/serialization).
    with pytest.raises(ValueError) as e:
        load(str(path))
    if isinstance(e.value, FormatError):
        assert re.search(rf"{index_path}: .* is in shard '{re.escape(name)}', which is not a \.safetensors file in "
                         rf"the index's folder", str(e.value)), e.value
    else:
        assert str(index_path) in str(e.value) and name in str(e.value) and "outside" in str(e.value), e.value


def test_a_truncated_shard_is_an_error_naming_it(saved, tmp_path):
    path = copy_checkpoint(saved[2], tmp_path, lambda t, m: (t, m))
    shard = os.path.join(path, "model-00002-of-00007.safetensors")
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:-100])
    with pytest.raises(FormatError, match=rf"^{shard}: not a complete safetensors file: it is truncated"):
        load(path)


def test_a_duplicate_hf_aoq_key_in_a_shards_metadata_is_refused(saved, tmp_path):
    """safetensors keeps the last of two equal keys; a second "hf_aoq" could hide the first."""
    path = copy_checkpoint(saved[2], tmp_path, lambda t, m: (t, m))
    shard = os.path.join(path, "model-00001-of-00007.safetensors")
    data = open(shard, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8 : 8 + n])
    text = json.dumps(head["__metadata__"]["hf_aoq"])
    raw = data[8 : 8 + n].decode().rstrip()
    assert raw.startswith('{"__metadata__":{')
    raw = raw.replace('{"__metadata__":{', '{"__metadata__":{"hf_aoq":' + text + ",", 1).encode()
    raw += b" " * (-len(raw) % 8)
    open(shard, "wb").write(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(FormatError, match=rf"^{shard}: safetensors header: key 'hf_aoq' appears twice"):
        load(path)


def test_a_field_key_stored_in_two_shards_is_refused_naming_both(saved, tmp_path):
    key = VICTIM + ":scale"
    path = copy_checkpoint(saved[2], tmp_path, lambda t, m: (t, m))
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    home = index["weight_map"][key]
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != home)
    with safetensors.safe_open(os.path.join(path, home), "pt") as f:
        value = f.get_tensor(key)
    with safetensors.safe_open(os.path.join(path, other), "pt") as f:
        metadata, tensors = f.metadata(), f.get_tensors()
    safetensors.torch.save_file({**tensors, key: value}, os.path.join(path, other), metadata=metadata)
    with pytest.raises(FormatError, match=rf"'{key}' is stored in both ({home} and {other}|{other} and {home})"):
        load(path)


# ---------------------------------------------------------------------- dequantize
def _with_intermediate_size_doubled(src_dir, dst_dir) -> str:
    path = copy_checkpoint(src_dir, dst_dir, lambda t, m: (t, m))
    config = json.load(open(os.path.join(path, "config.json")))
    config["intermediate_size"] *= 2
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    return path


def test_a_quantized_tensor_of_another_shape_is_refused(saved, tmp_path):
    # transformers skips its size check for parameters a quantizer builds: without hf_aoq's
    # own, up_proj loaded with out_features 512 and a 256-row weight.
    path = _with_intermediate_size_doubled(saved[2], tmp_path)
    with pytest.raises(FormatError, match=r"model\.layers\.\d\.mlp\.\w+_proj\.weight is stored with shape "
                                          r"\((256, 128|128, 256)\), but the model built from its config expects "
                                          r"\((512, 128|128, 512)\)"):
        load(path)


def test_quantize_on_load_of_another_shape_is_a_size_mismatch(llama_dir, tmp_path, caplog):
    path = _with_intermediate_size_doubled(llama_dir, tmp_path)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        load(path)  # the float checkpoint: transformers' size-mismatch error
    caplog.clear()
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        load(path, quantization_config=AOQConfig(Int8WeightOnlyConfig()))
    # The load report names each parameter with both shapes, as for the float checkpoint.
    rows = [line for line in caplog.text.splitlines() if "mlp.up_proj.weight" in line]
    assert rows and "MISMATCH" in rows[0] and "[256, 128]" in rows[0] and "[512, 128]" in rows[0]


def test_dequantize_gives_a_float_model_with_the_same_outputs(llama_dir, ids, tmp_path):
    # float32 keeps the comparison about the weights, not about bfloat16 rounding in kernels.
    model = load(llama_dir, dtype=torch.float32, quantization_config=AOQConfig(RECIPE))
    expected = logits(model, ids)
    plain = model.dequantize()
    assert not quantized_params(plain)
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in plain.parameters())
    assert not hasattr(plain, "hf_quantizer") and not hasattr(plain.config, "quantization_config")
    torch.testing.assert_close(logits(plain, ids), expected, rtol=1e-4, atol=1e-4)
    plain.save_pretrained(tmp_path)
    assert "quantization_config" not in json.load(open(tmp_path / "config.json"))
    # dequantize(dtype=...) chooses the dtype of the dequantized weights.
    quant = load(llama_dir, dtype=torch.float32, quantization_config=AOQConfig(RECIPE))
    names = set(quantized_params(quant))
    half = quant.dequantize(dtype=torch.bfloat16)
    assert {p.dtype for n, p in half.named_parameters() if n in names} == {torch.bfloat16}
    assert torch.equal(logits(load(str(tmp_path)), ids), logits(plain, ids))


def test_load_with_dequantize_true_gives_the_dequantized_model(saved, ids):
    model, _, out = saved
    plain = load(out, quantization_config=AOQConfig(dequantize=True))
    assert not quantized_params(plain) and not getattr(plain, "is_quantized", False)
    assert getattr(plain.config, "quantization_config", None) is None
    reference = load(out).dequantize()
    assert torch.equal(logits(plain, ids), logits(reference, ids))
    for (n, p), (_, r) in zip(plain.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, r), n


# ---------------------------------------------------------------------- compile and generate
def test_torch_compile_and_generate(saved, ids):
    model, expected, _ = saved
    compiled = torch.compile(model)
    with torch.no_grad():
        out = compiled(ids).logits
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-2)

    prompt = ids[:1, :8]
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    # The same greedy tokens, one full forward per step without a cache.
    tokens = prompt
    for _ in range(6):
        nxt = logits(model, tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    assert torch.equal(generated, tokens)


# ---------------------------------------------------------------------- tied embeddings
def test_tied_embeddings_stay_float_by_default(tied_dir, ids):
    model = load(tied_dir, quantization_config=AOQConfig(Int8WeightOnlyConfig()))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.lm_head.weight) is nn.Parameter
    assert "model.layers.0.mlp.up_proj.weight" in quantized_params(model)


# With an FqnToConfig, an embedding that no key names takes "_default" (which otherwise only
# reaches nn.Linear weights).
@pytest.mark.parametrize("recipe", [Int8WeightOnlyConfig(), FqnToConfig({"_default": Int8WeightOnlyConfig()})])
def test_include_embeddings_quantizes_the_shared_weight_once(tied_dir, ids, tmp_path, recipe):
    model = load(tied_dir, quantization_config=AOQConfig(recipe, include_embeddings=True))
    embed = model.model.embed_tokens.weight
    assert isinstance(embed, Int8Tensor) and model.lm_head.weight is embed
    ref = logits(load(tied_dir), ids).float()
    out = logits(model, ids)
    assert (out.float() - ref).abs().max() < 0.03 * ref.abs().max()
    model.save_pretrained(tmp_path)
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("lm_head") for k in f.keys())
    again = load(str(tmp_path))
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert isinstance(again.lm_head.weight, Int8Tensor)
    assert torch.equal(logits(again, ids), out)


def test_untie_gives_the_output_embedding_its_own_weight(tied_dir, ids, tmp_path):
    recipe = FqnToConfig({"_default": Int8WeightOnlyConfig(), "re:.*embed_tokens": Int4WeightOnlyConfig(group_size=32)})
    config = AOQConfig(recipe, include_embeddings=True, untie_embedding_weights=True)
    model = load(tied_dir, quantization_config=config)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert isinstance(model.model.embed_tokens.weight, Int4Tensor)
    assert model.model.embed_tokens.weight.packing is None  # read by F.embedding: not placed
    assert isinstance(model.lm_head.weight, Int8Tensor)
    assert model.config.tie_word_embeddings is False
    float_embed = load(tied_dir).model.embed_tokens.weight
    expected_head = Int8WeightOnlyConfig().quantize_weight(float_embed)
    assert torch.equal(model.lm_head.weight.dequantize(), expected_head.dequantize())
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    again = load(str(tmp_path))
    assert again.lm_head.weight is not again.model.embed_tokens.weight
    assert torch.equal(logits(again, ids), expected)


def test_tied_weights_with_different_configs_need_untie(tied_dir):
    recipe = FqnToConfig({"_default": Int8WeightOnlyConfig(), "re:.*embed_tokens": Int4WeightOnlyConfig(group_size=32)})
    message = "lm_head.weight is tied to model.embed_tokens.weight.*untie_embedding_weights=True"
    with pytest.raises(AOQError, match=message):
        load(tied_dir, quantization_config=AOQConfig(recipe, include_embeddings=True))


# ---------------------------------------------------------------------- without `import hf_aoq`
def test_loading_without_import_hf_aoq_warns_and_leaves_weights_missing(saved):
    """What transformers itself does with an "aoq" checkpoint when hf_aoq is not imported (see
    docs/transformers.md): it warns that it does not know the quant method, loads the model as
    if it were not quantized, and every quantized weight is missing (randomly initialised)."""
    model, _, out = saved
    script = textwrap.dedent(
        f"""
        import json, sys
        from transformers import AutoModelForCausalLM
        model, info = AutoModelForCausalLM.from_pretrained({out!r}, output_loading_info=True)
        assert "hf_aoq" not in sys.modules
        print(json.dumps(sorted(info["missing_keys"])))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Unknown quantization type, got aoq" in run.stderr
    missing = set(json.loads(run.stdout.strip().splitlines()[-1]))
    assert missing == set(quantized_params(model))


def test_conversion_ops_share_the_quantizer_when_copied():
    """transformers deep-copies a converter, ops included, for every key it loads; copying the
    quantizer's state each time made pre-quantized loading quadratic in the number of tensors."""
    import copy

    from hf_aoq.integrations.transformers import AOQLoad, AOQQuantize

    state = {"entries": [object()]}
    for op in (AOQLoad(state), AOQQuantize(state)):
        again = copy.deepcopy(op)
        assert type(again) is type(op) and again is not op and again.hf_quantizer is state
