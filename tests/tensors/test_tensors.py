"""Int4Tensor, Int8Tensor, Float8Tensor: numerics, every kernel against the reference, ops."""
import pytest
import torch
import torch.nn.functional as F

from hf_aoq import (
    AOQError,
    Float8DynamicActivationFloat8WeightConfig,
    Float8Tensor,
    Float8WeightOnlyConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8Tensor,
    Int8WeightOnlyConfig,
    PerRow,
    PerTensor,
    kernels,
)

from conftest import cpu_int4_packing, sqnr

# Weight SQNR floors on N(0, 1) weights (seeded), in dB: the measured values less about 1 dB,
# so a regression in parameter choice fails. Uniform quantization gains ~6 dB per bit.
CONFIGS = [
    (Int4WeightOnlyConfig(32), 21.0),
    (Int4WeightOnlyConfig(64), 20.0),
    (Int4WeightOnlyConfig(128), 19.0),
    (Int4WeightOnlyConfig(256), 18.2),
    (Int4WeightOnlyConfig(128, symmetric=True), 18.0),
    (Int8WeightOnlyConfig(), 41.3),
    (Int8WeightOnlyConfig(group_size=64), 43.3),
    (Int8DynamicActivationInt8WeightConfig(), 41.3),
    (Float8WeightOnlyConfig(), 30.5),
    (Float8WeightOnlyConfig(torch.float8_e5m2), 24.6),
    (Float8WeightOnlyConfig(granularity=PerTensor()), 30.5),
    (Float8DynamicActivationFloat8WeightConfig(), 30.5),
    (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()), 30.5),
    (Float8DynamicActivationFloat8WeightConfig(torch.float8_e5m2, torch.float8_e5m2), 24.6),
]
IDS = [f"{type(c).__name__}-{i}" for i, (c, _) in enumerate(CONFIGS)]


