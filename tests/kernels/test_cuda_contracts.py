"""hf_aoq's CUDA paths, run on a CPU-only build: FakeTensorMode makes `cuda:0` tensors without a
GPU and runs the meta checks of aten's kernels; a few shims (the CUDA device queries, and the
Python bindings that would take a CUDA device guard) let `.to("cuda")`, placement, packing and
F.linear run as on a GPU. Every call of tinygemm, `_int_mm` and `_scaled_mm` is recorded and
checked against the contracts aten's CUDA sources enforce and the meta functions do not.
The tinygemm packing itself is checked against tinygemm_layout.py, a transcription of its
documented layout (and that against the kernel's own formula, element by element)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

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
)
from hf_aoq.core.tensor import AOQTensor, same_device
from hf_aoq.kernels import cuda, registry
from hf_aoq.kernels.tinygemm_layout import tinygemm_mm, tinygemm_pack, tinygemm_unpack

aten = torch.ops.aten
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---------------------------------------------------------------------- the fake GPU
def _patch_guarded_bindings(monkeypatch, fake: FakeTensorMode) -> None:
    """Indexing, `contiguous` and `to` bind to C++ code that takes a CUDA device guard, which a
    CPU build does not have: run them as the kernels do (on meta) and hand back fake CUDA
    tensors. Patched on torch.Tensor, so that calls from inside hf_aoq's dispatch see them too."""
    cuda0 = torch.device("cuda", 0)

    def fake_cuda(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
            return fake.fake_tensor_converter.from_meta_and_device(fake, t, cuda0)
        return t

    def unguarded(original):
        def call(self, *args, **kwargs):
            if isinstance(self, FakeTensor) and self.device.type == "cuda":
                with in_kernel_invocation_manager(fake):
                    return tree_map(fake_cuda, original(self, *args, **kwargs))
            return original(self, *args, **kwargs)
        return call

    for name in ("__getitem__", "__setitem__", "contiguous"):
        monkeypatch.setattr(torch.Tensor, name, unguarded(getattr(torch.Tensor, name)))
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "cuda":
            if type(self) not in (torch.Tensor, FakeTensor):  # a quantized tensor: what the binding calls
                return aten._to_copy.default(self, device=device, **({"dtype": dtype} if dtype else {}))
            if self.device.type != "cuda":
                return torch.empty_strided(self.shape, self.stride(), dtype=dtype or self.dtype, device=cuda0)
            if dtype is None:
                return self
            return original_to(self, dtype)
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)


class Calls(TorchDispatchMode):
    """Records the aten kernels that hf_aoq's CUDA rows call, with their arguments."""

    WATCHED = {aten._weight_int4pack_mm.default: "tinygemm", aten._int_mm.default: "int_mm",
               aten._scaled_mm.default: "scaled_mm", aten._convert_weight_to_int4pack.default: "int4pack"}

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, AOQTensor) for t in types):
            # hf_aoq's own dispatch (`.to`, `copy_`) runs with this mode still on: it sees the
            # kernels those call too.
            return NotImplemented
        if func in self.WATCHED:
            named = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
            named.update({a.name: v for a, v in zip(func._schema.arguments, args)}, **kwargs)
            self.calls.append((self.WATCHED[func], named))
        return func(*args, **kwargs)

    def of(self, name) -> list[dict]:
        """The calls of one kernel, each as {argument name in aten's schema: value}."""
        return [a for n, a in self.calls if n == name]


