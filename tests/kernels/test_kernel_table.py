"""The kernel table (kernels/registry.py): what it holds, how a weight finds its row (through its
MRO, its packing, the device and what the device allows), and that torch.compile runs the row
eager mode runs. tests/kernels/test_no_cpu_ext.py runs this module again without the C++ extension."""
import os

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
    Int8Tensor,
    Int8WeightOnlyConfig,
    Int8DynamicActivationIntxWeightConfig,
    IntxDQWeightOnlyConfig,
    IntxWeightOnlyConfig,
    PerGroup,
    PerTensor,
    kernels,
)
from hf_aoq.kernels import cpu_ext, registry

# The whole table, one row per (op, tensor type, packing it reads, kernel), best kernel first for
# each (op, type, packing). Adding a kernel or a packing adds rows here and nowhere else.
TABLE = [
    ("embedding", "FPxTensor", "canonical", "rowgather"),
    ("embedding", "FPxTensor", "canonical", "reference"),
    ("embedding", "Float8SemiSparseTensor", "canonical", "rowgather"),
    ("embedding", "Float8SemiSparseTensor", "canonical", "reference"),
    ("embedding", "Float8Tensor", "canonical", "rowgather"),
    ("embedding", "Float8Tensor", "canonical", "reference"),
    ("embedding", "Int4DQTensor", "canonical", "rowgather"),
    ("embedding", "Int4DQTensor", "canonical", "reference"),
    ("embedding", "Int4DQTensor", "cpu_int4dq", "reference"),
    ("embedding", "Int4Tensor", "canonical", "rowgather"),
    ("embedding", "Int4Tensor", "canonical", "reference"),
    ("embedding", "Int4Tensor", "cpu_int4_pairs", "reference"),
    ("embedding", "Int4Tensor", "cpu_int4pack", "reference"),
    ("embedding", "Int4Tensor", "cuda_tinygemm", "reference"),
    ("embedding", "Int8Tensor", "canonical", "rowgather"),
    ("embedding", "Int8Tensor", "canonical", "reference"),
    ("embedding", "Int8Tensor", "cpu_int8_aligned", "rowgather"),
    ("embedding", "Int8Tensor", "cpu_int8_aligned", "reference"),
    ("embedding", "IntxDQTensor", "canonical", "rowgather"),
    ("embedding", "IntxDQTensor", "canonical", "reference"),
    ("embedding", "IntxDQTensor", "cpu_intxdq", "reference"),
    ("embedding", "IntxTensor", "canonical", "rowgather"),
    ("embedding", "IntxTensor", "canonical", "reference"),
    ("embedding", "MXTensor", "canonical", "rowgather"),
    ("embedding", "MXTensor", "canonical", "reference"),
    ("embedding", "NVFP4Tensor", "canonical", "rowgather"),
    ("embedding", "NVFP4Tensor", "canonical", "reference"),
    ("linear", "FPxTensor", "canonical", "cpu_fpx_bf16_gemm"),
    ("linear", "FPxTensor", "canonical", "cpu_fpx_ext"),
    ("linear", "FPxTensor", "canonical", "reference"),
    ("linear", "Float8SemiSparseTensor", "canonical", "cpu_fp8_sparse_gemv"),
    ("linear", "Float8SemiSparseTensor", "canonical", "cpu_fp8_sparse_dequant_gemm"),
    ("linear", "Float8SemiSparseTensor", "canonical", "reference"),
    ("linear", "Float8Tensor", "canonical", "cpu_fp8_dpbf16"),
    ("linear", "Float8Tensor", "canonical", "cpu_fp8_amx"),
    ("linear", "Float8Tensor", "canonical", "cpu_fp8_avx512bf16"),
    ("linear", "Float8Tensor", "canonical", "cpu_fp8_bf16_gemm"),
    ("linear", "Float8Tensor", "canonical", "cpu_fp8_gemv"),
    ("linear", "Float8Tensor", "canonical", "cuda_scaled_mm_rowwise"),
    ("linear", "Float8Tensor", "canonical", "cuda_scaled_mm"),
    ("linear", "Float8Tensor", "canonical", "triton_fp8_gemv"),
    ("linear", "Float8Tensor", "canonical", "reference"),
    ("linear", "Int4DQTensor", "canonical", "triton_int4dq_gemv"),
    ("linear", "Int4DQTensor", "canonical", "triton_int4dq_gemm"),
    ("linear", "Int4DQTensor", "canonical", "triton_int4dq_dequantize_mm"),
    ("linear", "Int4DQTensor", "canonical", "reference"),
    ("linear", "Int4DQTensor", "cpu_int4dq", "cpu_int4dq_amx"),
    ("linear", "Int4DQTensor", "cpu_int4dq", "cpu_int4dq_avx512bf16"),
    ("linear", "Int4DQTensor", "cpu_int4dq", "cpu_int4dq_bf16_gemm"),
    ("linear", "Int4DQTensor", "cpu_int4dq", "cpu_int4dq_ext"),
    ("linear", "Int4DQTensor", "cpu_int4dq", "reference"),
    ("linear", "Int4Tensor", "canonical", "triton_int4_gemv"),
    ("linear", "Int4Tensor", "canonical", "triton_int4_gemm"),
    ("linear", "Int4Tensor", "canonical", "triton_int4_dequantize_mm"),
    ("linear", "Int4Tensor", "canonical", "reference"),
    ("linear", "Int4Tensor", "cpu_int4_pairs", "cpu_int8_int4_ext"),
    ("linear", "Int4Tensor", "cpu_int4_pairs", "cpu_int4_amx"),
    ("linear", "Int4Tensor", "cpu_int4_pairs", "cpu_int4_avx512bf16"),
    ("linear", "Int4Tensor", "cpu_int4_pairs", "cpu_int4_bf16_gemm"),
    ("linear", "Int4Tensor", "cpu_int4_pairs", "cpu_int4_ext"),
    ("linear", "Int4Tensor", "cpu_int4_pairs", "reference"),
    ("linear", "Int4Tensor", "cpu_int4pack", "cpu_int4pack_mm"),
    ("linear", "Int4Tensor", "cpu_int4pack", "reference"),
    ("linear", "Int4Tensor", "cuda_tinygemm", "cuda_tinygemm"),
    ("linear", "Int4Tensor", "cuda_tinygemm", "reference"),
    ("linear", "Int8Tensor", "canonical", "cpu_int8dyn_amx"),
    ("linear", "Int8Tensor", "canonical", "cpu_int8dyn_vnni"),
    ("linear", "Int8Tensor", "canonical", "cpu_int8_amx"),
    ("linear", "Int8Tensor", "canonical", "cpu_int8_avx512bf16"),
    ("linear", "Int8Tensor", "canonical", "cpu_int8_bf16_gemm"),
    ("linear", "Int8Tensor", "canonical", "cpu_int8_ext"),
    ("linear", "Int8Tensor", "canonical", "cuda_int_mm"),
    ("linear", "Int8Tensor", "canonical", "triton_int8_gemv"),
    ("linear", "Int8Tensor", "canonical", "reference"),
    ("linear", "Int8Tensor", "cpu_int8_aligned", "cpu_int8dyn_amx"),
    ("linear", "Int8Tensor", "cpu_int8_aligned", "cpu_int8dyn_vnni"),
    ("linear", "Int8Tensor", "cpu_int8_aligned", "cpu_int8_amx"),
    ("linear", "Int8Tensor", "cpu_int8_aligned", "cpu_int8_avx512bf16"),
    ("linear", "Int8Tensor", "cpu_int8_aligned", "cpu_int8_bf16_gemm"),
    ("linear", "Int8Tensor", "cpu_int8_aligned", "cpu_int8_ext"),
    ("linear", "Int8Tensor", "cpu_int8_aligned", "cpu_int8pack_mm"),
    ("linear", "Int8Tensor", "cpu_int8_aligned", "reference"),
    ("linear", "IntxDQTensor", "canonical", "cpu_intxdq_amx"),
    ("linear", "IntxDQTensor", "canonical", "cpu_intxdq_avx512bf16"),
    ("linear", "IntxDQTensor", "canonical", "cpu_intxdq_bf16_gemm"),
    ("linear", "IntxDQTensor", "canonical", "cpu_intxdq_ext"),
    ("linear", "IntxDQTensor", "canonical", "reference"),
    ("linear", "IntxDQTensor", "cpu_intxdq", "cpu_intxdq_amx"),
    ("linear", "IntxDQTensor", "cpu_intxdq", "cpu_intxdq_avx512bf16"),
    ("linear", "IntxDQTensor", "cpu_intxdq", "cpu_intxdq_bf16_gemm"),
    ("linear", "IntxDQTensor", "cpu_intxdq", "cpu_intxdq_ext"),
    ("linear", "IntxDQTensor", "cpu_intxdq", "reference"),
    ("linear", "IntxTensor", "canonical", "cpu_intx_amx"),
    ("linear", "IntxTensor", "canonical", "cpu_intx_avx512bf16"),
    ("linear", "IntxTensor", "canonical", "cpu_intx_bf16_gemm"),
    ("linear", "IntxTensor", "canonical", "cpu_intx_ext"),
    ("linear", "IntxTensor", "canonical", "reference"),
    ("linear", "MXTensor", "canonical", "cpu_mx_gemv"),
    ("linear", "MXTensor", "canonical", "cpu_mx_dequant_gemm"),
    ("linear", "MXTensor", "canonical", "triton_mx_gemv"),
    ("linear", "MXTensor", "canonical", "triton_mx_dequantize_mm"),
    ("linear", "MXTensor", "canonical", "reference"),
    ("linear", "NVFP4Tensor", "canonical", "cpu_nvfp4_gemv"),
    ("linear", "NVFP4Tensor", "canonical", "cpu_nvfp4_dequant_gemm"),
    ("linear", "NVFP4Tensor", "canonical", "triton_nvfp4_gemv"),
    ("linear", "NVFP4Tensor", "canonical", "triton_nvfp4_dequantize_mm"),
    ("linear", "NVFP4Tensor", "canonical", "reference"),
]