@pytest.fixture(scope="module")
def weight():
    torch.manual_seed(0)
    return torch.randn(256, 512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config,floor", CONFIGS, ids=IDS)
def test_weight_sqnr(config, floor, weight, dtype):
    w = weight.to(dtype)
    q = config.quantize_weight(w)
    assert q.shape == w.shape and q.dtype == dtype
    dq = q.dequantize()
    assert dq.dtype == dtype and type(dq) is torch.Tensor
    assert sqnr(w, dq) > floor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config,floor", CONFIGS, ids=IDS)
def test_linear_against_float_and_every_kernel_against_reference(config, floor, weight, dtype):
    torch.manual_seed(1)
    w = weight.to(dtype)
    bias = torch.randn(256, dtype=dtype)
    q = config.quantize_weight(w).place()
    for shape in [(1, 512), (3, 7, 512)]:
        x = torch.randn(*shape, dtype=dtype)
        y = F.linear(x, q, bias)
        assert y.shape == (*shape[:-1], 256) and y.dtype == dtype
        # Against the float layer: dynamic activation quantization costs a few dB more.
        assert sqnr(F.linear(x, w, bias), y) > floor - 4
        ran = 0
        reference = kernels.kernels_for("linear", type(q).__name__)[-1]
        assert reference.name == "reference"
        expected = reference.fn(x, q, bias)
        for kernel in kernels.kernels_for("linear", type(q).__name__):
            if kernel.applies(x, q):
                # Fast kernels accumulate differently; 40 dB is 1% RMS error relative to the output.
                assert sqnr(expected, kernel.fn(x, q, bias)) > (40 if dtype == torch.bfloat16 else 60), kernel.name
                ran += 1
        assert ran >= 1


@pytest.mark.parametrize("k,g", [(576, 128), (96, 64), (48, 128), (320, 256)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_partial_last_group(k, g, symmetric):
    """K not a multiple of the group size: the last group is partial, the packings pad it and
    every kernel agrees with the reference; packing, slicing and lookup stay exact."""
    torch.manual_seed(0)
    w = torch.randn(32, k, dtype=torch.bfloat16)
    q = Int4Tensor.from_float(w, g, symmetric)
    groups = -(-k // g)
    assert q.scale.shape == (32, groups) and q.qdata.shape == (32, k // 2)
    full = q.dequantize()
    assert sqnr(w, full) > 18
    # The last group is quantized on its own, exactly as a tensor of just those columns.
    tail = (groups - 1) * g
    alone = Int4Tensor.from_float(w[:, tail:], g, symmetric)
    assert torch.equal(full[:, tail:], alone.dequantize())
    assert torch.equal(q[:, tail:].dequantize(), full[:, tail:])
    placed = q.place()
    assert placed.packing == cpu_int4_packing()
    # aten's packing and kernel too: the fallback where hf_aoq's extension does not build.
    aten_packed = kernels.get_packing("cpu_int4pack").pack(q)
    for p in (placed, aten_packed):
        back = p.to_canonical()
        for name, t in q.tensor_fields().items():
            assert torch.equal(t, getattr(back, name)), (p.packing, name)
    for shape in [(1, k), (3, 5, k)]:
        x = torch.randn(*shape, dtype=torch.bfloat16)
        expected = kernels.kernels_for("linear", "Int4Tensor")[-1].fn(x, q, None)
        for p in (placed, aten_packed):
            # Every CPU kernel for the packing (hf_aoq's own for its pairs layout, aten's for its own).
            fast = [kn for kn in kernels.kernels_for("linear", "Int4Tensor") if kn.backend == "cpu" and kn.applies(x, p)]
            assert [kn.name for kn in fast] == [{"cpu_int4_pairs": "cpu_int4_ext", "cpu_int4pack": "cpu_int4pack_mm"}[p.packing]]
            assert kernels.select_kernel("linear", x, p) is fast[0]
            assert sqnr(expected, fast[0].fn(x, p, None)) > 40, p.packing
            assert sqnr(expected, F.linear(x, p)) > 40
    idx = torch.tensor([0, 31, 7])
    assert torch.equal(F.embedding(idx, q), full[idx])
    with pytest.raises(AOQError, match="align with its block size"):
        q[:, : tail + 2]


@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Float8WeightOnlyConfig()])
def test_embedding_lookup(config):
    torch.manual_seed(0)
    table = torch.randn(100, 64, dtype=torch.bfloat16)
    q = config.quantize_weight(table)
    idx = torch.tensor([[0, 5, 99], [5, 5, 1]])
    out = F.embedding(idx, q)
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    assert torch.equal(out, F.embedding(idx, q.dequantize()))
    assert kernels.select_kernel("embedding", idx, q).name == "rowgather"
    # A packed int4 table still looks up correctly, through the reference kernel.
    if isinstance(q, Int4Tensor):
        assert torch.equal(F.embedding(idx, q.place()), out)


@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Int8WeightOnlyConfig(32),
                                    Float8WeightOnlyConfig(), Float8WeightOnlyConfig(granularity=PerTensor())])
def test_slice_and_narrow_both_dims(config):
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    q = config.quantize_weight(w).place()
    full = q.dequantize()
    for sl in [(slice(16, 48), slice(None)), (slice(None), slice(32, 96)), (slice(8, 24), slice(64, 128))]:
        part = q[sl]
        assert type(part) is type(q) and part.shape == full[sl].shape
        assert torch.equal(part.dequantize(), full[sl])
    assert torch.equal(q.narrow(1, 0, 64).dequantize(), full[:, :64])
    assert torch.equal(q.narrow(0, 32, 32).dequantize(), full[32:])


def test_slice_that_splits_a_group_is_an_error():
    q = Int4Tensor.from_float(torch.randn(8, 128), 64)
    with pytest.raises(AOQError, match="align with its block size 64"):
        q[:, 10:70]
    with pytest.raises(AOQError, match="step 1"):
        q[::2]


@pytest.mark.parametrize("config", [Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig(),
                                    Float8WeightOnlyConfig(), Float8DynamicActivationFloat8WeightConfig()])
def test_mm_addmm_matmul_with_quantized_weight(config):
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    b = torch.randn(32)
    q = config.quantize_weight(w).place()
    x = torch.randn(4, 64)
    expected = F.linear(x, q, b)
    expected_nobias = F.linear(x, q)
    if isinstance(q, Int4Tensor):
        with pytest.raises(NotImplementedError, match="Int4Tensor does not support the op aten.t"):
            q.t()
        # As the right operand, an int4 weight is used as the matrix it stands for.
        assert torch.allclose(torch.matmul(x[:, :32], q), x[:, :32] @ q.dequantize(), atol=1e-5)
        return
    qt = q.t()
    assert qt.shape == (64, 32) and type(qt) is type(q)
    assert torch.allclose(torch.mm(x, qt), expected_nobias, atol=1e-5)
    assert torch.allclose(x @ qt, expected_nobias, atol=1e-5)
    assert torch.allclose(torch.matmul(x.unsqueeze(0), qt), expected_nobias.unsqueeze(0), atol=1e-5)
    assert torch.allclose(torch.addmm(b, x, qt), expected, atol=1e-5)
    assert torch.equal(qt.t().dequantize(), q.dequantize())


def test_from_float_bad_input_errors():
    w = torch.randn(16, 96)
    with pytest.raises(AOQError, match="layer.weight: int4 needs an even input dimension"):
        Int4Tensor.from_float(torch.randn(16, 95), 64, name="layer.weight")
    with pytest.raises(AOQError, match="must be one of"):
        Int4Tensor.from_float(w, 48)
    with pytest.raises(AOQError, match="must be one of"):
        Int4WeightOnlyConfig(group_size=100)
    w_nan = w.clone()
    w_nan[0, 0] = float("nan")
    for cfg in (Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Float8WeightOnlyConfig()):
        with pytest.raises(AOQError, match="layer.weight: cannot quantize a tensor with inf or nan"):
            cfg.quantize_weight(w_nan, name="layer.weight")
    with pytest.raises(AOQError, match="expected a float32, bfloat16 or float16 weight, got torch.int32"):
        Int8Tensor.from_float(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(AOQError, match="2-D"):
        Float8Tensor.from_float(torch.randn(4))
    with pytest.raises(AOQError, match=r"weight_dtype must be one of .*got torch.float16"):
        Float8WeightOnlyConfig(weight_dtype=torch.float16)
    with pytest.raises(AOQError, match="unsupported float8 dtype"):
        Float8Tensor.from_float(w, torch.float16)
    with pytest.raises(AOQError, match="already quantized"):
        Int8Tensor.from_float(Int8Tensor.from_float(w))
    with pytest.raises(AOQError, match="per-row weight scale"):
        Int8Tensor.from_float(w, 32, act_quant="per_token")


def test_dtype_change_is_honoured():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    for q in (Int4Tensor.from_float(w, 32).place(), Int8Tensor.from_float(w), Float8Tensor.from_float(w)):
        f32 = q.to(torch.float32)
        assert f32.dtype == torch.float32 and type(f32) is type(q)
        assert torch.equal(f32.dequantize(), q.dequantize(torch.float32))
        x = torch.randn(2, 64)
        assert F.linear(x, f32).dtype == torch.float32
        with pytest.raises(AOQError, match="floating dtype"):
            q.to(torch.int32)


def test_int8_per_token_activation_quantization_is_what_the_kernel_sees():
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    q = Int8Tensor.from_float(w, act_quant="per_token")
    x = torch.randn(3, 64)
    x[1] *= 100  # per-token scales: one loud row does not flatten the others
    xs = q.simulate_input_quantization(x)
    assert sqnr(x[0], xs[0]) > 38 and sqnr(x[2], xs[2]) > 38


# ---------------------------------------------------------------------- layouts a loader accepts
def _save_and_load(t, tmp_path, unchecked=False):
    """Save `t` and load it back; `unchecked` saves without the type's check (which save_file
    runs too), to write the file a loader must refuse."""
    from hf_aoq import serialization

    path = str(tmp_path / "t.safetensors")
    with pytest.MonkeyPatch.context() as m:
        if unchecked:
            m.setattr(type(t), "check_fields", classmethod(lambda cls, fields: None))
        serialization.save_file({"layer.weight": t}, path)
    return serialization.load_file(path)["layer.weight"]


def _layouts(n=32, k=256):
    """(label, tensor, expected error) for layouts no kernel runs, each built from its fields."""
    q4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    i8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    f8 = torch.randn(n, k).to(torch.float8_e4m3fn)
    ones = lambda *s: torch.ones(*s)  # noqa: E731
    return [
        ("int4 block (2, 32)", Int4Tensor(q4, ones(n // 2, k // 32), (2, 32), (n, k), torch.float32,
                                          zero=ones(n // 2, k // 32)), r"'block_size': \(2, 32\), expected \(1, g\)"),
        ("int4 per tensor", Int4Tensor(q4, ones(1, 1), (n, k), (n, k), torch.float32, zero=ones(1, 1)),
         r"'block_size': \(32, 256\), expected \(1, g\)"),
        ("int4 groups of 16", Int4Tensor(q4, ones(n, k // 16), (1, 16), (n, k), torch.float32), "'block_size'"),
        # 3-D [E, N, K] is fused experts (each expert a 2-D layout); a block across experts is not.
        ("int4 3-D block across experts", Int4Tensor(q4.reshape(2, n // 2, k // 2), ones(1, n // 2, k // 32), (2, 1, 32),
                                                     (2, n // 2, k), torch.float32), r"'block_size': \(2, 1, 32\)"),
        ("int4 4-D", Int4Tensor(q4.reshape(2, 2, n // 4, k // 2), ones(2, 2, n // 4, k // 32), (1, 1, 1, 32),
                                (2, 2, n // 4, k), torch.float32),
         r"'shape': Int4Tensor is a non-empty 2-D \[N, K\] weight or 3-D \[E, N, K\] experts"),
        ("int8 block (2, K)", Int8Tensor(i8, ones(n // 2, 1), (2, k), (n, k), torch.float32), "'block_size'"),
        ("int8 4-D", Int8Tensor(i8.reshape(2, 2, n // 4, k), ones(2, 2, n // 4, 1), (1, 1, 1, k), (2, 2, n // 4, k),
                                torch.float32), "'shape'"),
        ("int8 dynamic per group", Int8Tensor(i8, ones(n, k // 32), (1, 32), (n, k), torch.float32,
                                              act_quant="per_token"), "dynamic activations need one scale per row"),
        ("fp8 block (2, K)", Float8Tensor(f8, ones(n // 2, 1), (2, k), (n, k), torch.float32), "'block_size'"),
        ("fp8 groups of 32", Float8Tensor(f8, ones(n, k // 32), (1, 32), (n, k), torch.float32), "'block_size'"),
        ("fp8 3-D groups of 32", Float8Tensor(f8.reshape(2, n // 2, k), ones(2, n // 2, k // 32), (1, 1, 32),
                                              (2, n // 2, k), torch.float32), "'block_size'"),
        ("int8 empty", Int8Tensor(i8[:0], ones(0, 1), (1, k), (0, k), torch.float32), "'shape'"),
        # Codes no encoder writes for a weight, which the CPU kernels would read as finite numbers.
        ("fp8 NaN code", Float8Tensor(_with_code(f8, 0xFF), ones(n, 1), (1, k), (n, k), torch.float32),
         r"field 'qdata': 1 float8_e4m3fn codes are NaN \(the first at \(3, 17\)\)"),
        ("fp8 e5m2 inf code", Float8Tensor(_with_code(f8.float().to(torch.float8_e5m2), 0x7C), ones(1, 1), (n, k),
                                           (n, k), torch.float32),
         r"field 'qdata': 1 float8_e5m2 codes are inf or NaN \(the first at \(3, 17\)\)"),
    ]


def _with_code(f8: torch.Tensor, code: int) -> torch.Tensor:
    """A copy of float8 `f8` holding `code` at row 3, column 17."""
    out = f8.clone()
    out.view(torch.uint8)[3, 17] = code
    return out


@pytest.mark.parametrize("dtype, special", [
    (torch.float8_e4m3fn, [0x7F, 0xFF]),
    (torch.float8_e5m2, [0x7C, 0x7D, 0x7E, 0x7F, 0xFC, 0xFD, 0xFE, 0xFF]),
])
def test_float8_inf_and_nan_codes_are_refused_and_no_other(dtype, special, monkeypatch):
    # The CPU kernels read float8 codes with a bit trick that has no inf or NaN (csrc/fp8.cpp), so
    # a weight holding them would compute finite numbers where the reference computes NaN or inf:
    # the loader's check refuses them, counting them all and naming the first. Scanned in chunks
    # of 1000 bytes here, so that hits in several chunks are counted and the first one named.
    from hf_aoq.core import primitives

    monkeypatch.setattr(primitives, "_CODE_SCAN_CHUNK", 1000)
    others = torch.tensor([c for c in range(256) if c not in special], dtype=torch.uint8)
    fine = others.repeat(2 * 40 * 96 // len(others) + 1)[: 2 * 40 * 96].reshape(2, 40, 96)
    w = Float8Tensor(fine.view(dtype), torch.ones(2, 40, 1), (1, 1, 96), (2, 40, 96), torch.bfloat16)
    Float8Tensor.check_fields(w.fields())  # every other code, in every position
    for code in special:
        codes = fine.clone()
        codes[1, 30, 5] = codes[1, 33, 90] = codes[0, 2, 7] = code  # flat 6725, 7098, 199: chunks 6, 7, 0
        with pytest.raises(AOQError, match=rf"field 'qdata': 3 {str(dtype)[6:]} codes are (NaN|inf or NaN) \(the "
                                           r"first at \(0, 2, 7\)\); a stored float8 weight is finite"):
            Float8Tensor.check_fields(dict(w.fields(), qdata=codes.view(dtype)))
        codes[0, 2, 7] = fine[0, 2, 7]
        with pytest.raises(AOQError, match=r"field 'qdata': 2 .*\(the first at \(1, 30, 5\)\)"):
            Float8Tensor.check_fields(dict(w.fields(), qdata=codes.view(dtype)))


@pytest.mark.parametrize("case", range(len(_layouts())), ids=[label for label, _, _ in _layouts()])
def test_a_layout_no_kernel_runs_is_refused_at_load(case, tmp_path):
    from hf_aoq import FormatError

    _, t, message = _layouts()[case]
    with pytest.raises(FormatError, match=rf"tensor 'layer.weight', attribute {message}" if message[0] == "'"
                       else rf"tensor 'layer.weight', .*{message}"):
        _save_and_load(t, tmp_path, unchecked=True)


@pytest.mark.parametrize("case", range(len(_layouts())), ids=[label for label, _, _ in _layouts()])
def test_a_layout_the_loader_refuses_is_never_saved(case, tmp_path):
    # A tensor built by hand from its fields was saved in a layout load_file then refused.
    from hf_aoq import serialization

    _, t, message = _layouts()[case]
    path = tmp_path / "t.safetensors"
    with pytest.raises(AOQError, match=rf"<state dict>: tensor 'layer.weight', .*{message}.*so it is not saved"):
        serialization.save_file({"layer.weight": t}, str(path))
    assert not list(tmp_path.iterdir())  # nothing written, not even a temporary


def test_save_pretrained_refuses_a_layout_the_loader_refuses(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_aoq import AOQConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=AOQConfig(Int8WeightOnlyConfig()))
    n, k = model.model.layers[0].mlp.up_proj.weight.shape
    i8 = torch.zeros(n, k, dtype=torch.int8)
    bad = Int8Tensor(i8, torch.ones(n // 2, 1), (2, k), (n, k), torch.float32)  # one scale per two rows
    model.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(bad, requires_grad=False)
    with pytest.raises(AOQError, match=r"tensor 'model.layers.0.mlp.up_proj.weight', attribute 'block_size'"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


@pytest.mark.parametrize("config", [c for c, _ in CONFIGS] + [Int4WeightOnlyConfig(64, qparams="minmax")],
                         ids=IDS + ["minmax"])
def test_every_layout_from_float_makes_loads_and_runs(config, tmp_path):
    torch.manual_seed(0)
    w = torch.randn(32, 192)  # K = 192: a partial last group of 64 for groups of 128 and 256
    loaded = _save_and_load(config.quantize_weight(w, name="layer.weight"), tmp_path)
    x = torch.randn(3, 192)
    y = F.linear(x, loaded.place())
    reference = kernels.kernels_for("linear", type(loaded).__name__)[-1]
    assert torch.isfinite(y).all() and sqnr(reference.fn(x, loaded, None), y) > 40


def test_an_empty_weight_is_a_clear_error():
    for w in (torch.randn(0, 64), torch.randn(16, 0)):
        for config in (Int4WeightOnlyConfig(32), Int8WeightOnlyConfig(), Int8DynamicActivationInt8WeightConfig(),
                       Float8WeightOnlyConfig(), Float8WeightOnlyConfig(granularity=PerTensor())):
            with pytest.raises(AOQError, match=r"layer.weight: cannot quantize an empty weight of shape"):
                config.quantize_weight(w, name="layer.weight")


@pytest.mark.parametrize("config", [
    Int8DynamicActivationInt8WeightConfig(),
    Float8DynamicActivationFloat8WeightConfig(),
    Float8DynamicActivationFloat8WeightConfig(torch.float8_e5m2, torch.float8_e5m2),
], ids=["int8-dyn", "fp8-dyn", "fp8-dyn-e5m2"])
@pytest.mark.parametrize("rows", [2, 5, 40])
def test_a_nan_activation_row_leaves_the_other_rows_alone(config, rows):
    # Activations quantized per row: a NaN (or inf) in one row must not reach the others'
    # scales, in any kernel that applies (the CPU ones and the reference).
    torch.manual_seed(0)
    q = config.quantize_weight(torch.randn(64, 256)).place()
    x = torch.randn(rows, 256)
    bad = x.clone()
    bad[1, 3] = float("nan")
    bad[0, 7] = float("inf")
    ran = 0
    for kernel in kernels.kernels_for("linear", type(q).__name__):
        if kernel.applies(bad, q):
            clean, poisoned = kernel.fn(x, q, None), kernel.fn(bad, q, None)
            assert torch.equal(poisoned[2:], clean[2:]), kernel.name
            assert not torch.isfinite(poisoned[1]).all(), kernel.name
            ran += 1
    from hf_aoq.kernels import cpu_ext

    assert ran >= (2 if cpu_ext.available() else 1)  # a CPU kernel (fp8's needs the extension) and the reference


def test_int4_from_float_chooses_scales_as_the_config_does():
    torch.manual_seed(0)
    w = torch.randn(16, 256)
    assert torch.equal(Int4Tensor.from_float(w, 64).dequantize(), Int4WeightOnlyConfig(64).quantize_weight(w).dequantize())
    assert not torch.equal(Int4Tensor.from_float(w, 64).dequantize(),
                           Int4Tensor.from_float(w, 64, qparams="minmax").dequantize())