@contextlib.contextmanager
def fake_gpu(monkeypatch, capability=(9, 0)):
    """A CUDA device of `capability` (sm90: an H100/H200) that runs only aten's meta checks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    registry.forget_capabilities()
    # Comparing aten's packing with tinygemm_layout.py needs real values: the GPU test does it.
    registry._CAPABLE[("cuda:tinygemm_layout", "cuda", 0)] = True
    # The aten rows are under test here (tests/kernels/test_triton.py has the Triton ones).
    registry._CAPABLE[("cuda:triton", "cuda", 0)] = False
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    calls = Calls()
    try:
        with monkeypatch.context() as m:
            _patch_guarded_bindings(m, fake)
            with fake, calls:
                yield calls
    finally:
        registry.forget_capabilities()


# ---------------------------------------------------------------------- the contracts
def check_tinygemm(call):
    a, b, group, sz = call["self"], call["mat2"], call["qGroupSize"], call["qScaleAndZeros"]
    assert a.dtype == torch.bfloat16, f"tinygemm reads bf16 A only, got {a.dtype}"
    assert a.dim() == 2 and a.is_contiguous() and a.shape[0] > 0
    assert b.dtype == torch.int32 and b.dim() == 4 and b.is_contiguous() and b.shape[2] == 32
    inner = b.shape[3] * 2
    assert inner in (2, 4, 8) and a.shape[1] == b.shape[1] * inner * 16
    assert group in (32, 64, 128, 256) and a.shape[1] % group == 0
    assert sz.dtype == torch.bfloat16 and tuple(sz.shape) == (a.shape[1] // group, b.shape[0] * 8, 2)


def check_int_mm(call):
    a, b = call["self"], call["mat2"]
    assert a.dtype == b.dtype == torch.int8
    assert a.shape[0] > 16, f"_int_mm needs more than 16 rows, got {a.shape[0]}"
    assert a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0 and a.shape[1] == b.shape[0]


def check_scaled_mm(call):
    a, b, scale_a, scale_b = call["self"], call["mat2"], call["scale_a"], call["scale_b"]
    assert a.shape[0] > 0
    assert not (a.dtype == b.dtype == E5M2), "e5m2 x e5m2 is refused by _scaled_mm"
    assert a.stride(1) == 1 and a.stride(0) >= a.shape[1], f"mat1 must be row-major, got stride {a.stride()}"
    assert b.stride(0) == 1 and b.stride(1) >= b.shape[0], f"mat2 must be column-major, got stride {b.stride()}"
    assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
    assert scale_a.dtype == scale_b.dtype == torch.float32
    if scale_a.numel() == 1 and scale_b.numel() == 1 and scale_a.dim() == scale_b.dim() == 0:
        return  # per tensor
    # Row-wise: 2-D scales, [M, 1] and [1, N], contiguous; e4m3 operands; bf16 output.
    assert tuple(scale_a.shape) == (a.shape[0], 1) and tuple(scale_b.shape) == (1, b.shape[1])
    assert scale_a.is_contiguous() and scale_b.is_contiguous()
    assert a.dtype == b.dtype == E4M3 and call["out_dtype"] == torch.bfloat16


CHECKS = {"tinygemm": check_tinygemm, "int_mm": check_int_mm, "scaled_mm": check_scaled_mm}
KERNEL_CALLS = {"cuda_tinygemm": "tinygemm", "cuda_int_mm": "int_mm", "cuda_scaled_mm": "scaled_mm",
                "cuda_scaled_mm_rowwise": "scaled_mm", "reference": None}


# ---------------------------------------------------------------------- every CUDA-relevant config
CONFIGS = {
    "int4-g128": (Int4WeightOnlyConfig(128), "cuda_tinygemm"),
    "int4-g32-sym": (Int4WeightOnlyConfig(32, symmetric=True), "cuda_tinygemm"),
    "int4-g64": (Int4WeightOnlyConfig(64), "cuda_tinygemm"),
    "int8-dynamic": (Int8DynamicActivationInt8WeightConfig(), "cuda_int_mm"),
    "fp8-dynamic-row": (Float8DynamicActivationFloat8WeightConfig(), "cuda_scaled_mm_rowwise"),
    "fp8-dynamic-tensor": (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()), "cuda_scaled_mm"),
    "fp8-dynamic-tensor-e5m2-act": (
        Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor(), activation_dtype=E5M2), "cuda_scaled_mm"),
    "fp8-dynamic-tensor-e5m2": (Float8DynamicActivationFloat8WeightConfig(
        granularity=PerTensor(), activation_dtype=E5M2, weight_dtype=E5M2), "reference"),
    "fp8-dynamic-row-e5m2": (Float8DynamicActivationFloat8WeightConfig(
        activation_dtype=E5M2, weight_dtype=E5M2), "reference"),
    "int8-weight-only": (Int8WeightOnlyConfig(), "reference"),
    "fp8-weight-only": (Float8WeightOnlyConfig(), "reference"),
    "int4dq": (Int4DQWeightOnlyConfig(), "reference"),
}
N = 256


def _weights(k):
    torch.manual_seed(0)
    return torch.randn(N, k, dtype=torch.bfloat16), torch.randn(N, dtype=torch.bfloat16)


def _run(monkeypatch, config, k, rows, dtype, call, capability=(9, 0)):
    """Quantize on CPU, move to the fake GPU, run one linear; (kernel name, output, calls)."""
    w, bias = _weights(k)
    q = config.quantize_weight(w)
    with fake_gpu(monkeypatch, capability) as calls:
        on_gpu = q.to("cuda").place()
        x = torch.empty(rows, k, dtype=dtype, device="cuda")
        weight = on_gpu.t() if call == "matmul" else on_gpu
        kernel = kernels.select_kernel("linear", x, on_gpu).name
        b = bias.to("cuda").to(dtype)
        y = x @ weight + b if call == "matmul" else F.linear(x, weight, b)
        assert y.device == torch.device("cuda", 0) and y.dtype == dtype and tuple(y.shape) == (rows, N)
    return kernel, on_gpu, calls


@pytest.mark.parametrize("rows", [0, 1, 17, 256])
@pytest.mark.parametrize("k", [576, 1024])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_config_takes_its_kernel_within_its_contract(monkeypatch, name, k, rows):
    config, expected = CONFIGS[name]
    kernel, on_gpu, calls = _run(monkeypatch, config, k, rows, torch.bfloat16, "linear")
    assert kernel == expected
    if expected == "cuda_tinygemm":
        assert on_gpu.packing == "cuda_tinygemm"
        assert len(calls.of("int4pack")) == 1  # packed once, at placement
    called = KERNEL_CALLS[kernel]
    for name_, check in CHECKS.items():
        made = calls.of(name_)
        # No launch for an empty batch; one call of the intended kernel otherwise, nothing else.
        assert len(made) == (1 if name_ == called and rows else 0), (name_, len(made))
        for call in made:
            check(call)


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("name", ["int8-dynamic", "fp8-dynamic-tensor", "fp8-dynamic-row", "int8-weight-only"])
def test_x_at_w_t_runs_the_linear_kernel(monkeypatch, name, rows):
    """`x @ W.t()` on a transposable type reaches the same row as F.linear, with the same contracts."""
    config, expected = CONFIGS[name]
    kernel, _, calls = _run(monkeypatch, config, 576, rows, torch.bfloat16, "matmul")
    assert kernel == expected
    for name_, check in CHECKS.items():
        for call in calls.of(name_):
            check(call)
    assert len(calls.of(KERNEL_CALLS[expected])) == (1 if KERNEL_CALLS[expected] else 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["int4-g128", "int4-g32-sym", "int8-dynamic", "fp8-dynamic-row", "fp8-dynamic-tensor"])
def test_fp16_and_fp32_activations_take_the_fast_kernel(monkeypatch, name, dtype):
    """Fix 4: an fp16 model's int4 weights ran the reference (which unpacks tinygemm's layout on
    every call); now activations are cast to bf16 for tinygemm and the output back."""
    config, expected = CONFIGS[name]
    kernel, _, calls = _run(monkeypatch, config, 1024, 3, dtype, "linear")
    assert kernel == expected
    for call in calls.of(KERNEL_CALLS[expected]):
        CHECKS[KERNEL_CALLS[expected]](call)


def test_one_decode_row_on_per_row_float8(monkeypatch):
    """Fix 1: at one activation row the [1, 1] row-wise scale was taken for a per-tensor one
    (reshaped to a scalar while the weight's stayed [1, N]: "scale tensors must be 2D")."""
    _, _, calls = _run(monkeypatch, CONFIGS["fp8-dynamic-row"][0], 1024, 1, torch.bfloat16, "linear")
    call, = calls.of("scaled_mm")
    assert tuple(call["scale_a"].shape) == (1, 1) and tuple(call["scale_b"].shape) == (1, N)
    assert call["self"].shape[0] == 1  # no row padding: _scaled_mm needs none


def test_e5m2_times_e5m2_never_reaches_scaled_mm(monkeypatch):
    """Fix 2: `_scaled_mm` refuses two e5m2 operands; such weights run the reference."""
    for name in ("fp8-dynamic-tensor-e5m2", "fp8-dynamic-row-e5m2"):
        kernel, _, calls = _run(monkeypatch, CONFIGS[name][0], 1024, 17, torch.bfloat16, "linear")
        assert kernel == "reference" and not calls.of("scaled_mm")


def test_a_transposed_float8_weight_gets_a_column_major_mat2(monkeypatch):
    """Fix 3: a weight stored [K, N] (Conv1D-style, used as x @ W) reached `_scaled_mm` as a
    row-major mat2 ("mat2 must be col_major")."""
    torch.manual_seed(0)
    w_kn = torch.randn(1024, N, dtype=torch.bfloat16)  # [in, out], used as x @ W
    q = Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()).quantize_weight(w_kn)
    with fake_gpu(monkeypatch) as calls:
        on_gpu = q.to("cuda")
        x = torch.empty(5, 2048, dtype=torch.bfloat16, device="cuda")[:, :1024]  # a strided view
        assert kernels.select_kernel("linear", x, on_gpu.t()).name == "cuda_scaled_mm"
        assert not on_gpu.t().qdata.is_contiguous()
        y = x @ on_gpu
        assert tuple(y.shape) == (5, N)
    call, = calls.of("scaled_mm")
    check_scaled_mm(call)


