"""hf_aoq's decode-step attention (csrc/attention.cpp, kernels/cpu_attention.py) and the transformers
attention function that runs it (hf_aoq/decode_attention.py): against a float64 reference and
against transformers' sdpa attention (the fallback), on every path (grouped, multi- and
single-KV-head layouts, head sizes with and without a column tail, masks of each kind and
broadcast, strided caches, one to three threads, eager and compiled); the function takes the
kernel only where it applies; quantizing a transformers model routes its "sdpa" attention and
nothing it saves changes. The AVX2 and AVX-512 builds give the same bits (tests/kernels/test_cpu_isa.py,
slow)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_aoq.decode_attention import ATTENTION, attention_forward, route_decode_attention
from hf_aoq.kernels import cpu_attention, cpu_ext

SIMD = cpu_ext.available() and cpu_ext.chosen_isa() in ("avx2", "avx512")
needs_simd = pytest.mark.skipif(not SIMD, reason="hf_aoq's C++ extension with vector kernels is not built here "
                                                 f"({cpu_ext.chosen_isa() if cpu_ext.available() else 'none'})")


def reference(q, k, v, mask, scale) -> torch.Tensor:
    """float64 softmax(q k^T scale + mask) v, grouped heads repeated; [B, 1, H, Dv]. Rows with every
    position masked give zeros (as aten's CPU attention)."""
    rep = q.shape[1] // k.shape[1]
    k64, v64 = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = (q.double() @ k64.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.where(dead, 0.0, s.softmax(-1))
    return (p @ v64).transpose(1, 2)


def close_to(out, want, dtype) -> None:
    # float32 sums of float32 (or exactly widened bf16) products, one rounding to the dtype at the end.
    tol = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5
    scale = want.abs().amax().clamp_min(1.0)
    assert ((out.double() - want).abs() <= tol * (want.abs() + 0.01 * scale)).all(), \
        (out.double() - want).abs().max()


def _inputs(b, h, hk, length, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g).to(dtype)
    k = torch.randn(b, hk, length, d, generator=g).to(dtype)
    v = torch.randn(b, hk, length, dv, generator=g).to(dtype)
    return q, k, v


@needs_simd
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b, h, hk", [(1, 8, 2), (3, 4, 4), (2, 6, 1), (1, 9, 3), (2, 32, 4)])
@pytest.mark.parametrize("length", [1, 5, 17, 40])
@pytest.mark.parametrize("d, dv", [(64, 64), (80, 80), (8, 8), (48, 32)])
def test_kernel_is_attention_within_float32_sums(dtype, b, h, hk, length, d, dv):
    q, k, v = _inputs(b, h, hk, length, d, dv, dtype, seed=b * h + length + d)
    scale = d ** -0.5
    out = cpu_attention.decode_attention(q, k, v, None, scale)
    assert out.shape == (b, 1, h, dv) and out.dtype == dtype and out.is_contiguous()
    close_to(out, reference(q, k, v, None, scale), dtype)


@needs_simd
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masks_of_each_kind_and_broadcast(dtype):
    b, h, hk, length, d = 3, 8, 2, 37, 64
    q, k, v = _inputs(b, h, hk, length, d, d, dtype, seed=7)
    g = torch.Generator().manual_seed(8)
    per_batch = torch.rand(b, 1, 1, length, generator=g) < 0.7
    per_batch[..., 0] = True
    per_head = torch.rand(b, h, 1, length, generator=g) < 0.5
    per_head[..., 3] = True
    shared = torch.ones(1, 1, 1, length, dtype=torch.bool)
    shared[..., 20:] = False  # a static cache's unfilled positions
    additive = torch.randn(b, 1, 1, length, generator=g)
    additive[..., 5:9] = float("-inf")
    finite_min = torch.where(per_batch, 0.0, torch.finfo(torch.bfloat16).min)  # transformers' float masks
    for mask in (per_batch, per_head, shared, additive, finite_min, torch.zeros(1, 1, 1, length), additive.to(dtype)):
        assert cpu_attention.applies(q, k, v, mask)
        out = cpu_attention.decode_attention(q, k, v, mask, 0.125)
        close_to(out, reference(q, k, v, mask, 0.125), dtype)


@needs_simd
def test_every_position_masked_gives_zeros_as_aten_and_nan_stays_nan():
    q, k, v = _inputs(2, 4, 2, 9, 16, 16, torch.bfloat16, seed=3)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1] = False
    out = cpu_attention.decode_attention(q, k, v, mask, 0.25)
    aten = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(aten[1], torch.zeros_like(aten[1]))
    q[0, 1, 0, 3] = float("nan")
    out = cpu_attention.decode_attention(q, k, v, None, 0.25)
    assert out[0, 0, 1].isnan().all() and not out[0, 0, 0].isnan().any() and not out[1].isnan().any()
    k[1, 0, 4, 0] = float("inf")  # heads 0 and 1 of batch 1 score it +inf (NaN, as aten) or -inf (dropped)
    out = cpu_attention.decode_attention(q, k, v, None, 0.25)
    plus = q[1, :2, 0, 0] > 0
    assert out[1, 0, :2][plus].isnan().all() and not out[1, 0, :2][~plus].isnan().any()
    assert not out[1, 0, 2:].isnan().any()
    aten = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                          v.float().repeat_interleave(2, 1)).transpose(1, 2)
    assert torch.equal(aten[1, 0, :2].isnan(), out[1, 0, :2].isnan())


