"""CUDA kernels against the reference; skipped without a GPU (see conftest.py). The same paths
run on a CPU build in tests/kernels/test_cuda_contracts.py (shapes and contracts, no values)."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from hf_aoq import (
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    Int4DQWeightOnlyConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    PerTensor,
    kernels,
    quantize_,
)
from hf_aoq.kernels.tinygemm_layout import tinygemm_mm, tinygemm_pack, tinygemm_unpack

from conftest import cpu_int4_packing, sqnr

pytestmark = pytest.mark.cuda
E5M2 = torch.float8_e5m2

# (config, kernel on an sm90 GPU, the compute capability that kernel needs)
CASES = [
    (Int4WeightOnlyConfig(128), "cuda_tinygemm", (8, 0)),
    (Int4WeightOnlyConfig(32, symmetric=True), "cuda_tinygemm", (8, 0)),
    (Int8DynamicActivationInt8WeightConfig(), "cuda_int_mm", (7, 5)),
    (Float8DynamicActivationFloat8WeightConfig(), "cuda_scaled_mm_rowwise", (9, 0)),
    (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()), "cuda_scaled_mm", (8, 9)),
    (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor(), activation_dtype=E5M2), "cuda_scaled_mm",
     (8, 9)),
    (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor(), activation_dtype=E5M2, weight_dtype=E5M2),
     "reference", (0, 0)),
    (Int8WeightOnlyConfig(), "reference", (0, 0)),
    (Float8WeightOnlyConfig(), "reference", (0, 0)),
    (Int4DQWeightOnlyConfig(), "reference", (0, 0)),
]
IDS = [f"{type(c).__name__}-{i}" for i, (c, _, _) in enumerate(CASES)]


HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_ROWS = {"Int8Tensor": "triton_int8_gemv", "Float8Tensor": "triton_fp8_gemv", "Int4Tensor": "triton_int4_gemv"}


def _expected(kernel, q, rows):
    """The reference rows of weight-only int8 / float8 (and of int4 weights tinygemm cannot take)
    give way to hf_aoq's Triton GEMV at few rows where triton is installed."""
    from hf_aoq.kernels.triton_kernels import TRITON_GEMV_MAX_ROWS

    if kernel == "reference" and HAS_TRITON and rows <= TRITON_GEMV_MAX_ROWS and getattr(q, "act_quant", None) is None:
        return TRITON_ROWS.get(type(q).__name__, kernel)
    return kernel


def _needs(capability):
    if torch.cuda.get_device_capability() < capability:
        pytest.skip(f"needs compute capability {capability}")


@pytest.mark.parametrize("config,kernel,capability", CASES, ids=IDS)
@pytest.mark.parametrize("rows", [0, 1, 17, 512])
@pytest.mark.parametrize("k", [576, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_matches_reference(config, kernel, capability, rows, k, dtype):
    _needs(capability)
    torch.manual_seed(0)
    w = torch.randn(512, k, dtype=torch.bfloat16)
    bias = torch.randn(512, dtype=dtype, device="cuda")
    q = config.quantize_weight(w.cuda()).place()  # quantized on the GPU (moves: the tests below)
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    chosen = kernels.select_kernel("linear", x, q)
    assert chosen.name == _expected(kernel, q, rows)
    reference = kernels.kernels_for("linear", type(q).__name__)[-1]
    y = F.linear(x, q, bias)
    assert y.is_cuda and y.shape == (rows, 512) and y.dtype == dtype
    if rows:
        assert sqnr(reference.fn(x, q, bias), y) > 35
        assert sqnr(F.linear(x, w.to("cuda", dtype), bias), y) > 15


@pytest.mark.parametrize("config,kernel,capability", CASES[:6], ids=IDS[:6])
def test_3d_inputs_and_x_at_w_t(config, kernel, capability):
    _needs(capability)
    torch.manual_seed(0)
    w = torch.randn(256, 576, dtype=torch.bfloat16)
    q = config.quantize_weight(w).to("cuda").place()
    x = torch.randn(2, 9, 576, dtype=torch.bfloat16, device="cuda")
    y = F.linear(x, q)
    assert y.shape == (2, 9, 256)
    assert sqnr(F.linear(x, w.cuda()), y) > 15
    if getattr(type(q), "transposable", False):
        assert torch.equal(x @ q.t(), y)


def test_fallback_shapes_run_the_reference():
    """N not a multiple of 8 (tinygemm) or 16 (_scaled_mm), K not a multiple of 16."""
    torch.manual_seed(0)
    for config, shape in [(Int4WeightOnlyConfig(32), (20, 256)), (Int8DynamicActivationInt8WeightConfig(), (20, 100)),
                          (Float8DynamicActivationFloat8WeightConfig(), (24, 256)),
                          (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()), (32, 200))]:
        w = torch.randn(*shape, dtype=torch.bfloat16)
        q = config.quantize_weight(w).to("cuda").place()
        x = torch.randn(3, shape[1], dtype=torch.bfloat16, device="cuda")
        assert kernels.select_kernel("linear", x, q).name == _expected("reference", q, 3), (config, shape)
        assert sqnr(F.linear(x, w.cuda()), F.linear(x, q)) > 15


def test_transposed_float8_weight():
    """A weight stored [in, out] and used as x @ W: copied to a column-major mat2."""
    torch.manual_seed(0)
    w_kn = torch.randn(1024, 256, dtype=torch.bfloat16)
    q = Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()).quantize_weight(w_kn).to("cuda")
    x = torch.randn(5, 1024, dtype=torch.bfloat16, device="cuda")
    assert sqnr(x @ w_kn.cuda(), x @ q) > 15