def test_older_torch_rocm_and_older_gpus_fall_back(monkeypatch):
    """Fix 6: the rows need what their aten kernels need: torch >= 2.5 (uint8 int4 packing,
    row-wise float8), NVIDIA (ROCm has other tinygemm tiles and fnuz float8), sm80 for tinygemm,
    sm89 for float8 per tensor, sm90 for row-wise float8."""
    int4, row, tensor = (CONFIGS[n][0] for n in ("int4-g128", "fp8-dynamic-row", "fp8-dynamic-tensor"))
    assert _run(monkeypatch, row, 1024, 1, torch.bfloat16, "linear", (8, 9))[0] == "reference"
    assert _run(monkeypatch, tensor, 1024, 1, torch.bfloat16, "linear", (8, 9))[0] == "cuda_scaled_mm"
    assert _run(monkeypatch, tensor, 1024, 1, torch.bfloat16, "linear", (8, 6))[0] == "reference"
    kernel, placed, _ = _run(monkeypatch, int4, 1024, 1, torch.bfloat16, "linear", (7, 5))
    assert kernel == "reference" and placed.packing is None
    with monkeypatch.context() as m:
        m.setattr(torch.version, "hip", "6.2")
        kernel, placed, _ = _run(monkeypatch, int4, 1024, 1, torch.bfloat16, "linear")
        assert kernel == "reference" and placed.packing is None
        assert _run(monkeypatch, tensor, 1024, 1, torch.bfloat16, "linear")[0] == "reference"
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "2.4.1+cu121")
        kernel, placed, _ = _run(monkeypatch, int4, 1024, 1, torch.bfloat16, "linear")
        assert kernel == "reference" and placed.packing is None