def test_the_table_is_the_one_place():
    assert kernels.table() == TABLE


def test_each_packing_names_the_kernels_that_read_it():
    reads = {
        "cpu_int4_pairs": ["cpu_int8_int4_ext", "cpu_int4_amx", "cpu_int4_avx512bf16", "cpu_int4_bf16_gemm", "cpu_int4_ext"],
        "cpu_int4pack": ["cpu_int4pack_mm"],
        "cpu_int4dq": ["cpu_int4dq_amx", "cpu_int4dq_avx512bf16", "cpu_int4dq_bf16_gemm", "cpu_int4dq_ext"],
        "cpu_int8_aligned": ["cpu_int8dyn_amx", "cpu_int8dyn_vnni", "cpu_int8_amx", "cpu_int8_avx512bf16", "cpu_int8_bf16_gemm", "cpu_int8_ext",
                             "cpu_int8pack_mm"],
        "cpu_intxdq": ["cpu_intxdq_amx", "cpu_intxdq_avx512bf16", "cpu_intxdq_bf16_gemm", "cpu_intxdq_ext"],
        "cuda_tinygemm": ["cuda_tinygemm"],
    }
    for packing, names in reads.items():
        assert [k.name for k in kernels.get_packing(packing).kernels("linear")] == names, packing
    with pytest.raises(ValueError, match="unknown packing 'nope'"):
        kernels.get_packing("nope")