def test_tinygemm_layout_is_the_transcription():
    """aten's CUDA int4 packing, bit for bit tinygemm_layout.py; its matmul, the transcription's."""
    torch.manual_seed(0)
    for n, k in [(64, 256), (256, 640), (48, 1024)]:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        for tiles in (2, 4, 8):
            if k % (tiles * 16):
                continue
            packed = torch.ops.aten._convert_weight_to_int4pack(((codes[:, 0::2] << 4) | codes[:, 1::2]).cuda(), tiles)
            assert torch.equal(packed.cpu(), tinygemm_pack(codes, tiles))
            assert torch.equal(tinygemm_unpack(packed, n, k).cpu(), codes)
    q = Int4Tensor.from_float(torch.randn(256, 1024, dtype=torch.bfloat16), 64).to("cuda").place()
    x = torch.randn(17, 1024, dtype=torch.bfloat16, device="cuda")
    got = torch.ops.aten._weight_int4pack_mm(x, q.qdata, 64, q.scale.to(torch.bfloat16))
    assert sqnr(tinygemm_mm(x.cpu(), q.qdata.cpu(), 64, q.scale.cpu()), got.cpu()) > 50
    assert kernels.capable((kernels.cuda.TINYGEMM_LAYOUT,), x.device)


def test_tinygemm_packing_roundtrip_is_exact_and_portable():
    torch.manual_seed(0)
    canonical = Int4Tensor.from_float(torch.randn(256, 512, dtype=torch.bfloat16), 64)
    on_gpu = canonical.place().to("cuda")  # CPU-packed -> CUDA-packed
    assert on_gpu.packing == "cuda_tinygemm"
    again = on_gpu.to("cuda")  # already there: not unpacked and repacked
    assert again.packing == "cuda_tinygemm" and torch.equal(again.qdata, on_gpu.qdata)
    back = on_gpu.to("cpu")
    assert back.packing == cpu_int4_packing()
    for name, t in canonical.tensor_fields().items():
        assert torch.equal(t, getattr(on_gpu.to_canonical(), name).cpu()), name
        assert torch.equal(t, getattr(back.to_canonical(), name)), name


COMPILE_CONFIGS = [Int4WeightOnlyConfig(128), Int8DynamicActivationInt8WeightConfig(), Int8WeightOnlyConfig(),
                   Float8DynamicActivationFloat8WeightConfig(), Float8WeightOnlyConfig(),
                   Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor())]