def test_cuda_and_cuda0_are_one_device(monkeypatch):
    """Fix 7: `torch.device("cuda") != cuda:0`, so `.to("cuda")` unpacked and repacked a weight
    that was already there."""
    q = Int4WeightOnlyConfig(128).quantize_weight(_weights(1024)[0]).place()  # CPU-packed
    with fake_gpu(monkeypatch) as calls:
        assert same_device("cuda", torch.device("cuda", 0)) and not same_device("cuda", "cpu")
        on_gpu = q.to("cuda")  # CPU-packed -> CUDA-packed
        assert on_gpu.packing == "cuda_tinygemm" and len(calls.of("int4pack")) == 1
        again = on_gpu.to("cuda")
        assert again.packing == "cuda_tinygemm" and len(calls.of("int4pack")) == 1  # not repacked
        assert on_gpu.to("cuda:0").packing == "cuda_tinygemm" and len(calls.of("int4pack")) == 1
    assert same_device("cpu", torch.device("cpu")) and not same_device("cuda:1", "cuda:0")


def test_a_3d_input_keeps_its_leading_dims(monkeypatch):
    for name in ("int4-g128", "int8-dynamic", "fp8-dynamic-row"):
        w, _ = _weights(576)
        q = CONFIGS[name][0].quantize_weight(w)
        with fake_gpu(monkeypatch) as calls:
            x = torch.empty(2, 9, 576, dtype=torch.bfloat16, device="cuda")
            y = F.linear(x, q.to("cuda").place())
            assert tuple(y.shape) == (2, 9, N)
        for call, check in CHECKS.items():
            for made in calls.of(call):
                check(made)


