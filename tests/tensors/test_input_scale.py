"""Int4Tensor and Int4DQTensor with the optional `input_scale` s (AWQ scales that could not fold):
every linear kernel row that runs here computes (x / s) @ Wq^T, as the reference formula does,
eager and compiled; dequantize() is Wq / s; the field saves and loads bit-exactly; checkpoints
without it are unchanged (tests/serialization's fixtures). tests/kernels/test_no_cpu_ext.py runs
this module again without the C++ extension (aten's int4 rows instead of hf_aoq's)."""
import pytest
import torch
import torch.nn.functional as F

from hf_aoq import AOQError, Int4DQTensor, Int4Tensor, Int8Tensor, kernels
from hf_aoq.kernels import cpu_ext
from hf_aoq.kernels.registry import _PACKINGS
from hf_aoq.serialization import load_file, save_file
from hf_aoq.tensors.common import with_input_scale

TYPES = {
    "int4_asym_g32": lambda w: Int4Tensor.from_float(w, 32),
    "int4_sym_g128_partial": lambda w: Int4Tensor.from_float(w, 128, symmetric=True),
    "int4dq_g32": lambda w: Int4DQTensor.from_float(w, 32),
}


def scaled_weight(kind, dtype, n=48, k=320, seed=0):
    """(weight with input_scale, the same codes without it, s)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    s = torch.exp(torch.randn(k, generator=g) * 0.7)
    inner = TYPES[kind]((w.float() * s).to(dtype))
    return with_input_scale(inner, s), inner, s


def versions(q):
    """The canonical weight and every CPU packing of it that can be made here."""
    yield q
    for p in _PACKINGS.values():
        if p.type_name == type(q).__name__ and p.device_type == "cpu" and p.available(q) \
                and kernels.capable(p.needs, torch.device("cpu")):
            yield p.pack(q)


def reference_formula(x, inner, s):
    """y = (x / s) @ Wq^T: x / s in float32, rounded to x's dtype, then the float matmul."""
    xs = (x.float() / s).to(x.dtype)
    return F.linear(xs.float(), inner.dequantize(torch.float32))


@pytest.mark.parametrize("kind", sorted(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_row_computes_x_over_s_times_the_codes(kind, dtype, monkeypatch):
    q, inner, s = scaled_weight(kind, dtype)
    ran = set()
    for m in (1, 5):
        x = torch.randn(m, q.shape[1], generator=torch.Generator().manual_seed(m)).to(dtype)
        want = reference_formula(x, inner, s)
        for w in versions(q):
            for row in kernels.kernels_for("linear", type(q).__name__):
                stripped = w.replace(input_scale=None)
                if not row.applies(x, stripped):
                    continue
                monkeypatch.setattr(kernels, "select_kernel", lambda op, x, w, row=row: row)
                got = F.linear(x, w)
                # Exactly the row on x / s and the weight without its scales ...
                assert torch.equal(got, row.fn((x.float() / s).to(dtype), stripped, None)), row.name
                # ... and the reference formula within the row's precision.
                tol = 2e-2 if dtype == torch.bfloat16 or "int16" in row.name or "ext" in row.name else 1e-3
                torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
                ran.add((row.name, w.packing))
                monkeypatch.undo()
    assert ("reference", None) in ran, ran
    if cpu_ext.available() or type(q) is Int4Tensor:  # Int4DQ's only fast CPU row is the extension's
        assert len(ran) >= 2, ran


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_compiled_forward_equals_eager(kind):
    if "dq" in kind and not cpu_ext.available():  # as tests/kernels/test_kernel_table.py
        pytest.xfail("Int4DQTensor.dequantize indexes a module-level tensor (LUT), which torch.compile refuses")
    q, inner, s = scaled_weight(kind, torch.bfloat16)
    w = q.place()
    assert w.input_scale is not None
    x = torch.randn(3, q.shape[1]).to(torch.bfloat16)
    eager = F.linear(x, w)
    compiled = torch.compile(lambda x: F.linear(x, w), fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(eager.float(), reference_formula(x, inner, s), rtol=2e-2,
                               atol=2e-2 * eager.abs().max().item())


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_dequantize_is_the_codes_over_s_and_matches_the_forward(kind):
    q, inner, s = scaled_weight(kind, torch.float32)
    torch.testing.assert_close(q.dequantize(), inner.dequantize() / s, rtol=1e-6, atol=1e-7)
    x = torch.randn(4, q.shape[1])
    torch.testing.assert_close(F.linear(x, q.dequantize()), reference_formula(x, inner, s), rtol=1e-4, atol=1e-4)
    # Without the scales the codes are those of W * s: dequantize() must differ from them.
    assert not torch.allclose(q.dequantize(), inner.dequantize(), atol=1e-3)
    # Slices along K take the matching scales.
    k = 128 if "dq" in kind or "g32" in kind else q.shape[1]
    torch.testing.assert_close(q[:, :k].dequantize(), q.dequantize()[:, :k])


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_save_and_load_are_bit_exact_and_placed_weights_save_canonical(kind, tmp_path):
    q, _, s = scaled_weight(kind, torch.bfloat16)
    save_file({"w": q.place()}, tmp_path / "a.safetensors")
    got = load_file(tmp_path / "a.safetensors")["w"]
    assert torch.equal(got.input_scale, s.float())
    c = got.to_canonical()
    for name, t in q.tensor_fields().items():
        assert torch.equal(c.tensor_fields()[name], t), name
    x = torch.randn(2, q.shape[1]).to(torch.bfloat16)
    assert torch.equal(F.linear(x, got), F.linear(x, q.place()))


def test_bad_input_scales_are_refused_naming_the_field():
    q, inner, s = scaled_weight("int4_asym_g32", torch.bfloat16)
    with pytest.raises(AOQError, match=r"field 'input_scale': torch.float32 \(319,\), expected torch.float32 \(320,\)"):
        with_input_scale(inner, s[:-1])
    with pytest.raises(AOQError, match="field 'input_scale': expected finite positive numbers"):
        with_input_scale(inner, -s)
    with pytest.raises(AOQError, match="Int8Tensor has no input_scale field"):
        with_input_scale(Int8Tensor.from_float(torch.randn(8, 32)), torch.ones(32))
    with pytest.raises(AOQError, match="field 'input_scale': torch.bfloat16"):
        Int4Tensor.check_fields(inner.replace(input_scale=s.to(torch.bfloat16)).fields())


def test_exports_refuse_weights_with_input_scales():
    from hf_aoq.convert import compressed_tensors, gguf

    q, _, _ = scaled_weight("int4_asym_g32", torch.bfloat16, k=128)
    for module in (gguf, compressed_tensors):
        with pytest.raises(Exception, match="input_scale"):
            module.export_tensor(q)
