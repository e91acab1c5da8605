"""The transformers integration on CUDA: quantize-on-load and pre-quantized loading with device_map
"cuda" and "auto", and checkpoints moving between CPU and CUDA. Skipped without a GPU."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_aoq import (
    AOQConfig,
    AOQTensor,
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    FqnToConfig,
    Int4DQWeightOnlyConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
)

from conftest import cpu_int4_packing
from models import tiny_llama_checkpoint

pytestmark = pytest.mark.cuda

VOCAB = 512
RECIPE = FqnToConfig({"_default": Int4WeightOnlyConfig(group_size=64), "re:.*self_attn.*": Int8WeightOnlyConfig()})


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_cuda")
    tiny_llama_checkpoint(path, hidden=256, intermediate=512, vocab=VOCAB, tokenizer=False)
    return str(path)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def logits(model, ids):
    with torch.no_grad():
        return model(ids.to(model.device)).logits.float().cpu()


def assert_close_logits(a, b):
    # Different kernels (CPU int4/int8 vs tinygemm/int_mm) on the same stored weights.
    assert (a - b).abs().max() < 0.03 * b.abs().max()


def quantized(model):
    return {n: p for n, p in model.named_parameters() if isinstance(p, AOQTensor)}


@pytest.mark.parametrize("device_map", ["cuda", "auto"])
def test_quantize_on_load_on_cuda(llama_dir, ids, device_map):
    config = AOQConfig(RECIPE)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=config, device_map=device_map)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    up = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(up, Int4Tensor) and up.packing == "cuda_tinygemm"
    cpu = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=AOQConfig(RECIPE))
    assert_close_logits(logits(model, ids), logits(cpu, ids))


def test_checkpoint_saved_on_cpu_reloads_on_cuda(llama_dir, ids, tmp_path):
    cpu = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=AOQConfig(RECIPE))
    cpu.save_pretrained(tmp_path, max_shard_size="200KB")
    for device_map in ("cuda", "auto"):
        gpu = AutoModelForCausalLM.from_pretrained(str(tmp_path), device_map=device_map)
        assert {p.device.type for p in gpu.parameters()} == {"cuda"}
        assert gpu.model.layers[1].mlp.down_proj.weight.packing == "cuda_tinygemm"
        for name, t in quantized(cpu).items():
            # Same stored weights: the canonical layouts agree exactly.
            mine, theirs = t.to_canonical(), quantized(gpu)[name].to_canonical()
            for field, value in mine.tensor_fields().items():
                assert torch.equal(value, getattr(theirs, field).cpu()), (name, field)
        assert_close_logits(logits(gpu, ids), logits(cpu, ids))


def test_checkpoint_saved_on_cuda_reloads_on_cpu(llama_dir, ids, tmp_path):
    gpu = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=AOQConfig(RECIPE), device_map="cuda")
    expected = logits(gpu, ids)
    gpu.save_pretrained(tmp_path)
    cpu = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert {p.device.type for p in cpu.parameters()} == {"cpu"}
    assert cpu.model.layers[0].mlp.up_proj.weight.packing == cpu_int4_packing()
    assert_close_logits(logits(cpu, ids), expected)
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path), device_map="cuda")
    assert torch.equal(logits(again, ids), expected)


EVERY_TYPE = {
    "int4": Int4WeightOnlyConfig(group_size=64),
    "int8": Int8WeightOnlyConfig(),
    "int8-dynamic": Int8DynamicActivationInt8WeightConfig(),
    "fp8": Float8WeightOnlyConfig(),
    "fp8-dynamic": Float8DynamicActivationFloat8WeightConfig(),
    "int4dq": Int4DQWeightOnlyConfig(),
}


@pytest.mark.parametrize("name", list(EVERY_TYPE))
def test_every_type_moves_between_cpu_and_cuda(llama_dir, ids, tmp_path, name):
    """Saved on CPU, loaded on CUDA (and the other way round): the same canonical fields, and
    logits close to the CPU model's."""
    recipe = FqnToConfig({"_default": EVERY_TYPE[name]})
    cpu = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=AOQConfig(recipe))
    cpu.save_pretrained(tmp_path / "from_cpu")
    gpu = AutoModelForCausalLM.from_pretrained(str(tmp_path / "from_cpu"), device_map="cuda")
    assert {p.device.type for p in gpu.parameters()} == {"cuda"}
    for pname, t in quantized(cpu).items():
        mine, theirs = t.to_canonical(), quantized(gpu)[pname].to_canonical()
        for field, value in mine.tensor_fields().items():
            assert torch.equal(value, getattr(theirs, field).cpu()), (pname, field)
    assert_close_logits(logits(gpu, ids), logits(cpu, ids))
    gpu.save_pretrained(tmp_path / "from_cuda")
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "from_cuda"))
    assert {p.device.type for p in back.parameters()} == {"cpu"}
    assert torch.equal(logits(back, ids), logits(cpu, ids))


@pytest.mark.parametrize("name", ["int4", "int8-dynamic", "fp8-dynamic"])
def test_generate_on_cuda(llama_dir, name):
    """Decoding runs one row per step (the fp8 per-row path that crashed at one row)."""
    recipe = FqnToConfig({"_default": EVERY_TYPE[name]})
    model = AutoModelForCausalLM.from_pretrained(llama_dir, quantization_config=AOQConfig(recipe), device_map="cuda")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0)).cuda()
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out.shape == (1, 13) and out.is_cuda