def test_the_extension_switch_is_honoured():
    """This module runs with and without HF_AOQ_NO_CPU_EXT (test_no_cpu_ext.py): the variable
    must really switch the extension off."""
    if not os.environ.get("HF_AOQ_NO_CPU_EXT"):
        pytest.skip("the extension is not switched off in this run")
    assert cpu_ext.load() is None and not cpu_ext.available()
    assert not kernels.capable((kernels.cpu.CPU_EXT,), torch.device("cpu"))


def test_cpu_picks_fast_kernels():
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    # hf_aoq's own int4/int8 kernels where its extension builds; aten's otherwise.
    int4 = "cpu_int4_ext" if cpu_ext.available() else "cpu_int4pack_mm"
    int8 = "cpu_int8_ext" if cpu_ext.available() else "cpu_int8pack_mm"
    fp8 = "cpu_fp8_gemv" if cpu_ext.available() else "reference"
    # bf16 float8 at 2+ rows: the dot-product row where AVX512-BF16 runs without AMX (and VBMI is).
    dot = next(k for k in kernels.kernels_for("linear", "Float8Tensor") if k.name == "cpu_fp8_dpbf16")
    if kernels.capable(dot.needs, torch.device("cpu")):
        fp8 = "cpu_fp8_dpbf16"
    # int8 dynamic: the integer GEMV where the avx512 build runs (below the AMX tiles' rows).
    int8dyn = "cpu_int8dyn_vnni" if cpu_ext.available() and cpu_ext.chosen_isa() == "avx512" else int8
    picks = {
        "Int4": (Int4WeightOnlyConfig(64), int4),
        "Int8": (Int8WeightOnlyConfig(), int8),
        "Int8dyn": (Int8DynamicActivationInt8WeightConfig(), int8dyn),
        "Float8": (Float8WeightOnlyConfig(), fp8),
        "Float8dyn": (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()), fp8),
    }
    for name, (config, kernel) in picks.items():
        q = config.quantize_weight(w).place()
        assert kernels.select_kernel("linear", x, q).name == kernel, name
    # Per-group int8 has no fast CPU kernel: the reference runs.
    q = Int8WeightOnlyConfig(group_size=64).quantize_weight(w)
    assert kernels.select_kernel("linear", x, q).name == "reference"


