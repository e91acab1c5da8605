"""The CPU kernels and packings (kernels/cpu.py): hf_aoq's own C++ kernels (csrc/) against the
reference, on both of their paths (GEMV at few rows, dequantize + GEMM at many) and on the
shapes their blocking treats apart; the packings' round trips; aten's kernels on awkward inputs.
tests/kernels/test_no_cpu_ext.py runs this module again without the extension."""
import pytest
import torch
import torch.nn.functional as F

from hf_aoq import (
    Float8WeightOnlyConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8Tensor,
    Int8WeightOnlyConfig,
    kernels,
)
from hf_aoq.kernels import cpu, cpu_ext

from conftest import cpu_int4_packing, int16_activation_linear, sqnr

needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's CPU extension is not built here")


def int4pack_linear(x2, packed, scale_zero, g, int16_activations):
    """hf_aoq's int4 C++ kernel on float32 rows x2, with the library's crossover."""
    return cpu_ext.load().int4pack_linear(x2, packed, scale_zero, g, cpu.INT4_GEMV_MAX_ROWS, int16_activations)


def rel_err(expected, got):
    return float((expected.float() - got.float()).norm() / expected.float().norm())


def test_avx2_layout_model_matches_aten_where_it_applies():
    if not cpu._int4_layout_matches():
        pytest.skip("this torch does not pack int4 in the AVX2 layout")
    # Two full 32-row blocks and a 16-row tail, several groups.
    codes = torch.randint(0, 16, (80, 256), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    packed = cpu._aten_int4pack(codes)
    assert torch.equal(packed.reshape(-1), cpu.avx2_int4pack_bytes(codes))
    # The packing uses the model: the same bytes, shape and dtype as aten's.
    ours = cpu._int4pack_codes(codes)
    assert ours.dtype == packed.dtype and ours.shape == packed.shape and torch.equal(ours, packed)


ROWS = [1, 2, 3, cpu.INT4_GEMV_MAX_ROWS, cpu.INT4_GEMV_MAX_ROWS + 1, 130]


@needs_ext
@pytest.mark.parametrize("n,k,g", [(64, 256, 32), (80, 384, 128), (48, 512, 256), (16, 128, 64)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_kernel_float32_matches_reference(n, k, g, scale_dtype):
    """Float32 weights and activations: the kernel computes what the reference computes, up to
    float32 summation order, on both paths, with 32-row blocks and a 16-row tail."""
    torch.manual_seed(0)
    q = Int4Tensor.from_float(torch.randn(n, k, dtype=scale_dtype), g).place()
    assert q.packing == "cpu_int4_pairs"
    w = q.dequantize(torch.float32)
    kernel = next(kn for kn in kernels.kernels_for("linear", "Int4Tensor") if kn.name == "cpu_int4_ext")
    bias = torch.randn(n)
    for m in ROWS:
        x = torch.randn(m, k)
        assert kernels.select_kernel("linear", x, q) is kernel
        expected = F.linear(x, w, bias)
        assert rel_err(expected, kernel.fn(x, q, bias)) < 1e-5, m


@needs_ext
@pytest.mark.parametrize("n,k,g", [(64, 256, 32), (80, 384, 128), (48, 512, 256), (16, 128, 64)])
def test_int4_kernel_through_int16_activation_codes(n, k, g):
    """Half-precision activations, any number of rows: the kernel computes with int16 activation
    codes (int4_pairs.h), on 32-row blocks (vector code) and 16-row ones (scalar code), one row and
    row pairs. It gives what the definition gives, up to float32 rounding, and stays within the
    stated tolerance of the exact product: half a code step per activation times |w|. A row's
    result does not depend on the rows computed with it."""
    torch.manual_seed(0)
    q = Int4Tensor.from_float(torch.randn(n, k), g).place()
    w = q.dequantize(torch.float32)
    for m in (1, 2, 3, 5, cpu.INT4_GEMV_MAX_ROWS + 1, 130):
        x = torch.randn(m, k).bfloat16().float()
        x[0, :g] *= 100  # an outlier group: the steps are per group, the other groups keep theirs
        got = int4pack_linear(x, q.qdata, q.scale, g, True)
        expected, bound = int16_activation_linear(x, w, g)
        assert rel_err(expected, got) < 1e-6, m
        exact = x.double() @ w.double().t()
        assert ((got - exact).abs() <= bound + 1e-6 * exact.abs().max()).all(), m
        assert torch.equal(int4pack_linear(x[-1:], q.qdata, q.scale, g, True), got[-1:]), m
        # Float32 activations take the float32 paths: closer than the int16 codes allow.
        assert rel_err(exact, int4pack_linear(x, q.qdata, q.scale, g, False)) < 1e-6 < rel_err(exact, got), m


@needs_ext
def test_int4_int16_path_keeps_non_finite_inputs_non_finite():
    """A NaN or inf among the activations cannot become a code: that row's outputs are NaN, as
    the reference's would be non-finite, and the other rows are untouched."""
    torch.manual_seed(0)
    for n in (32, 16):  # vector and scalar code
        q = Int4Tensor.from_float(torch.randn(n, 128), 32).place()
        for bad in (float("nan"), float("inf"), -float("inf")):
            x = torch.randn(3, 128)
            x[1, 40] = bad
            got = int4pack_linear(x, q.qdata, q.scale, 32, True)
            assert got[1].isnan().all() and torch.isfinite(got[[0, 2]]).all(), (n, bad)
            clean = int4pack_linear(x[[0, 2]], q.qdata, q.scale, 32, True)
            assert torch.equal(got[[0, 2]], clean)


@needs_ext
def test_int4_gemm_path_dequantizes_exactly_as_the_reference():
    """Fed the identity (float32 activations), the many-rows path returns its float32 dequantized weight: bit for bit
    the reference's (a separate multiply and add, no FMA contraction)."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = Int4Tensor.from_float(torch.randn(48, 256, dtype=dtype), 64).place()
        eye = torch.eye(256)
        got = int4pack_linear(eye, q.qdata, q.scale, 64, False)
        assert torch.equal(got.t(), q.dequantize(torch.float32))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_kernel_half_activations(dtype):
    torch.manual_seed(0)
    q = Int4Tensor.from_float(torch.randn(96, 256, dtype=dtype), 128).place()
    for m in (1, 5, 100):
        x = torch.randn(2, m, 256, dtype=dtype)
        y = F.linear(x, q)
        assert y.dtype == dtype and y.shape == (2, m, 96)
        expected = kernels.kernels_for("linear", "Int4Tensor")[-1].fn(x, q, None)
        # The reference rounds the weight and the products to `dtype`; the kernel does not.
        assert sqnr(expected, y) > 40


@needs_ext
@pytest.mark.parametrize("k", [100, 256, 1000])
@pytest.mark.parametrize("act_quant", [None, "per_token"])
@pytest.mark.parametrize("n", [40, 42])  # four weight rows at a time at batch 1, and a tail
def test_int8_kernel_matches_reference(k, act_quant, n):
    torch.manual_seed(0)
    q = Int8Tensor.from_float(torch.randn(n, k), act_quant=act_quant)
    kernel = next(kn for kn in kernels.kernels_for("linear", "Int8Tensor") if kn.name == "cpu_int8_ext")
    reference = kernels.kernels_for("linear", "Int8Tensor")[-1]
    bias = torch.randn(n)
    for m in (1, 2, 3, cpu.INT8_GEMV_MAX_ROWS, cpu.INT8_GEMV_MAX_ROWS + 1, 70):
        x = torch.randn(m, k)
        assert kernels.select_kernel("linear", x, q) is kernel
        assert rel_err(reference.fn(x, q, bias), kernel.fn(x, q, bias)) < 1e-5, m
        xb = x.bfloat16()
        assert sqnr(reference.fn(xb, q, bias.bfloat16()), kernel.fn(xb, q, bias.bfloat16())) > 40, m


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_dynamic_activations_fake_quantized_in_cpp_as_in_python(dtype):
    """cpu_int8_ext quantizes dynamic activations inside its C++ call (int8dyn_linear_io): the
    numbers of Int8Tensor.simulate_input_quantization followed by the weight-only kernel, bit for
    bit, at every row count, with an outlier channel and with NaN / inf rows."""
    torch.manual_seed(0)
    q = Int8Tensor.from_float(torch.randn(42, 200), act_quant="per_token")
    ext = cpu_ext.load()
    for m in (1, 3, cpu.INT8_GEMV_MAX_ROWS + 1):
        x = torch.randn(m, 200).to(dtype)
        x[0, 7] *= 60
        bias = torch.randn(42).to(dtype)
        for b in (None, bias):
            got = cpu.int8_ext_linear(x, q, b)
            want = ext.int8_linear_io(q.simulate_input_quantization(x), q.qdata, q.scale, b, cpu.INT8_GEMV_MAX_ROWS)
            assert torch.equal(got, want), (m, dtype)
    x = torch.randn(3, 200).to(dtype)
    x[1, 5], x[2, 9] = float("nan"), float("inf")
    y = cpu.int8_ext_linear(x, q, None)
    assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).all()
    assert torch.equal(y[0], cpu.int8_ext_linear(x[:1], q, None)[0])


@needs_ext
def test_int8_kernel_through_a_transposed_weight():
    """`x @ w.t()` reaches the kernel through the transposed view, which is contiguous again."""
    torch.manual_seed(0)
    q = Int8Tensor.from_float(torch.randn(32, 64))
    x = torch.randn(3, 64)
    assert rel_err(x @ q.dequantize().t(), x @ q.t()) < 1e-5


@needs_ext
@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_many_rows_path_dequantizes_exactly_as_the_reference(f8):
    """Fed the identity, the many-rows path returns the reference's float32 dequantized weight
    bit for bit, subnormal codes included; and large scales do not overflow."""
    from hf_aoq import Float8Tensor

    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.logspace(-10, 0, 96)  # small columns: subnormal float8 codes
    w[0] *= 1e6  # a row scale far above 2^8
    q = Float8Tensor.from_float(w, f8)
    assert (q.qdata.view(torch.uint8) & 0x7F < (8 if f8 == torch.float8_e4m3fn else 4)).any()
    shift = cpu._FP8_SHIFT[f8]
    got = cpu_ext.load().fp8_dequant_linear(torch.eye(96), q.qdata.view(torch.uint8), q.scale.reshape(-1).contiguous(), shift)
    assert torch.equal(got.t(), q.dequantize(torch.float32))
    x = torch.randn(cpu.FP8_GEMV_MAX_ROWS + 5, 96)
    assert rel_err(F.linear(x, q.dequantize(torch.float32)), F.linear(x, q)) < 1e-5


@needs_ext
@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("k", [100, 512])
def test_fp8_gemv_every_row_blocking(f8, k):
    """The few-rows kernel blocks 1, 2, 3 and 4 activation rows differently, and one activation
    row four weight rows at a time; K = 100 leaves column tails, N = 46 row tails."""
    from hf_aoq import Float8Tensor

    torch.manual_seed(0)
    for n in (48, 46):
        q = Float8Tensor.from_float(torch.randn(n, k), f8)
        w = q.dequantize(torch.float32)
        for m in (1, 2, 3, 4, 5, 7, cpu.FP8_GEMV_MAX_ROWS):
            x = torch.randn(m, k)
            assert rel_err(F.linear(x, w), F.linear(x, q)) < 1e-5, (n, m)


@needs_ext
@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_gemv_large_scales_stay_finite(f8):
    """The GEMV undoes its bit trick with a factor 2^120 (e4m3) or 2^112 (e5m2); times a row
    scale above 2^8 (2^16) that whole factor is infinite in float32. Such scales must still work."""
    from hf_aoq import Float8Tensor

    torch.manual_seed(0)
    magnitude, overflowing_scale = {torch.float8_e4m3fn: (1e6, 2.0**8), torch.float8_e5m2: (1e10, 2.0**16)}[f8]
    q = Float8Tensor.from_float(torch.randn(32, 64) * magnitude, f8)
    assert float(q.scale.max()) > overflowing_scale
    w = q.dequantize(torch.float32)
    for m in (1, cpu.FP8_GEMV_MAX_ROWS + 1):
        x = torch.randn(m, 64)
        got = F.linear(x, q)
        assert torch.isfinite(got).all() and rel_err(F.linear(x, w), got) < 1e-5, m


def test_avx2_unpack_inverts_the_packing():
    for n in (16, 32, 48, 80):
        codes = torch.randint(0, 16, (n, 64), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
        packed = cpu.avx2_int4pack_bytes(codes)
        assert torch.equal(cpu.avx2_int4unpack_codes(packed, n, 64), codes)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_call_eager_path_equals_the_composed_ops(dtype, with_bias, monkeypatch):
    """Eager calls go straight to the C++ entry point (input conversion, padding, bias and output
    cast in one call); torch.compile sees it as an opaque custom op (registry.OpaqueOp), called
    here as a compiled graph calls it. Both must give the same bits."""
    torch.manual_seed(0)
    from hf_aoq import Float8Tensor

    q4 = Int4Tensor.from_float(torch.randn(64, 576, dtype=dtype), 128).place()  # a partial last group
    q8 = Int8Tensor.from_float(torch.randn(64, 576, dtype=dtype))
    f8 = Float8Tensor.from_float(torch.randn(64, 576, dtype=dtype))
    bias = torch.randn(64, dtype=dtype) if with_bias else None
    for q, name in ((q4, "cpu_int4_ext"), (q8, "cpu_int8_ext"), (f8, "cpu_fp8_gemv")):
        kernel = next(kn for kn in kernels.kernels_for("linear", type(q).__name__) if kn.name == name)
        for shape in ((1, 576), (2, 3, 576), (70, 576)):
            x = torch.randn(*shape, dtype=dtype)
            eager = kernel.fn(x, q, bias)
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
            composed = kernel.fn(x, q, bias)
            monkeypatch.undo()
            assert eager.dtype == dtype and eager.shape == (*shape[:-1], 64)
            assert torch.equal(eager, composed), (name, shape)


def test_pairs_unpack_inverts_the_packing():
    for n in (16, 32, 48, 80):
        codes = torch.randint(0, 16, (n, 64), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
        packed = cpu.pairs_int4pack_bytes(codes)
        assert packed.numel() == n * 32
        assert torch.equal(cpu.pairs_int4unpack_codes(packed, n, 64), codes)


def test_pairs_layout_puts_each_code_where_the_kernels_read_it():
    """The layout from its definition, code by code: in a block of R rows and column pair j, the
    16-bit word 2i + p holds column 2j + p, with row R/4 * t + i in nibble t."""
    n, k = 48, 6  # a 32-row block and a 16-row one, three column pairs
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    words = cpu.pairs_int4pack_bytes(codes).view(torch.int16).to(torch.int32) & 0xFFFF
    at = 0
    for n0, rows in ((0, 32), (32, 16)):
        lanes = rows // 4
        for j in range(k // 2):
            for w in range(rows // 2):
                i, p = divmod(w, 2)
                for t in range(4):
                    assert (int(words[at]) >> (4 * t)) & 15 == int(codes[n0 + lanes * t + i, 2 * j + p])
                at += 1
    assert at == words.numel()


@needs_ext
@pytest.mark.parametrize("n,k,g", [(64, 256, 32), (48, 576, 128), (16, 130, 64)])
def test_repacking_from_canonical_bytes_matches_the_torch_packing(n, k, g):
    """Placing an int4 weight repacks its canonical bytes in C++; the bytes must be those of
    unpacking to codes, padding with code 8 and packing with torch ops (16-row tails and
    partial last groups included), and unplacing must give the canonical tensor back."""
    from hf_aoq.core.primitives import unpack_int4
    from hf_aoq.kernels.common import int4_padded_k, pad_int4_codes

    torch.manual_seed(0)
    q = Int4Tensor.from_float(torch.randn(n, k), g)
    padded_k = int4_padded_k(q)
    expected = cpu.pairs_int4pack_bytes(pad_int4_codes(unpack_int4(q.qdata), padded_k))
    got = cpu_ext.load().int4_repack_pairs(q.qdata, padded_k)
    assert got.shape == (n, padded_k // 2) and torch.equal(got.reshape(-1), expected)
    placed = q.place()
    assert placed.packing == "cpu_int4_pairs" and torch.equal(placed.qdata, got)
    back = placed.to_canonical()
    assert torch.equal(back.qdata, q.qdata) and torch.equal(back.scale, q.scale) and torch.equal(back.zero, q.zero)


@needs_ext
@pytest.mark.parametrize("kind", ["int4", "int4dq", "int8", "fp8"])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_many_rows_path_over_many_chunks_and_threads(kind, mode):
    """The many-rows path splits the output columns into chunks that threads dequantize and
    multiply on their own (dequant_gemm.cpp): several chunks and a partial last one (with an
    int4 16-row tail block here), two threads, and the caller's inference mode carried into the
    workers (a worker without it cannot write an inference tensor)."""
    from hf_aoq import Float8Tensor, Int4DQTensor

    torch.manual_seed(0)
    n, k = 3 * 256 + 48, 1024  # 256 output columns per chunk at K = 1024
    w = torch.randn(n, k)
    q = {
        "int4": lambda: Int4Tensor.from_float(w, 128),
        "int4dq": lambda: Int4DQTensor.from_float(w, 32),
        "int8": lambda: Int8Tensor.from_float(w),
        "fp8": lambda: Float8Tensor.from_float(w, torch.float8_e4m3fn),
    }[kind]().place()
    ref = q.dequantize(torch.float32)
    x = torch.randn(40, k)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with getattr(torch, mode)():
            got = F.linear(x, q)
            expected = F.linear(x, ref)
    finally:
        torch.set_num_threads(threads)
    assert kernels.select_kernel("linear", x, q).name != "reference"
    assert rel_err(expected, got) < 1e-5


def test_int4_cpu_packing_roundtrip_is_exact():
    torch.manual_seed(0)
    for shape, g, sym in [((64, 256), 32, False), ((48, 128), 128, True), ((16, 512), 256, False)]:
        canonical = Int4Tensor.from_float(torch.randn(*shape, dtype=torch.bfloat16), g, sym)
        assert canonical.place().packing == cpu_int4_packing()
        # Both CPU packings, whichever place() picks: aten's is the fallback without the extension.
        for packing in {cpu_int4_packing(), "cpu_int4pack"}:
            packed = kernels.get_packing(packing).pack(canonical)
            assert packed.packing == packing
            back = packed.to_canonical()
            assert back.packing is None
            for name, t in canonical.tensor_fields().items():
                assert torch.equal(t, getattr(back, name)), (packing, name)
            assert torch.equal(packed.dequantize(), canonical.dequantize())


@needs_ext
@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cpu_kernel_decodes_every_code_exactly(f8):
    from hf_aoq.kernels.cpu import _FP8_SHIFT

    fp8_linear_cpu = cpu_ext.load().fp8_linear

    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(f8).float()
    finite = torch.isfinite(values)  # NaN/inf codes: never written, refused by the loader (format.md)
    shift = _FP8_SHIFT[f8]
    # K = 1: each output is one decoded code; subnormal codes included.
    y = fp8_linear_cpu(torch.ones(1, 1), codes.view(256, 1), torch.ones(256), shift)
    assert torch.equal(y[0][finite], values[finite])
    # A long row exercises the vectorized loop and its tail.
    torch.manual_seed(0)
    row = codes[finite].repeat(3)[:517].reshape(1, -1).contiguous()
    x = torch.randn(5, row.shape[1])
    got = fp8_linear_cpu(x, row, torch.ones(1), shift)
    assert torch.allclose(got, x @ row.view(f8).float().t(), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig(),
                                    Float8WeightOnlyConfig()])
def test_unaligned_activation(config):
    # A view at an odd address, as from a tensor read out of a file: aten's int8 CPU kernel
    # crashed on these before hf_aoq realigned its input.
    q = config.quantize_weight(torch.randn(32, 64, dtype=torch.bfloat16)).place()
    x = torch.randn(193, dtype=torch.bfloat16)[1:].view(3, 64)
    assert x.data_ptr() % 4
    assert torch.allclose(F.linear(x, q).float(), F.linear(x.clone(), q).float())


def assert_elementwise_close(x, w, got):
    """Each output element within float32 accumulation error of the float64 product: K * 2^-23
    times sum |x| |w|, so any element computed from wrong rows or columns (a tile's tail) fails."""
    x64, w64 = x.double(), w.double()
    bound = x.shape[1] * 2.0 ** -23 * (x64.abs() @ w64.abs().t())
    err = (got.double() - x64 @ w64.t()).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@needs_ext
@pytest.mark.parametrize("kind", ["int8", torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("n,k", [(48, 512), (45, 100), (46, 527), (47, 7), (44, 33)])
def test_int8_fp8_gemv_every_row_count(kind, n, k):
    """The few-rows kernels tile four weight rows by up to four activation rows: every row count
    1..20 on the GEMV itself (crossover out of the way), with row tails (N mod 4 = 1..3) and column
    tails (K below one vector, K mod 16 = 1..15), element by element against float64; and through
    F.linear with the library's crossovers."""
    from hf_aoq import Float8Tensor

    torch.manual_seed(0)
    w = torch.randn(n, k)
    ext = cpu_ext.load()
    if kind == "int8":
        q = Int8Tensor.from_float(w)
        scale = q.scale.reshape(-1).float().contiguous()
        gemv = lambda x: ext.int8_linear(x, q.qdata, scale, 1000, False)  # noqa: E731
    else:
        q = Float8Tensor.from_float(w, kind)
        scale = q.scale.reshape(-1).float().contiguous()
        gemv = lambda x: ext.fp8_linear(x, q.qdata.view(torch.uint8), scale, cpu._FP8_SHIFT[kind])  # noqa: E731
    wd = q.dequantize(torch.float32)
    for m in range(1, 21):
        x = torch.randn(m, k)
        assert_elementwise_close(x, wd, gemv(x))
        assert_elementwise_close(x, wd, F.linear(x, q))


def int8_code_group(k: int) -> int:
    """The int16 codes' group of the int8 GEMV (int8.cpp's int8_code_group): the largest of 256,
    128, 64 and 32 that divides K, 0 for none."""
    return next((g for g in (256, 128, 64, 32) if k % g == 0), 0)


@needs_ext
@pytest.mark.parametrize("n,k", [(48, 256), (45, 384), (102, 96), (8, 224), (3, 64)])
def test_int8_kernel_through_int16_activation_codes(n, k):
    """Half-precision activations at any number of rows meet the int8 codes as int16 codes
    (int8.cpp's int8_code_gemv, whatever the float32 GEMV's row limit): eight-row blocks at one
    row (four on AVX2); four-row blocks by row pairs on AVX-512, part blocks one row at a time
    (N = 45, 102, 3); on AVX2 blocks of 32 rows in two-by-two tiles, an odd last activation row
    and an odd last weight row alone; groups of 256, 128 and 32 columns. Each output is what the
    definition gives up to float32 rounding, within half a code step per activation times |w| of
    the exact product; a row's value does not depend on the rows computed with it; float32
    activations keep the float32 paths, closer to the exact product."""
    torch.manual_seed(0)
    q = Int8Tensor.from_float(torch.randn(n, k))
    scale = q.scale.reshape(-1).float().contiguous()
    w = q.dequantize(torch.float32)
    g = int8_code_group(k)
    ext = cpu_ext.load()
    for m in (1, 2, 3, 5, 12, 40, 41, 70):
        x = torch.randn(m, k).bfloat16().float()
        x[0, :g] *= 100  # an outlier group: the steps are per group, the other groups keep theirs
        got = ext.int8_linear(x, q.qdata, scale, 1000, True)
        assert torch.equal(ext.int8_linear(x, q.qdata, scale, 1, True), got), m  # no row limit
        expected, bound = int16_activation_linear(x, w, g)
        assert rel_err(expected, got) < 1e-6, m
        exact = x.double() @ w.double().t()
        assert ((got - exact).abs() <= bound + 1e-6 * exact.abs().max()).all(), m
        for i in range(m):
            assert torch.equal(ext.int8_linear(x[i:i + 1], q.qdata, scale, 1000, True), got[i:i + 1]), (m, i)
        assert rel_err(exact, ext.int8_linear(x, q.qdata, scale, 1000, False)) < 1e-6 < rel_err(exact, got), m


@needs_ext
def test_int8_int16_path_limits():
    """K not a multiple of 32 keeps the float32 paths (the same bits as asking for them: the GEMV,
    and above its row limit dequantize + GEMM); a NaN or inf activation makes its row's outputs NaN
    and leaves the other rows as they were."""
    torch.manual_seed(0)
    ext = cpu_ext.load()
    q = Int8Tensor.from_float(torch.randn(40, 200))
    scale = q.scale.reshape(-1).float().contiguous()
    x = torch.randn(3, 200).bfloat16().float()
    assert torch.equal(ext.int8_linear(x, q.qdata, scale, 1000, True), ext.int8_linear(x, q.qdata, scale, 1000, False))
    assert torch.equal(ext.int8_linear(x, q.qdata, scale, 2, True), ext.int8_linear(x, q.qdata, scale, 2, False))
    q = Int8Tensor.from_float(torch.randn(40, 128))
    scale = q.scale.reshape(-1).float().contiguous()
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(3, 128)
        x[1, 40] = bad
        got = ext.int8_linear(x, q.qdata, scale, 1000, True)
        assert got[1].isnan().all() and torch.isfinite(got[[0, 2]]).all(), bad
        assert torch.equal(got[[0, 2]], ext.int8_linear(x[[0, 2]], q.qdata, scale, 1000, True))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_half_precision_takes_the_int16_codes(dtype):
    """Through F.linear (the kernel table's cpu_int8_ext row) half-precision activations at batch
    1 and 4 get the int16-code GEMV's outputs, with the bias added in float32 and one rounding."""
    torch.manual_seed(0)
    q = Int8Tensor.from_float(torch.randn(64, 256))
    bias = torch.randn(64)
    ext = cpu_ext.load()
    for m in (1, 4):
        x = torch.randn(m, 256, dtype=dtype)
        assert kernels.select_kernel("linear", x, q).name == "cpu_int8_ext"
        codes = ext.int8_linear(x.float(), q.qdata, q.scale.reshape(-1).float().contiguous(), 1000, True)
        assert torch.equal(F.linear(x, q, bias.to(dtype)), (codes + bias.to(dtype).float()).to(dtype)), m


@needs_ext
@pytest.mark.parametrize("kind", ["int8", torch.float8_e4m3fn, torch.float8_e5m2])
def test_batch1_gemv_row_value_does_not_depend_on_its_row_block(kind):
    """At one activation row the int8 and float8 GEMVs run eight weight rows at a time on AVX-512
    (four on AVX2), four where fewer are left (csrc/simd.h dot_rows): a row's value must be the
    same bit for bit whichever block computed it. N = 44 ends in a block of four; K = 200 leaves a column tail; one thread,
    so that every row of the float8 kernel's single range is in a block."""
    from hf_aoq import Float8Tensor

    torch.manual_seed(0)
    w, x = torch.randn(44, 200), torch.randn(1, 200)
    ext = cpu_ext.load()

    def gemv(rows):
        if kind == "int8":
            q = Int8Tensor.from_float(rows)
            return ext.int8_linear(x, q.qdata, q.scale.reshape(-1).float().contiguous(), 1000, False)
        q = Float8Tensor.from_float(rows, kind)
        return ext.fp8_linear(x, q.qdata.view(torch.uint8), q.scale.reshape(-1).float().contiguous(),
                              cpu._FP8_SHIFT[kind])

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = gemv(w)
        for s in range(0, 44, 4):
            assert torch.equal(whole[:, s:s + 4], gemv(w[s:s + 4])), s
    finally:
        torch.set_num_threads(threads)