# ---------------------------------------------------------------------- the tinygemm layout
def _kernel_formula_pack(codes: torch.Tensor, tiles: int) -> torch.Tensor:
    """aten's `matrix_to_m16n8k16_Bint4_layout` for NVIDIA, one word at a time, from its bytes
    (tinygemm's input: high nibble = even k)."""
    n, k = codes.shape
    b = ((codes[:, 0::2] << 4) | codes[:, 1::2]).tolist()
    out = torch.zeros(n // 8, k // (tiles * 16), 32, tiles // 2, dtype=torch.int64)
    for nt in range(n // 8):
        for ko in range(k // (tiles * 16)):
            for t in range(32):
                for inner in range(0, tiles, 2):
                    row = nt * 8 + t // 4
                    base = (ko * tiles + inner) * 8
                    ks = (base + t % 4, base + t % 4 + 4, base + 8 + t % 4, base + 12 + t % 4)
                    v = [b[row][i] for i in ks]
                    word = ((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20) | ((v[0] & 0xF) << 16)
                    word |= ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4) | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4)
                    out[nt, ko, t, inner // 2] = word - (1 << 32) if word >= 1 << 31 else word
    return out.to(torch.int32)


@pytest.mark.parametrize("n,k,tiles", [(8, 32, 2), (16, 64, 4), (24, 256, 8), (16, 128, 4)])
def test_the_layout_transcription_is_the_kernel_formula(n, k, tiles):
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n + k), dtype=torch.uint8)
    packed = tinygemm_pack(codes, tiles)
    assert torch.equal(packed, _kernel_formula_pack(codes, tiles))
    assert torch.equal(tinygemm_unpack(packed, n, k), codes)


def test_tinygemm_packing_on_the_fake_gpu_has_aten_shape_and_unpacks_through_the_transcription(monkeypatch):
    """Placement packs with aten (shape checked by its meta function) and unpacking reads the
    transcribed layout (no nibble probe: one pack call in all)."""
    q = Int4Tensor.from_float(_weights(576)[0], 128)  # K = 576: padded to 640, 8 inner k-tiles
    with fake_gpu(monkeypatch) as calls:
        on_gpu = q.to("cuda").place()
        assert tuple(on_gpu.qdata.shape) == (N // 8, 640 // 128, 32, 4)
        back = on_gpu.to_canonical()
        assert back.packing is None and tuple(back.qdata.shape) == (N, 288)
        assert len(calls.of("int4pack")) == 1


def test_the_transcription_matmul_is_the_canonical_dequantization_bit_for_bit():
    """tinygemm_mm (the kernel's arithmetic, up to summation order) on the packing of a weight
    equals the bf16 dequantization of its canonical layout times x, in float32, bit for bit."""
    from hf_aoq.kernels.common import scale_and_zero

    torch.manual_seed(0)
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    for sym in (False, True):
        q = Int4Tensor.from_float(w, 64, symmetric=sym)
        packed = tinygemm_pack(q.codes())
        x = torch.randn(5, 256, dtype=torch.bfloat16)
        got = tinygemm_mm(x, packed, 64, scale_and_zero(q))
        expected = (x.float() @ q.dequantize(torch.bfloat16).float().t()).to(torch.bfloat16)
        assert torch.equal(got, expected)


def test_an_empty_batch_on_cpu_too():
    """Fix 5 reached the reference path as well: a per-tensor activation scale of no rows."""
    q = Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()).quantize_weight(torch.randn(32, 64))
    assert tuple(F.linear(torch.randn(0, 64), q).shape) == (0, 32)
    assert tuple(F.linear(torch.randn(2, 0, 64), q.place()).shape) == (2, 0, 32)


@pytest.mark.parametrize("rows,expected", [(1, "triton_int4dq_gemv"), (8, "triton_int4dq_gemv"),
                                           (17, "triton_int4dq_gemm"), (65, "triton_int4dq_dequantize_mm")])
def test_int4dq_takes_the_triton_gemv_at_few_rows(monkeypatch, rows, expected):
    """Where triton runs, Int4DQ (canonical on CUDA: no packing there) takes the Triton GEMV up to
    TRITON_GEMV_MAX_ROWS rows, the Triton GEMM up to TRITON_GEMM_MAX_ROWS, then one Triton
    dequantization and cuBLAS (tests/kernels/test_triton_gemm.py has the rows by M)."""
    w, bias = _weights(576)
    q = Int4DQWeightOnlyConfig().quantize_weight(w)
    with fake_gpu(monkeypatch) as calls:
        registry._CAPABLE[("cuda:triton", "cuda", 0)] = True
        on_gpu = q.to("cuda").place()
        assert on_gpu.packing is None
        x = torch.empty(rows, 576, dtype=torch.bfloat16, device="cuda")
        assert kernels.select_kernel("linear", x, on_gpu).name == expected
        if expected != "reference":
            # Eager, the row launches Triton (no fake GPU can); under torch.compile its custom
            # op's fake gives the output's shape and dtype.
            from hf_aoq.kernels.triton_kernels import int4dq_gemv_op

            y = int4dq_gemv_op.op(x, on_gpu.qdata, on_gpu.gparams, on_gpu.rparams, on_gpu.tparams,
                                  torch.empty(32, device="cuda"), bias.to("cuda"), 32, N, 576)
            assert y.device == torch.device("cuda", 0) and y.dtype == torch.bfloat16 and tuple(y.shape) == (rows, N)
            assert not any(calls.of(name) for name in CHECKS)


@pytest.mark.parametrize("rows", [1, 17])
def test_an_input_scale_keeps_tinygemm_within_its_contract(monkeypatch, rows):
    """An Int4Tensor with input_scale (AWQ scales that could not fold): x / s (bf16, contiguous)
    reaches tinygemm once, within its contract; the scales move to the GPU with the weight."""
    from hf_aoq.tensors.common import with_input_scale

    w, bias = _weights(576)
    s = torch.exp(torch.randn(576))
    q = with_input_scale(Int4WeightOnlyConfig(64).quantize_weight((w.float() * s).to(w.dtype)), s)
    with fake_gpu(monkeypatch) as calls:
        on_gpu = q.to("cuda").place()
        assert on_gpu.packing == "cuda_tinygemm" and on_gpu.input_scale.device == torch.device("cuda", 0)
        x = torch.empty(rows, 576, dtype=torch.bfloat16, device="cuda")
        y = F.linear(x, on_gpu, bias.to("cuda"))
        assert y.dtype == torch.bfloat16 and tuple(y.shape) == (rows, N)
        made = calls.of("tinygemm")
        assert len(made) == 1
        check_tinygemm(made[0])
