"""CUDA kernels against the reference; skipped without a GPU (see conftest.py)."""
import pytest
import torch
import torch.nn.functional as F

from hf_aoq import (
    Float8DynamicActivationFloat8WeightConfig,
    Float8WeightOnlyConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    PerTensor,
    kernels,
)

from conftest import cpu_int4_packing, sqnr

pytestmark = pytest.mark.cuda

CASES = [
    (Int4WeightOnlyConfig(128), "cuda_tinygemm", (8, 0)),
    (Int4WeightOnlyConfig(32, symmetric=True), "cuda_tinygemm", (8, 0)),
    (Int8DynamicActivationInt8WeightConfig(), "cuda_int_mm", (7, 0)),
    (Float8DynamicActivationFloat8WeightConfig(), "cuda_scaled_mm", (8, 9)),
    (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()), "cuda_scaled_mm", (8, 9)),
    (Int8WeightOnlyConfig(), "reference", (0, 0)),
    (Float8WeightOnlyConfig(), "reference", (0, 0)),
]


@pytest.mark.parametrize("config,kernel,capability", CASES, ids=[f"{type(c).__name__}-{i}" for i, (c, _, _) in enumerate(CASES)])
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_cuda_kernel_matches_reference(config, kernel, capability, rows):
    if torch.cuda.get_device_capability() < capability:
        pytest.skip(f"{kernel} needs compute capability {capability}")
    torch.manual_seed(0)
    w = torch.randn(512, 1024, dtype=torch.bfloat16)
    bias = torch.randn(512, dtype=torch.bfloat16, device="cuda")
    q = config.quantize_weight(w).to("cuda").place()
    x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
    chosen = kernels.select_kernel("linear", x, q)
    assert chosen.name == kernel
    reference = kernels.kernels_for("linear", type(q).__name__)[-1]
    y = F.linear(x, q, bias)
    assert y.is_cuda and y.shape == (rows, 512)
    assert sqnr(reference.fn(x, q, bias), y) > 40
    assert sqnr(F.linear(x, w.cuda(), bias), y) > 15


def test_tinygemm_packing_roundtrip_is_exact_and_portable():
    torch.manual_seed(0)
    canonical = Int4Tensor.from_float(torch.randn(256, 512, dtype=torch.bfloat16), 64)
    on_gpu = canonical.place().to("cuda")  # CPU-packed -> CUDA-packed
    assert on_gpu.packing == "cuda_tinygemm"
    back = on_gpu.to("cpu")
    assert back.packing == cpu_int4_packing()
    for name, t in canonical.tensor_fields().items():
        assert torch.equal(t, getattr(on_gpu.to_canonical(), name).cpu()), name
        assert torch.equal(t, getattr(back.to_canonical(), name)), name


def test_compile_on_cuda():
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 512, dtype=torch.bfloat16, device="cuda")
    from hf_aoq import quantize_

    quantize_(lin, Int4WeightOnlyConfig(128))
    x = torch.randn(4, 1024, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        torch._dynamo.reset()
        assert sqnr(lin(x), torch.compile(lin, fullgraph=True)(x)) > 40
