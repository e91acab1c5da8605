"""Int8 weights with dynamic int8 activations in exact integer sums (kernels/cpu_int8dyn.py,
csrc/int8dyn.cpp), on each engine this machine has: AMX's int8 tiles, and AVX-512 VNNI's dot
products (a GEMV and the panel loop). Every engine must return, bit for bit, the reference's
activation codes and scales multiplied exactly and scaled in float32, so the engines agree with each
other and a row's outputs do not depend on the other rows; the outputs agree with the reference
kernel within its bf16 roundings; the kernel table takes each row only where it applies. Each engine
is skipped, saying why, where the CPU (or OS, or build) does not allow it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_aoq import Int8Tensor
from hf_aoq.kernels import cpu_ext, cpu_int8dyn, cpu_isa, registry, select_kernel
from hf_aoq.kernels.reference import reference_linear

_HERE = f"({cpu_isa.describe()['flags']}, extension {cpu_ext.chosen_isa()})"
AMX_INT8 = (cpu_isa.amx_int8_allowed() and cpu_ext.available() and cpu_ext.load().amx_available())
# The VNNI engine runs wherever the avx512 build does (AVX-512 VNNI is one of its flags).
VNNI = cpu_isa.avx512_allowed() and cpu_ext.available() and cpu_ext.chosen_isa() == "avx512"
needs_amx_int8 = pytest.mark.skipif(not AMX_INT8, reason=f"this CPU grants no AMX-INT8 {_HERE}: the tiles are skipped")
needs_vnni = pytest.mark.skipif(not VNNI, reason=f"no avx512 build here {_HERE}: the VNNI engine is skipped")

GEMV_ROWS = cpu_int8dyn.INT8DYN_VNNI_GEMV_MAX_ROWS


def _expected(x: torch.Tensor, w: Int8Tensor, bias) -> torch.Tensor:
    """What every engine must return bit for bit: the reference's activation codes and scales
    (quantize_input), exact integer sums, then float32 (sum x row scale) x weight scale (+ bias)
    and one rounding to x's dtype."""
    codes, sx = w.quantize_input(x.reshape(-1, x.shape[-1]))
    sums = codes.long() @ w.qdata.long().t()
    y = (sums.float() * sx) * w.scale.reshape(-1).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def _tiles(x, w, bias):
    return cpu_int8dyn.int8dyn_amx(x, w, bias)


def _gemv(x, w, bias):  # the VNNI GEMV at any rows
    return cpu_int8dyn._apply(x, w.qdata.shape[1], cpu_int8dyn.int8dyn_vnni_linear, w.qdata, w.scale, bias, 1 << 20)


def _dots(x, w, bias):  # the VNNI panel loop at any rows
    return cpu_int8dyn._apply(x, w.qdata.shape[1], cpu_int8dyn.int8dyn_vnni_linear, w.qdata, w.scale, bias, 0)