def test_int4_odd_shapes_fall_back_to_canonical():
    q = Int4Tensor.from_float(torch.randn(5, 64), 32)
    placed = q.place()
    assert placed.packing is None
    x = torch.randn(2, 64)
    assert kernels.select_kernel("linear", x, placed).name == "reference"
    assert torch.allclose(F.linear(x, placed), F.linear(x, q.dequantize()), atol=1e-5)


class SubInt4(Int4Tensor):
    """A subclass that adds nothing: it must get Int4Tensor's packings and kernels."""


def test_a_subclass_finds_its_bases_kernels_through_the_mro():
    torch.manual_seed(0)
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    base = Int4Tensor.from_float(w, 64).place()
    sub = SubInt4.from_float(w, 64).place()
    assert type(sub) is SubInt4 and sub.packing == base.packing is not None
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert kernels.select_kernel("linear", x, sub) is kernels.select_kernel("linear", x, base)
    assert kernels.select_kernel("linear", x, sub).name != "reference"
    assert torch.equal(F.linear(x, sub), F.linear(x, base))
    idx = torch.tensor([3, 0])
    canonical = sub.to_canonical()
    assert type(canonical) is SubInt4
    assert kernels.select_kernel("embedding", idx, canonical).name == "rowgather"
    assert torch.equal(F.embedding(idx, canonical), F.embedding(idx, base.to_canonical()))


@pytest.fixture
def scratch_table():
    """Rows and packings registered inside the test are gone after it."""
    saved = ({k: list(v) for k, v in registry._KERNELS.items()}, dict(registry._PACKINGS), dict(registry._CAPABILITIES))
    try:
        yield
    finally:
        registry._KERNELS.clear()
        registry._KERNELS.update(saved[0])
        registry._PACKINGS.clear()
        registry._PACKINGS.update(saved[1])
        registry._CAPABILITIES.clear()
        registry._CAPABILITIES.update(saved[2])
        registry.forget_capabilities()
        registry._rebuild()


def test_capabilities_are_probed_once_per_device_and_gate_their_rows(scratch_table):
    probes = []
    present = kernels.capability("test:present", "cpu", lambda d: probes.append(("present", str(d))) or True)
    absent = kernels.capability("test:absent", "cpu", lambda d: probes.append(("absent", str(d))) or False)
    fast = lambda x, w, bias: torch.full((*x.shape[:-1], w.shape[0]), 1.0)  # noqa: E731
    faster = lambda x, w, bias: torch.full((*x.shape[:-1], w.shape[0]), 2.0)  # noqa: E731
    kernels.register_kernel("linear", "SubInt4", "test_fast", backend="cpu", priority=50, device="cpu",
                            needs=(present,))(fast)
    kernels.register_kernel("linear", "SubInt4", "test_faster", backend="cpu", priority=60, device="cpu",
                            needs=(absent,))(faster)
    q = SubInt4.from_float(torch.randn(16, 64), 32)  # canonical: both rows read it
    x = torch.randn(2, 64)
    for _ in range(3):
        assert kernels.select_kernel("linear", x, q).name == "test_fast"  # the absent one is skipped
    assert torch.equal(F.linear(x, q), torch.ones(2, 16))
    assert sorted(probes) == [("absent", "cpu"), ("present", "cpu")]
    # On another device the CPU rows do not apply: Int4Tensor's rows (the reference) are next.
    assert kernels.select_kernel("linear", x.to("meta"), q).name == "reference"
    with pytest.raises(ValueError, match="declared twice"):
        kernels.capability("test:present", "cpu", lambda d: True)
    with pytest.raises(ValueError, match="unregistered packings"):
        kernels.register_kernel("linear", "SubInt4", "test_bad", backend="cpu", priority=1, reads=("no_such",))(fast)