@needs_simd
def test_strided_caches_and_queries():
    # A static cache's first L positions (a slice of a longer buffer), queries and values with
    # padded rows (strides past their head size).
    b, h, hk, d = 2, 8, 4, 64
    q = torch.randn(b, h, 1, d + 8, dtype=torch.bfloat16)[..., :d]
    kbuf = torch.randn(b, hk, 50, d, dtype=torch.bfloat16)
    vbuf = torch.randn(b, hk, 50, d + 16, dtype=torch.bfloat16)
    k, v = kbuf[:, :, :21], vbuf[:, :, :21, :d]
    assert not q.is_contiguous() and not v.is_contiguous()
    out = cpu_attention.decode_attention(q, k, v, None, 0.125)
    assert torch.equal(out, cpu_attention.decode_attention(q.contiguous(), k.contiguous(), v.contiguous(), None, 0.125))
    close_to(out, reference(q, k, v, None, 0.125), torch.bfloat16)


@needs_simd
@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts_change_no_bit(threads):
    # Tasks split the grouped heads by the thread count: each head's value is the same however it
    # is grouped.
    q, k, v = _inputs(1, 32, 4, 70, 64, 64, torch.bfloat16, seed=11)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.decode_attention(q, k, v, None, 0.125)
        torch.set_num_threads(threads)
        assert torch.equal(cpu_attention.decode_attention(q, k, v, None, 0.125), one)
    finally:
        torch.set_num_threads(before)


@needs_simd
def test_compiled_op_gives_the_eager_bits():
    q, k, v = _inputs(2, 8, 2, 13, 64, 64, torch.bfloat16, seed=5)
    mask = torch.ones(2, 1, 1, 13, dtype=torch.bool)
    mask[0, ..., 10:] = False
    fn = torch.compile(lambda *a: cpu_attention.decode_attention(*a, 0.125), fullgraph=True)
    assert torch.equal(fn(q, k, v, mask), cpu_attention.decode_attention(q, k, v, mask, 0.125))


@needs_simd
def test_kernel_errors_name_what_was_expected():
    q, k, v = _inputs(1, 8, 2, 5, 16, 16, torch.bfloat16)
    ext = cpu_ext.load()
    with pytest.raises(RuntimeError, match="one query token"):
        ext.decode_attention(torch.cat([q, q], 2), k, v, None, 1.0)
    with pytest.raises(RuntimeError, match="query heads over"):
        ext.decode_attention(q, k[:, :1].expand(1, 3, 5, 16), v[:, :1].expand(1, 3, 5, 16), None, 1.0)
    with pytest.raises(RuntimeError, match="one dtype"):
        ext.decode_attention(q, k.float(), v, None, 1.0)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        ext.decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None, 1.0)


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@needs_simd
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_function_matches_transformers_sdpa(dtype):
    b, h, hk, length, d = 2, 8, 2, 29, 64
    q, k, v = _inputs(b, h, hk, length, d, d, dtype, seed=2)
    mask = torch.ones(b, 1, 1, length, dtype=torch.bool)
    mask[1, ..., :6] = False  # left padding
    module = _Module(h // hk).eval()
    for m, scaling in ((None, None), (mask, 0.1)):
        ours, weights = attention_forward(module, q, k, v, m, scaling=scaling)
        want, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), m, scaling=scaling)
        assert weights is None and ours.shape == want.shape == (b, 1, h, d) and ours.dtype == dtype
        torch.testing.assert_close(ours.float(), want, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_attention_function_leaves_what_the_kernel_does_not_take_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(a))
    module = _Module(2).eval()
    q, k, v = _inputs(1, 4, 2, 6, 16, 16, torch.bfloat16)
    prefill = torch.randn(1, 4, 3, 16, dtype=torch.bfloat16)
    cases = [
        dict(query=prefill),  # several query tokens
        dict(query=q.half(), key=k.half(), value=v.half()),  # float16
        dict(query=q.clone().requires_grad_()),  # a gradient wanted
        dict(attention_mask=torch.ones(1, 1, 2, 6, dtype=torch.bool)),  # a mask that does not fit one query
        dict(position_bias=torch.zeros(1, 4, 1, 6, dtype=torch.bfloat16)),
    ]
    for case in cases:
        args = dict(query=q, key=k, value=v, attention_mask=None)
        args.update(case)
        out, _ = attention_forward(module, args.pop("query"), args.pop("key"), args.pop("value"),
                                   args.pop("attention_mask"), **args)
        assert out.shape[-1] == 16
    training = _Module(2).train()
    attention_forward(training, q, k, v, None, dropout=0.1)
    assert calls == []
    if SIMD:
        attention_forward(training, q, k, v, None, dropout=0.0)  # training without dropout: the kernel
        assert len(calls) == 1