ENGINES = [
    pytest.param(_tiles, id="amx", marks=needs_amx_int8),
    pytest.param(_gemv, id="vnni-gemv", marks=needs_vnni),
    pytest.param(_dots, id="vnni-dots", marks=needs_vnni),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k", [(1, 128), (3, 64), (33, 384), (300, 8192), (9, 131072)])
def test_the_reference_codes_summed_exactly(engine, dtype, rows, k):
    # 300 rows x 8192: a chunk of 256 rows and one of 44, and k in chunks (2 MB of codes at 256
    # rows), the int32 sums carried across them; 9 rows x 131072 (the widest the kernels take): a
    # half block (rows 16-31 not multiplied) with k in chunks; an outlier channel, so rows' scales
    # differ.
    torch.manual_seed(rows)
    w = Int8Tensor.from_float(torch.randn(96, k) * 0.05, act_quant="per_token")
    x = torch.randn(rows, k, dtype=dtype)
    x[: rows // 2, 5] *= 40
    bias = torch.randn(96, dtype=dtype)
    for b in (None, bias):
        y = engine(x, w, b)
        assert y.dtype == dtype and y.shape == (rows, 96)
        assert torch.equal(y, _expected(x, w, b))


@needs_vnni
def test_extreme_codes_and_wrapping_sums():
    # Every weight code -127 or 127 (w + 128: 1 or 255) and every activation code +-127, rows all
    # of one sign, at the widest k taken: sums of +-127 x 127 x k, within int32, whose VPDPBUSD
    # form (127 x 255 x k before the row's 128 x code sum comes off) is not: it wraps and comes back.
    k = cpu_int8dyn.INT8DYN_MAX_K
    assert 127 * 255 * k > 2**31 - 1 >= 127 * 127 * k
    torch.manual_seed(6)
    q = torch.where(torch.rand(64, k) < 0.5, -127, 127).to(torch.int8)
    q[:2] = 127
    w = Int8Tensor(q, torch.full((64, 1), 0.01), (1, k), (64, k), torch.float32, act_quant="per_token")
    x = torch.where(torch.rand(5, k) < 0.5, -1.0, 1.0)
    x[0] = 1.0
    x[1] = -1.0
    y = _expected(x, w, None)
    for engine in (_gemv, _dots):
        assert torch.equal(engine(x, w, None), y)


@pytest.mark.parametrize("engine", ENGINES)
def test_non_finite_rows_stay_in_their_row(engine):
    # A row holding a NaN has a NaN scale, so NaN outputs, as the reference's; an infinite row
    # gets an infinite scale. Neither touches the other rows.
    torch.manual_seed(2)
    w = Int8Tensor.from_float(torch.randn(64, 256) * 0.05, act_quant="per_token")
    x = torch.randn(6, 256, dtype=torch.bfloat16)
    x[1, 7] = float("nan")
    x[4, 9] = float("inf")
    y = engine(x, w, None)
    assert y[1].isnan().all()
    finite = [0, 2, 3, 5]
    assert torch.equal(y[finite], _expected(x[finite], w, None))


@needs_vnni
def test_rows_do_not_depend_on_the_batch():
    # Each row alone (the GEMV at one row), in batches across the GEMV's last row, and through the
    # panel loop (full and half blocks of 32 rows): the same bits.
    torch.manual_seed(3)
    w = Int8Tensor.from_float(torch.randn(96, 512) * 0.05, act_quant="per_token")
    x = torch.randn(70, 512, dtype=torch.bfloat16)
    alone = torch.cat([_gemv(x[i:i + 1], w, None) for i in range(70)])
    assert torch.equal(alone, _expected(x, w, None))
    for m in (2, 5, GEMV_ROWS, GEMV_ROWS + 1, 17, 70):
        assert torch.equal(cpu_int8dyn.int8dyn_vnni(x[:m], w, None), alone[:m]), m
        assert torch.equal(_dots(x[:m], w, None), alone[:m]), m


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("rows", [1, 16, 257])
def test_outputs_agree_with_the_reference_kernel(engine, rows):
    # The reference rounds the dequantized activations and weight to bf16 before its float32 sums:
    # within a few bf16 roundings of the output.
    torch.manual_seed(rows)
    w = Int8Tensor.from_float(torch.randn(128, 512) * 0.05, act_quant="per_token")
    x = torch.randn(2, rows, 512, dtype=torch.bfloat16)
    bias = torch.randn(128, dtype=torch.bfloat16)
    y, ref = engine(x, w, bias), reference_linear(x, w, bias)
    assert y.shape == ref.shape == (2, rows, 128)
    scale = ref.float().abs().mean()
    assert ((y.float() - ref.float()).abs() <= 2 ** -6 * (ref.float().abs() + scale)).all()


@needs_vnni
def test_scratch_kept_between_calls_leaks_nothing():
    # The panel loop keeps its x blocks, panel and sums per thread between calls, not zero-filled
    # (amx_gemm.h AmxBuffer): a small call gives the same bits before and after larger ones.
    torch.manual_seed(4)
    w = Int8Tensor.from_float(torch.randn(64, 384) * 0.05, act_quant="per_token")
    x = torch.randn(40, 384, dtype=torch.bfloat16)
    before = _dots(x, w, None)
    big = Int8Tensor.from_float(torch.randn(64, 8192), act_quant="per_token")
    _dots(torch.randn(300, 8192) * 100, big, None)
    assert torch.equal(_dots(x, w, None), before)
    assert torch.equal(before, _expected(x, w, None))


@needs_vnni
def test_shapes_it_does_not_take_are_refused_by_name():
    w = Int8Tensor.from_float(torch.randn(64, 160), act_quant="per_token")
    with pytest.raises(RuntimeError, match="N a multiple of 32 and K of 64, got 64 x 160"):
        cpu_ext.load().int8dyn_vnni_linear(torch.randn(2, 160), w.qdata, w.scale, None, 24)
    w = Int8Tensor.from_float(torch.randn(64, 256), act_quant="per_token")
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        cpu_ext.load().int8dyn_vnni_linear(torch.randn(2, 256, dtype=torch.float64), w.qdata, w.scale, None, 24)
    with pytest.raises(RuntimeError, match=r"x: \[M, 256\] with contiguous rows"):
        cpu_ext.load().int8dyn_vnni_linear(torch.randn(256, 2).t(), w.qdata, w.scale, None, 24)
    # Wider than int32 sums surely hold: refused, and the table's row does not take it.
    k = cpu_int8dyn.INT8DYN_MAX_K + 64
    wide = Int8Tensor(torch.ones(32, k, dtype=torch.int8), torch.ones(32, 1), (1, k), (32, k), torch.float32,
                      act_quant="per_token")
    with pytest.raises(RuntimeError, match=f"K up to 131072 .* got {k}"):
        cpu_ext.load().int8dyn_vnni_linear(torch.randn(1, k), wide.qdata, wide.scale, None, 24)
    assert select_kernel("linear", torch.randn(1, k), wide).name not in ("cpu_int8dyn_vnni", "cpu_int8dyn_amx")


@pytest.mark.parametrize("engine", ENGINES)
def test_no_rows(engine):
    w = Int8Tensor.from_float(torch.randn(64, 256), act_quant="per_token")
    y = engine(torch.randn(0, 256, dtype=torch.bfloat16), w, None)
    assert y.shape == (0, 64) and y.dtype == torch.bfloat16


def _table_rows(dtype=torch.bfloat16):
    dyn = Int8Tensor.from_float(torch.randn(64, 256), act_quant="per_token")
    return {m: select_kernel("linear", torch.randn(1, m, 256, dtype=dtype), dyn).name for m in (1, 3, 4, 40, 300)}


@needs_vnni
def test_the_table_takes_the_integer_rows(monkeypatch):
    tiles = cpu_int8dyn.INT8DYN_MIN_ROWS if AMX_INT8 else 1 << 30
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for m, name in _table_rows(dtype).items():
            assert name == ("cpu_int8dyn_amx" if m >= tiles else "cpu_int8dyn_vnni"), (m, dtype)
    # Weight-only int8, K not a multiple of 64, N not of 32, or an input whose last dimension is
    # strided: other rows.
    vnni = ("cpu_int8dyn_vnni", "cpu_int8dyn_amx")
    assert select_kernel("linear", torch.randn(2, 256), Int8Tensor.from_float(torch.randn(64, 256))).name not in vnni
    odd_k = Int8Tensor.from_float(torch.randn(64, 160), act_quant="per_token")
    assert select_kernel("linear", torch.randn(2, 160), odd_k).name not in vnni
    odd_n = Int8Tensor.from_float(torch.randn(48, 256), act_quant="per_token")
    assert select_kernel("linear", torch.randn(2, 256), odd_n).name not in vnni
    dyn = Int8Tensor.from_float(torch.randn(64, 256), act_quant="per_token")
    assert select_kernel("linear", torch.randn(4, 512)[:, ::2], dyn).name not in vnni
    # The AVX2 build (HF_AOQ_CPU_ISA=avx2) has neither: the float32 path of the reference's numbers.
    monkeypatch.setenv("HF_AOQ_CPU_ISA", "avx2")
    registry.forget_capabilities()
    try:
        assert set(_table_rows().values()) <= {"cpu_int8_ext", "cpu_int8pack_mm", "reference"}
    finally:
        monkeypatch.undo()
        registry.forget_capabilities()


@needs_amx_int8
def test_without_amx_the_vnni_row_takes_every_row(monkeypatch):
    monkeypatch.setenv("HF_AOQ_CPU_ISA", "avx512")
    registry.forget_capabilities()
    try:
        assert set(_table_rows().values()) == {"cpu_int8dyn_vnni"}
    finally:
        monkeypatch.undo()
        registry.forget_capabilities()


@pytest.mark.skipif(not (VNNI or AMX_INT8), reason=f"neither integer engine runs here {_HERE}")
@pytest.mark.parametrize("rows", [1, 40])
def test_f_linear_runs_them_eagerly_and_compiled(rows):
    torch.manual_seed(5)
    w = Int8Tensor.from_float(torch.randn(96, 256), act_quant="per_token")
    bias = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(3, rows, 256, dtype=torch.bfloat16)
    assert select_kernel("linear", x, w).name in ("cpu_int8dyn_vnni", "cpu_int8dyn_amx")
    eager = F.linear(x, w, bias)
    assert torch.equal(eager, _expected(x, w, bias))
    compiled = torch.compile(lambda x: F.linear(x, w, bias), fullgraph=True)(x)
    assert torch.equal(compiled, eager)
