"""The bf16 panel GEMM rows (kernels/cpu_amx.py, csrc/amx_gemm.h), on both of their engines, AMX
tiles and AVX512-BF16's dot products: the weight each panel holds is the reference's
dequantize(bfloat16) bit for bit, the outputs agree with the reference kernel within float32
accumulation, every chunking and tail path runs, and the kernel table takes them only where they
apply (the AMX rows where AMX is granted, else the AVX512-BF16 rows). (Int8 weights with dynamic
int8 activations: test_cpu_int8dyn.py.) Each engine is skipped, saying why, where the CPU (or OS,
or build) does not allow it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_aoq import Float8Tensor, Int4DQTensor, Int4Tensor, Int8Tensor, IntxDQTensor, IntxTensor
from hf_aoq.kernels import cpu_amx, cpu_ext, cpu_fp8_dot, cpu_isa, registry, select_kernel
from hf_aoq.kernels.reference import reference_linear
from hf_aoq.tensors.float8 import PerTensor

AMX = cpu_isa.amx_bf16_allowed() and cpu_ext.available() and cpu_ext.load().amx_available()
# The dot-product engine runs wherever the avx512 build does (AVX512-BF16 is one of its flags),
# AMX machines included, though the table takes it only where AMX is not.
DOT = cpu_isa.avx512_allowed() and cpu_ext.available() and cpu_ext.chosen_isa() == "avx512"
_HERE = f"({cpu_isa.describe()['flags']}, extension {cpu_ext.chosen_isa()})"
ENGINES = [
    pytest.param(True, id="amx", marks=pytest.mark.skipif(
        not AMX, reason=f"this CPU (or OS, or build) grants no AMX-BF16 {_HERE}: the AMX engine is skipped")),
    pytest.param(False, id="avx512bf16", marks=pytest.mark.skipif(
        not DOT, reason=f"no AVX512-BF16 build here {_HERE}: the dot-product engine is skipped")),
]
# The engine the kernel table takes here, its rows' names and their fewest rows.
TABLE_ENGINE = "amx" if AMX else "avx512bf16" if DOT and cpu_isa.bf16_gemm_isa() == "avx512_bf16" else None
MIN_ROWS = cpu_amx.MIN_ROWS if TABLE_ENGINE == "amx" else cpu_amx.MIN_ROWS_AVX512_BF16
needs_table_engine = pytest.mark.skipif(
    TABLE_ENGINE is None, reason=f"neither engine runs here {_HERE}: the table's panel rows are skipped")

ROW = {fmt: f"cpu_{fmt}_{TABLE_ENGINE}" for fmt in ("int4", "int4dq", "int8", "fp8", "intx", "intxdq")}


def _weights(n: int, k: int, seed: int = 0) -> dict[str, tuple[str, object]]:
    torch.manual_seed(seed)
    w = torch.randn(n, k) * 0.05
    out = {f"int4 g{g}": ("int4", Int4Tensor.from_float(w.bfloat16(), g).place()) for g in (32, 64, 128, 256)
           if k % g == 0 or g == 128}
    out["int4 g32 fp16 scales"] = ("int4", Int4Tensor.from_float(w.half(), 32).place())
    out["int4 g64 fp32 scales, symmetric"] = ("int4", Int4Tensor.from_float(w, 64, True).place())
    out.update({f"int4dq g{g}": ("int4dq", Int4DQTensor.from_float(w, g).place()) for g in (32, 64)})
    out["int8"] = ("int8", Int8Tensor.from_float(w))
    out["int8 dynamic"] = ("int8", Int8Tensor.from_float(w, act_quant="per_token"))
    out["fp8 e4m3"] = ("fp8", Float8Tensor.from_float(w))
    out["fp8 e5m2 per tensor"] = ("fp8", Float8Tensor.from_float(w, torch.float8_e5m2, PerTensor()))
    for bits, g, symmetric in ((3, 32, False), (2, 16, True), (5, 64, False), (7, 32, False), (8, 128, True),
                               (1, None, False)):
        out[f"intx int{bits} g{g}"] = ("intx", IntxTensor.from_float(w.bfloat16(), bits, g, symmetric=symmetric))
    out["intx int4 g32 fp16 scales"] = ("intx", IntxTensor.from_float(w.half(), 4, 32, symmetric=False))
    out["intx int6 g32 int8 activations"] = ("intx", IntxTensor.from_float(w.bfloat16(), 6, 32, act_quant="per_token"))
    out.update({f"intxdq int{b} g{g}": ("intxdq", IntxDQTensor.from_float(w, b, g)) for b in (2, 3) for g in (32, 64)})
    return out


def _run(fmt: str, x: torch.Tensor, w, bias=None, tiles=True) -> torch.Tensor:
    return cpu_amx.FUNCTIONS[fmt](x, w, bias, tiles=tiles)


@pytest.mark.parametrize("tiles", ENGINES)
@pytest.mark.parametrize("name", list(_weights(64, 256)))
def test_panels_hold_the_reference_weight_bit_for_bit(name, tiles):
    # x = the identity: each output is one product w * 1.0, exact in float32, so y = W^T exactly
    # when the panel's bf16 values are dequantize(bfloat16)'s.
    fmt, w = _weights(64, 256)[name]
    x = torch.eye(256, dtype=torch.bfloat16)
    y = _run(fmt, x, w, tiles=tiles)
    assert torch.equal(y, w.dequantize(torch.bfloat16).t()), name


@pytest.mark.parametrize("tiles", ENGINES)
def test_denormal_weights_read_as_zero_as_the_tile_multiply_reads_them(tiles):
    # The tile multiply (TDPBF16PS) and the dot product (VDPBF16PS) treat denormal bf16 inputs as
    # zero, in aten's AMX GEMM as here; the panels' conversion flushes each weight whose float32 value is denormal (before
    # rounding: one just below 2^-126 would round up to the smallest normal). Every other weight
    # stays exact.
    torch.manual_seed(1)
    x = torch.eye(128, dtype=torch.bfloat16)
    w8 = Int8Tensor.from_float(torch.randn(32, 128))
    w4 = Int4Tensor.from_float(torch.randn(64, 128), 32)
    w4 = w4.replace(scale=w4.scale * 2.0 ** -124, zero=w4.zero * 2.0 ** -124).place()
    f8 = Float8Tensor.from_float(torch.randn(32, 128))
    for fmt, w, scale in (("int8", w8, 2.0 ** -125), ("int4", w4, 1.0), ("fp8", f8, 2.0 ** -115)):
        w = w.replace(scale=w.scale * scale)
        want = w.dequantize(torch.float32)
        denormal = (want != 0) & (want.abs() < 2.0 ** -126)
        assert denormal.any() and (want.abs() >= 2.0 ** -126).any(), fmt
        assert torch.equal(w.dequantize(torch.bfloat16), want.bfloat16()), fmt  # one rounding of these floats
        assert torch.equal(_run(fmt, x, w, tiles=tiles), torch.where(denormal, 0, want).bfloat16().t()), fmt


def _within_fp32_accumulation(y: torch.Tensor, x: torch.Tensor, w_bf16: torch.Tensor, bias) -> None:
    exact = x.double() @ w_bf16.double().t()
    if bias is not None:
        exact = exact + bias.to(torch.bfloat16).double()
    # One bf16 rounding of the output, and float32 sums of K products in any order.
    magnitude = x.double().abs() @ w_bf16.double().abs().t()
    bound = exact.abs() * 2.0 ** -8 + magnitude * x.shape[-1] * 2.0 ** -24 + 1e-30
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.parametrize("tiles", ENGINES)
@pytest.mark.parametrize("rows", [1, 8, 12, 16, 20, 28, 33, 64, 257])
def test_outputs_agree_with_the_reference_kernel(rows, tiles):
    torch.manual_seed(rows)
    for name, (fmt, w) in _weights(96, 384, seed=rows).items():
        bias = torch.randn(96, dtype=torch.bfloat16)
        x = torch.randn(rows, 384, dtype=torch.bfloat16)
        for b in (None, bias):
            y = _run(fmt, x, w, b, tiles=tiles)
            ref = reference_linear(x, w, b)
            assert y.dtype == torch.bfloat16 and y.shape == ref.shape
            _within_fp32_accumulation(y, w.simulate_input_quantization(x), w.dequantize(torch.bfloat16), b)
            # and as close to the reference as one bf16 rounding apart
            assert torch.allclose(y.float(), ref.float(), rtol=2 ** -7, atol=1e-2), name


@pytest.mark.parametrize("tiles", ENGINES)
def test_chunks_of_rows_and_of_k(tiles):
    # 300 rows: a chunk of 256 and one of 44 (a last 32-row block and a 12-row tail); K = 4096 at
    # 256 rows is 2 MB of activations, past the 1 MB chunk: three chunks of k, the sums carried
    # across them in the per-thread buffer. Also columns of x fewer than the padded K.
    torch.manual_seed(3)
    w = torch.randn(64, 4096) * 0.05
    for fmt, q in (("int8", Int8Tensor.from_float(w)), ("int4", Int4Tensor.from_float(w.bfloat16(), 128).place()),
                   ("int4dq", Int4DQTensor.from_float(w, 32).place()), ("fp8", Float8Tensor.from_float(w)),
                   ("intx", IntxTensor.from_float(w.bfloat16(), 3, 64, symmetric=False)),
                   ("intxdq", IntxDQTensor.from_float(w, 3, 32))):
        x = torch.randn(300, 4096, dtype=torch.bfloat16)
        _within_fp32_accumulation(_run(fmt, x, q, tiles=tiles), x, q.dequantize(torch.bfloat16), None)
    # At most 16 rows (half blocks: the tiles of rows 16-31 skipped) with k in chunks: 12 rows x
    # 49152 is 1.2 MB of bf16 activations.
    w = torch.randn(32, 49152) * 0.05
    x = torch.randn(12, 49152, dtype=torch.bfloat16)
    for fmt, q in (("int8", Int8Tensor.from_float(w)), ("int4", Int4Tensor.from_float(w.bfloat16(), 128).place())):
        _within_fp32_accumulation(_run(fmt, x, q, tiles=tiles), x, q.dequantize(torch.bfloat16), None)
    # 20 rows (x's rows multiplied in groups of 8, 8 and 4 on the dot products, amx_gemm.h
    # dot_block) with k in chunks: 20 x 32768 is 1.3 MB of activations.
    w = torch.randn(32, 32768) * 0.05
    x = torch.randn(20, 32768, dtype=torch.bfloat16)
    for fmt, q in (("int4", Int4Tensor.from_float(w.bfloat16(), 128).place()),
                   ("int4dq", Int4DQTensor.from_float(w, 32).place())):
        _within_fp32_accumulation(_run(fmt, x, q, tiles=tiles), x, q.dequantize(torch.bfloat16), None)
    padded = Int4Tensor.from_float(torch.randn(64, 320, dtype=torch.bfloat16), 128).place()  # K padded to 384
    x = torch.randn(40, 320, dtype=torch.bfloat16)
    _within_fp32_accumulation(_run("int4", x, padded, tiles=tiles), x, padded.dequantize(torch.bfloat16), None)


@pytest.mark.parametrize("tiles", ENGINES)
def test_a_rows_value_does_not_depend_on_the_rows_beside_it(tiles):
    # Every row's sums are its own (the tiles multiply a whole block, padding included; the dot
    # products only the rows there are where x is A, in groups of 4 to 11, and 8 lanes of 16 where
    # x is B and has at most 8), so each row of a call is the same bits as in a call of 32 rows,
    # whatever the row count and the engine.
    torch.manual_seed(5)
    x = torch.randn(32, 384, dtype=torch.bfloat16)
    for name, (fmt, w) in _weights(96, 384, seed=5).items():
        whole = _run(fmt, x, w, tiles=tiles)
        for rows in (1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 24, 25, 28, 29):
            assert torch.equal(_run(fmt, x[:rows], w, tiles=tiles), whole[:rows]), (name, rows)


@pytest.mark.parametrize("tiles", ENGINES)
def test_scratch_kept_between_calls_leaks_nothing(tiles):
    # The x blocks, panels and sums are kept per thread between calls and not zero-filled
    # (amx_gemm.h AmxBuffer): a call must take no value a larger call left there (its panel and x
    # blocks written before they are read, its sums started from zero at its first chunk of k).
    # Each call below, made once before and once after calls that fill the buffers with other
    # values (chunked 300 x 4096 calls, a 12 x 49152, and a 600 x 8192 whose 10 MB of x blocks are
    # more than a thread keeps, so freed after it), gives the same bits and agrees with the
    # reference; "int8 chunked" (20 x 32768, 1.3 MB of x) carries its sums across chunks of k.
    torch.manual_seed(5)
    small = {name: (q, torch.randn(rows, q.shape[1], dtype=torch.bfloat16))
             for name, q, rows in (("int8", Int8Tensor.from_float(torch.randn(64, 128) * 0.05), 12),
                                  ("int8 chunked", Int8Tensor.from_float(torch.randn(32, 32768) * 0.05), 20),
                                  ("fp8", Float8Tensor.from_float(torch.randn(32, 192) * 0.05), 33),
                                  ("int4", Int4Tensor.from_float(torch.randn(96, 256, dtype=torch.bfloat16), 128).place(), 7))}
    before = {name: _run(name.split()[0], x, q, tiles=tiles) for name, (q, x) in small.items()}
    for name, (q, x) in small.items():
        _within_fp32_accumulation(before[name], x, q.dequantize(torch.bfloat16), None)
    big = Int8Tensor.from_float(torch.randn(64, 4096) * 3.0)
    _run("int8", torch.randn(300, 4096, dtype=torch.bfloat16) * 100, big, tiles=tiles)
    _run("fp8", torch.randn(300, 4096, dtype=torch.bfloat16) * 100, Float8Tensor.from_float(torch.randn(64, 4096)),
         tiles=tiles)
    _run("int4", torch.randn(12, 49152, dtype=torch.bfloat16) * 100,
         Int4Tensor.from_float(torch.randn(32, 49152, dtype=torch.bfloat16), 128).place(), tiles=tiles)
    _run("int8", torch.randn(600, 8192, dtype=torch.bfloat16) * 100, Int8Tensor.from_float(torch.randn(32, 8192)),
         tiles=tiles)
    for name, (q, x) in small.items():
        assert torch.equal(_run(name.split()[0], x, q, tiles=tiles), before[name]), name


@needs_table_engine
def test_the_table_takes_the_panel_rows_where_they_apply(monkeypatch):
    weights = _weights(64, 256)
    first = dict(MIN_ROWS)
    dot_fp8 = next(k for k in registry.kernels_for("linear", "Float8Tensor") if k.name == "cpu_fp8_dpbf16")
    if registry.capable(dot_fp8.needs, torch.device("cpu")):  # float8's few-row dot products first
        first["fp8"] = max(first["fp8"], cpu_fp8_dot.FP8_DPBF16_MAX_ROWS + 1)
    for name, (fmt, w) in weights.items():
        if name == "int8 dynamic" and DOT:
            continue  # the integer rows of the avx512 build, above these: test_cpu_int8dyn.py
        rows = first[fmt]

        def chosen(m, dtype=torch.bfloat16, w=w):
            return select_kernel("linear", torch.randn(2, m, 256, dtype=dtype), w).name

        assert chosen((rows + 1) // 2) == ROW[fmt], name  # rows counted over every leading dimension
        assert chosen(rows // 2 - 1) != ROW[fmt], name
        for dtype in (torch.float32, torch.float16):  # the tiles and the dot products multiply bf16 only
            assert chosen(rows, dtype) != ROW[fmt], name
    # Shapes the panels do not take: N or K not a multiple of 32.
    odd = Int8Tensor.from_float(torch.randn(48, 256))
    assert select_kernel("linear", torch.randn(64, 256, dtype=torch.bfloat16), odd).name != ROW["int8"]
    w = Int8Tensor.from_float(torch.randn(64, 256))
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    try:
        if AMX:
            # Without AMX (taken away by HF_AOQ_CPU_ISA), the AMX rows never run; the AVX512-BF16
            # rows run in their place.
            monkeypatch.setenv("HF_AOQ_CPU_ISA", "avx512")
            registry.forget_capabilities()
            assert select_kernel("linear", x, Int8Tensor.from_float(torch.randn(64, 256))).name == "cpu_int8_avx512bf16"
        # Without a native bf16 GEMM (neither AMX nor AVX512-BF16), neither engine's rows run.
        monkeypatch.setattr(cpu_isa, "bf16_gemm_isa", lambda: None)
        monkeypatch.setattr(cpu_isa, "amx_bf16_allowed", lambda: False)
        registry.forget_capabilities()
        assert select_kernel("linear", x, w).name not in ("cpu_int8_amx", "cpu_int8_avx512bf16")
    finally:
        monkeypatch.undo()
        registry.forget_capabilities()


@needs_table_engine
def test_f_linear_runs_them_eagerly_and_compiled():
    torch.manual_seed(4)
    w = Int4Tensor.from_float(torch.randn(96, 256, dtype=torch.bfloat16), 64).place()
    bias = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(3, 40, 256, dtype=torch.bfloat16)
    assert select_kernel("linear", x, w).name == ROW["int4"]
    eager = F.linear(x, w, bias)
    assert eager.shape == (3, 40, 96)
    torch.testing.assert_close(eager, _run("int4", x, w, bias, tiles=TABLE_ENGINE == "amx"))
    compiled = torch.compile(lambda x: F.linear(x, w, bias), fullgraph=True)(x)
    assert torch.equal(compiled, eager)