def test_placement_only_picks_a_packing_some_kernel_here_can_run(scratch_table):
    never = kernels.capability("test:never", "cpu", lambda d: False)
    kernels.register_packing(kernels.Packing(
        "test_packing", "SubInt4", "cpu", 99, lambda w: True, lambda w: w.replace(packing="test_packing"),
        lambda w: w.replace(packing=None),
    ))
    kernels.register_kernel("linear", "SubInt4", "test_unrunnable", backend="cpu", priority=99,
                            reads=("test_packing",), device="cpu", needs=(never,))(lambda x, w, b: None)
    q = SubInt4.from_float(torch.randn(64, 256), 64)
    assert kernels.get_packing("test_packing").kernels() == [registry._KERNELS[("linear", "SubInt4")][0]]
    # Its only kernel cannot run here: placement falls through to Int4Tensor's packings.
    assert q.place().packing == Int4Tensor.from_float(torch.randn(64, 256), 64).place().packing != "test_packing"


@pytest.mark.parametrize("helps", [False, True])
def test_a_packing_that_kernels_also_read_canonical_is_made_only_when_it_helps_them(scratch_table, helps):
    kernels.register_packing(kernels.Packing(
        "test_helper", "SubInt4", "cpu", 99, lambda w: True, lambda w: w.replace(packing="test_helper"),
        lambda w: w.replace(packing=None), helps_canonical_readers=helps,
    ))
    kernels.register_kernel("linear", "SubInt4", "test_both", backend="cpu", priority=99,
                            reads=(kernels.CANONICAL, "test_helper"), device="cpu")(lambda x, w, b: None)
    q = SubInt4.from_float(torch.randn(64, 256), 64)
    # The kernel reads the canonical layout too: the packing is worth making only where it says so.
    assert (q.place().packing == "test_helper") == helps
    assert kernels.select_kernel("linear", torch.randn(2, 256), q).name == "test_both"


def test_the_int8_packing_copies_unaligned_codes_once_and_aten_reads_only_it():
    torch.manual_seed(0)
    q = Int8Tensor.from_float(torch.randn(40, 64))
    buf = torch.empty(40 * 64 + 1, dtype=torch.int8)
    view = buf[1:].view(40, 64)
    view.copy_(q.qdata)
    loaded = q.replace(qdata=view)  # as a tensor read out of a file at an odd offset
    assert loaded.qdata.data_ptr() % 64
    placed = loaded.place()
    assert placed.packing == "cpu_int8_aligned"
    assert placed.qdata.data_ptr() % 64 == 0 and placed.qdata.is_contiguous()
    assert torch.equal(placed.qdata, q.qdata)
    assert placed.place() is placed  # placing again copies nothing
    aligned = q.place()
    assert aligned.qdata.data_ptr() == q.qdata.data_ptr()  # already aligned: no copy
    assert placed.to_canonical().packing is None and torch.equal(placed.to_canonical().qdata, q.qdata)
    # aten's int8 kernel never sees the canonical layout, which may be unaligned; the kernels
    # that read canonical weights read the packing too (it keeps the layout).
    assert "cpu_int8pack_mm" not in [k.name for k in kernels.kernels_for("linear", "Int8Tensor")
                                     if k.reads_packing(None)]
    idx = torch.tensor([3, 39])
    assert kernels.select_kernel("embedding", idx, placed).name == "rowgather"
    assert torch.equal(F.embedding(idx, placed), q.dequantize()[idx])
    x = torch.randn(17, 64, dtype=torch.bfloat16)  # more than 16 rows: aten's path that crashed
    assert torch.allclose(F.linear(x, placed).float(), F.linear(x, q.dequantize(torch.bfloat16)).float(), rtol=2e-2, atol=0.5)


def test_aten_int8_kernel_is_not_given_bfloat16_rows_it_cannot_read():
    """aten's int8 kernel with bfloat16 activations needs K % 16 == 0 at more than one row (it
    crashed otherwise); such weights run on another kernel."""
    torch.manual_seed(0)
    q = Int8Tensor.from_float(torch.randn(40, 45)).place()
    x = torch.randn(3, 45, dtype=torch.bfloat16)
    assert kernels.select_kernel("linear", x, q).name != "cpu_int8pack_mm"
    expected = F.linear(x, q.dequantize(torch.bfloat16))
    assert torch.allclose(F.linear(x, q).float(), expected.float(), rtol=2e-2, atol=0.5)
    if not cpu_ext.available():
        assert kernels.select_kernel("linear", x.float(), q).name == "cpu_int8pack_mm"


CONFIGS = [Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig(),
           Float8WeightOnlyConfig(), Int4DQWeightOnlyConfig(),
           IntxWeightOnlyConfig(torch.int3, PerGroup(32)), Int8DynamicActivationIntxWeightConfig(torch.int5),
           IntxDQWeightOnlyConfig(3, 32)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: type(c).__name__)