@pytest.mark.parametrize("config", COMPILE_CONFIGS, ids=lambda c: type(c).__name__)
def test_compile_on_cuda_with_changing_row_counts(config):
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 512, dtype=torch.bfloat16, device="cuda")
    quantize_(lin, config)
    torch._dynamo.reset()
    compiled = torch.compile(lin, fullgraph=True)
    with torch.no_grad():
        for rows in (1, 4, 17, 33, 512, 1):
            x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
            assert sqnr(lin(x), compiled(x)) > 35, rows


@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (20, 576, 32), (512, 1024, 64)])
@pytest.mark.parametrize("rows", [1, 8])
def test_triton_int4_gemv_on_the_gpu(n, k, group, rows):
    pytest.importorskip("triton")
    from hf_aoq.kernels import triton_jit

    torch.manual_seed(0)
    q = Int4Tensor.from_float(torch.randn(n, k, dtype=torch.bfloat16, device="cuda"), group)  # canonical
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    y = triton_jit.int4_gemv(x, q.qdata, q.scale, q.zero, None, group, n, k)
    exact = x.double() @ q.dequantize(torch.float32).double().t()
    assert (y.double() - exact).abs().max() <= 1e-2 * exact.abs().max()
    if n % 8:
        assert kernels.select_kernel("linear", x, q.place()).name == "triton_int4_gemv"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_int8_activation_quantizer_on_the_gpu(dtype):
    """Bit for bit the torch version, on the GPU too (Triton's divisions there are div_rn)."""
    pytest.importorskip("triton")
    from hf_aoq.kernels.common import quantize_int8_per_token
    from hf_aoq.kernels.triton_jit import quantize_rows_int8

    torch.manual_seed(0)
    x = torch.randn(33, 4096, dtype=dtype, device="cuda") * 3
    x[1] = 0
    x[2, 5] = 1e4
    codes, scale = quantize_rows_int8(x)
    expected_codes, expected_scale = quantize_int8_per_token(x)
    assert torch.equal(scale, expected_scale) and torch.equal(codes, expected_codes)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "nvfp4"])
def test_triton_mx_and_nvfp4_rows_on_the_gpu(fmt):
    """The Triton MX / NVFP4 dequantization is dequantize()'s bit for bit on the GPU (every byte
    code, finite codes for float8, in the weight's first rows), the GEMV is the reference's product, and the table picks them."""
    pytest.importorskip("triton")
    from hf_aoq import MXTensor, NVFP4Tensor

    torch.manual_seed(0)
    w = torch.randn(512, 1024, dtype=torch.bfloat16, device="cuda") * 4
    elem = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2}
    q = NVFP4Tensor.from_float(w) if fmt == "nvfp4" else MXTensor.from_float(w, elem[fmt])
    codes = torch.arange(256, device="cuda", dtype=torch.int32)
    if fmt.startswith("mxfp8"):  # the finite codes of both (e5m2's 0x7C-0x7F are inf and NaN), both signs
        codes = torch.cat([codes[:124], codes[:124] | 0x80])
    q.qdata.view(torch.uint8)[:2, : codes.numel()] = codes.to(torch.uint8)
    name = "nvfp4" if fmt == "nvfp4" else "mx"
    for dtype in (torch.bfloat16, torch.float16):
        for rows, row in ((1, "gemv"), (8, "gemv"), (65, "dequantize_mm")):
            x = torch.randn(rows, 1024, dtype=dtype, device="cuda")
            kernel = kernels.select_kernel("linear", x, q)
            assert kernel.name == f"triton_{name}_{row}"
            y = kernel.fn(x, q, None)
            deq = q.dequantize(dtype)
            exact = x.double() @ deq.double().t()
            scale = (x.double().abs() @ deq.double().abs().t()).max()
            assert (y.double() - exact).abs().max() <= 1e-2 * scale, (dtype, rows)
            if rows == 65:  # dequantize + cuBLAS: the reference's product bit for bit
                assert torch.equal(y, kernels.kernels_for("linear", type(q).__name__)[-1].fn(x, q, None))
        from hf_aoq.kernels.triton_kernels import _mx_fields, mx_dequantize_op

        got = mx_dequantize_op(*_mx_fields(q), 512, 1024, x)
        assert torch.equal(got.view(torch.int16), deq.view(torch.int16)), dtype