def _tiny_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, **kw)
    return LlamaForCausalLM(cfg).eval()


@needs_simd
def test_quantized_model_decodes_on_the_kernel_with_sdpas_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_aoq import AOQConfig, Int8WeightOnlyConfig

    float_model = _tiny_llama().to(torch.bfloat16)
    float_model.save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.bfloat16,
                                                 quantization_config=AOQConfig(Int8WeightOnlyConfig()))
    assert model.config._attn_implementation == ATTENTION
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    attn[1, :4] = 0  # left padding: the decode step's mask
    calls = []
    real = cpu_attention.decode_attention

    def counted(*a):
        calls.append(a[0].shape)
        return real(*a)

    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=attn, use_cache=True)
        step = dict(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=torch.cat([attn, attn[:, :1] * 0 + 1], 1),
                    past_key_values=out.past_key_values, use_cache=True)
        cpu_attention.decode_attention = counted
        try:
            ours = model(**step).logits
        finally:
            cpu_attention.decode_attention = real
        assert len(calls) == 2  # one per layer, the prefill on sdpa
        model.set_attn_implementation("sdpa")
        out = model(input_ids=ids, attention_mask=attn, use_cache=True)
        step["past_key_values"] = out.past_key_values
        want = model(**step).logits
    torch.testing.assert_close(ours.float(), want.float(), rtol=0.02, atol=0.02)
    # Saved and reloaded: nothing of the runtime choice in the files, routed again on load.
    model.config._attn_implementation_internal = ATTENTION
    model.save_pretrained(tmp_path / "q")
    assert ATTENTION not in (tmp_path / "q" / "config.json").read_text()
    assert "_attn_implementation" not in json.loads((tmp_path / "q" / "config.json").read_text())
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert again.config._attn_implementation == ATTENTION


def test_route_keeps_other_attention_choices_and_plain_modules():
    model = _tiny_llama()
    model.set_attn_implementation("eager")
    assert route_decode_attention(model) == [] and model.config._attn_implementation == "eager"
    model.set_attn_implementation("sdpa")
    assert route_decode_attention(model) == ["LlamaConfig"] and model.config._attn_implementation == ATTENTION
    assert route_decode_attention(model) == []
    assert route_decode_attention(torch.nn.Linear(2, 2)) == []
    # generate runs on it, and gives sdpa's greedy tokens (float32: the sums agree to 1e-6).
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ours = model.generate(ids, max_new_tokens=8, do_sample=False)
        model.set_attn_implementation("sdpa")
        want = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(ours, want)


def test_route_leaves_models_that_name_sdpa_and_models_off_the_cpu():
    from transformers import FalconConfig, FalconForCausalLM

    # Falcon's modeling code sets `_attn_implementation = "sdpa"` by name: not switched.
    falcon = FalconForCausalLM(FalconConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                            vocab_size=100, new_decoder_architecture=True, num_kv_heads=2))
    assert falcon.config._attn_implementation == "sdpa"
    assert route_decode_attention(falcon) == [] and falcon.config._attn_implementation == "sdpa"
    with torch.device("meta"):
        meta = _tiny_llama()
    assert route_decode_attention(meta) == [] and meta.config._attn_implementation == "sdpa"


def test_quantize_routes_a_transformers_models_attention():
    from hf_aoq import Int8WeightOnlyConfig, quantize_

    model = _tiny_llama().to(torch.bfloat16)
    quantize_(model, Int8WeightOnlyConfig())
    assert model.config._attn_implementation == ATTENTION