def test_compiled_graphs_run_the_kernel_eager_mode_runs(config):
    """Under torch.compile the table picks the same row, and its opaque op (registry.OpaqueOp) is
    what the graph calls; the answer is eager's, bit for bit (no Inductor: the graph as traced)."""
    from torch._dynamo.backends.common import aot_autograd
    from hf_aoq import quantize_

    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64)
    quantize_(lin, config)
    x = torch.randn(3, 128)
    kernel = kernels.select_kernel("linear", x, lin.weight)
    if kernel.name == "reference" and isinstance(config, (Int4DQWeightOnlyConfig, IntxDQWeightOnlyConfig)):
        pytest.xfail(f"{type(lin.weight).__name__}.dequantize indexes a module-level tensor (Int4DQ's LUT), which "
                     "torch.compile refuses")
    ops = []

    def record(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(lin, backend=aot_autograd(fw_compiler=record), fullgraph=True)(x)
        assert torch.equal(got, lin(x))
    custom = [op for op in ops if op.startswith("hf_aoq.")]
    expected = {
        "cpu_int4_ext": ["hf_aoq.int4_linear_io_cpu.default"],
        "cpu_int8_ext": ["hf_aoq.int8dyn_linear_io_cpu.default" if getattr(lin.weight, "act_quant", None) else
                         "hf_aoq.int8_linear_io_cpu.default"],
        "cpu_int8pack_mm": ["hf_aoq.int8pack_mm_cpu.default"],
        "cpu_fp8_gemv": ["hf_aoq.fp8_linear_io_cpu.default"],
        "cpu_fp8_dpbf16": ["hf_aoq.fp8_dpbf16_linear_cpu.default"],
        "cpu_int4dq_ext": ["hf_aoq.int4dq_linear_io_cpu.default"],
        "cpu_intx_ext": ["hf_aoq.intx_linear_io_cpu.default"],
        "cpu_intxdq_ext": ["hf_aoq.intxdq_linear_io_cpu.default"],
        "cpu_int8_int4_ext": ["hf_aoq.int8_int4_linear_io_cpu.default"],
        "cpu_int8dyn_amx": ["hf_aoq.int8dyn_amx_linear_cpu.default"],
        "cpu_int8dyn_vnni": ["hf_aoq.int8dyn_vnni_linear_cpu.default"],
    }.get(kernel.name, [])
    assert custom == expected, (kernel.name, ops)
    if kernel.name == "cpu_int4pack_mm":
        assert "aten._weight_int4pack_mm_for_cpu.default" in ops


def test_what_the_machine_allows_is_part_of_the_compile_cache_key(monkeypatch):
    """A graph compiled where hf_aoq's extension ran calls its ops; reused from torch's on-disk
    cache where the extension is off, it failed ('NoneType' object has no attribute
    'int8_linear_io'). The capabilities are in the key, so it is compiled afresh."""
    q = Int8Tensor.from_float(torch.randn(32, 64)).place()
    key = q._stable_hash_for_caching()
    assert f"cpu:hf_aoq_ext={int(cpu_ext.available())}" in registry.compile_key().split(",")
    index = ("cpu:hf_aoq_ext", "cpu", -1)
    monkeypatch.setitem(registry._CAPABLE, index, not registry._CAPABLE[index])
    assert q._stable_hash_for_caching() != key


def test_a_checkpoint_never_names_the_int8_packing(tmp_path):
    """Placement packs Int8Tensor on CPU now; what is saved stays canonical, and metadata that
    names a packing is refused like Int4Tensor's."""
    import json

    from hf_aoq.core.errors import FormatError
    from hf_aoq.serialization import METADATA_KEY, flatten_state_dict, unflatten_state_dict

    placed = Int8Tensor.from_float(torch.randn(32, 64)).place()
    assert placed.packing == "cpu_int8_aligned"
    tensors, metadata = flatten_state_dict({"w": placed})
    doc = json.loads(metadata[METADATA_KEY])
    assert "packing" not in doc["tensors"]["w"]["attributes"]
    assert unflatten_state_dict(tensors, metadata)["w"].packing is None
    doc["tensors"]["w"]["attributes"]["packing"] = ["enum", "cpu_int8_aligned"]
    with pytest.raises(FormatError, match="unknown Int8Tensor.packing value 'cpu_int8_aligned'"):
        unflatten_state_dict(tensors, {**metadata, METADATA_KEY: json.dumps(doc)})
