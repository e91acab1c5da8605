"""The kernel table remembers its choice per weight (registry.select_kernel) and each class its
resolved op tables (core/tensor.py `_lookup`): whatever a choice depends on, changed, makes the
next call choose again. Each test counts which row actually ran."""
import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

from hf_aoq import Int4Tensor, kernels
from hf_aoq.core.tensor import KERNEL_CACHE, _forget_resolved
from hf_aoq.kernels import cpu_amx, cpu_ext, cpu_gemm, registry
from test_kernel_table import scratch_table  # noqa: F401  (the fixture: rows registered here are gone after)

needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's C++ extension is not built here")


class CountedInt4(Int4Tensor):
    """A type of this test's own: rows registered for it leave Int4Tensor's alone."""


@pytest.fixture
def ran(scratch_table):
    """Every linear row of Int4Tensor and CountedInt4, wrapped to record its name when it runs."""
    names = []
    for key in [("linear", "Int4Tensor"), ("linear", "CountedInt4")]:
        rows = registry._KERNELS.get(key, [])
        rows[:] = [dataclasses.replace(k, fn=_counted(k, names)) for k in rows]
    registry._rebuild()
    return names


def _counted(kernel, names):
    def fn(*args):
        names.append(kernel.name)
        return kernel.fn(*args)
    return fn


def _register(name, priority, when=None, needs=(), value=1.0):
    def fn(x, w, bias):
        return torch.full((*x.shape[:-1], 16), value, dtype=x.dtype)
    kernels.register_kernel("linear", "CountedInt4", name, backend="cpu", priority=priority, device="cpu",
                            needs=needs, when=when)(_counted_by_name(name, fn))


_LOG: list[str] = []


def _counted_by_name(name, fn):
    def counted(x, w, bias):
        _LOG.append(name)
        return fn(x, w, bias)
    return counted


def _runs(x, w, n=3) -> list[str]:
    del _LOG[:]
    for _ in range(n):
        F.linear(x, w)
    return list(_LOG)


def _weight(cls=CountedInt4):
    return cls.from_float(torch.randn(16, 64), 32)


def test_the_choice_is_remembered_per_weight(scratch_table):
    calls = []
    _register("test_rows", 50, when=lambda x, w: calls.append(1) or True)
    w, x = _weight(), torch.randn(1, 64)
    assert _runs(x, w, 5) == ["test_rows"] * 5
    assert len(calls) == 1  # the condition was evaluated once, not on every call
    assert list(w.__dict__[KERNEL_CACHE][1].values()) == [kernels.select_kernel("linear", x, w)]


def test_row_count_dtype_shape_and_grad_mode_choose_again(scratch_table):
    _register("test_few_rows", 50, when=lambda x, w: x.numel() // x.shape[-1] <= 2)
    _register("test_bf16", 40, when=lambda x, w: x.dtype == torch.bfloat16)
    _register("test_no_grad", 30, when=lambda x, w: not torch.is_grad_enabled())
    w = _weight()
    assert _runs(torch.randn(1, 64), w) == ["test_few_rows"] * 3
    assert _runs(torch.randn(8, 64), w) == []  # grad enabled: none of these rows (the reference ran)
    assert _runs(torch.randn(8, 64, dtype=torch.bfloat16), w) == ["test_bf16"] * 3
    assert _runs(torch.randn(2, 1, 64), w) == ["test_few_rows"] * 3  # 2 rows as [2, 1, K]
    assert _runs(torch.randn(3, 1, 64), w) != ["test_few_rows"] * 3
    with torch.no_grad():
        assert _runs(torch.randn(8, 64), w) == ["test_no_grad"] * 3
    with torch.enable_grad():
        assert "test_no_grad" not in _runs(torch.randn(8, 64), w)
    assert _runs(torch.randn(1, 64), w) == ["test_few_rows"] * 3  # the first answer, still right


def test_a_row_registered_later_takes_effect(scratch_table):
    """A user's override (a new row of higher priority) runs from the next call on."""
    _register("test_old", 50)
    w, x = _weight(), torch.randn(1, 64)
    assert _runs(x, w) == ["test_old"] * 3
    _register("test_override", 60)
    assert _runs(x, w) == ["test_override"] * 3


def test_capabilities_probed_again_choose_again(scratch_table, monkeypatch):
    """A capability that reads an HF_AOQ_* variable: what forget_capabilities() re-reads is used."""
    cap = kernels.capability("test:env", "cpu", lambda d: bool(__import__("os").environ.get("HF_AOQ_TEST_FAST")))
    _register("test_fast", 60, needs=(cap,))
    _register("test_slow", 50)
    w, x = _weight(), torch.randn(1, 64)
    monkeypatch.setenv("HF_AOQ_TEST_FAST", "1")
    assert _runs(x, w) == ["test_fast"] * 3
    monkeypatch.delenv("HF_AOQ_TEST_FAST")
    registry.forget_capabilities()
    assert _runs(x, w) == ["test_slow"] * 3


def test_setting_a_field_chooses_again(scratch_table):
    _register("test_weight_only", 50, when=lambda x, w: w.act_quant is None)
    _register("test_dynamic", 40)
    w, x = _weight(), torch.randn(1, 64)
    assert _runs(x, w) == ["test_weight_only"] * 3
    w.act_quant, w.act_dtype = "per_token", torch.int8
    assert _runs(x, w) == ["test_dynamic"] * 3


def test_another_device_chooses_again(scratch_table):
    _register("test_cpu", 50)
    w = _weight()
    assert _runs(torch.randn(1, 64), w) == ["test_cpu"] * 3
    assert kernels.select_kernel("linear", torch.randn(1, 64, device="meta"), w).name == "reference"
    assert _runs(torch.randn(1, 64), w) == ["test_cpu"] * 3


def test_pickle_and_deepcopy_leave_the_choices_out(scratch_table):
    # A row whose condition is a lambda: the choices could not be pickled.
    _register("test_lambda", 50, when=lambda x, w: True)
    w, x = _weight(), torch.randn(1, 64)
    F.linear(x, w)
    assert KERNEL_CACHE in w.__dict__
    back = pickle.loads(pickle.dumps(w))
    assert KERNEL_CACHE not in back.__dict__ and torch.equal(back.qdata, w.qdata)
    buf = io.BytesIO()
    torch.save(w, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True).qdata, w.qdata)
    twin = copy.deepcopy(w)
    assert KERNEL_CACHE not in twin.__dict__
    assert _runs(x, twin) == ["test_lambda"] * 3


# ---------------------------------------------------------------------- the real rows
@needs_ext
def test_placed_int4_rows_follow_dtype_rows_fields_and_the_isa_variable(ran, monkeypatch):
    w = Int4Tensor.from_float(torch.randn(64, 256, dtype=torch.bfloat16), 128).place()
    x1 = torch.randn(1, 1, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(3):
            F.linear(x1, w)
        assert ran == ["cpu_int4_ext"] * 3
        del ran[:]
        many = torch.randn(1, max(cpu_gemm.min_rows("int4"), cpu_amx.MIN_ROWS["int4"],
                                  cpu_amx.MIN_ROWS_AVX512_BF16["int4"]), 256, dtype=torch.bfloat16)
        F.linear(many, w)
        cpu = torch.device("cpu")
        if registry.capable((cpu_amx.CPU_EXT, cpu_amx.AMX), cpu):
            want = "cpu_int4_amx"
        elif registry.capable((cpu_amx.CPU_EXT, cpu_amx.AVX512_BF16), cpu):
            want = "cpu_int4_avx512bf16"
        else:
            want = "cpu_int4_bf16_gemm" if registry.capable(cpu_gemm._NEEDS, cpu) else "cpu_int4_ext"
        assert ran == [want]
        if want != "cpu_int4_ext":  # HF_AOQ_CPU_ISA=none takes AVX-512 and AMX away once probed again
            monkeypatch.setenv("HF_AOQ_CPU_ISA", "none")
            registry.forget_capabilities()
            del ran[:]
            F.linear(many, w)
            assert ran == ["cpu_int4_ext"]
            monkeypatch.delenv("HF_AOQ_CPU_ISA")
            registry.forget_capabilities()
        del ran[:]
        w.act_quant, w.act_dtype = "per_token", torch.int8
        F.linear(x1, w)
        assert ran == ["cpu_int8_int4_ext"]
        del ran[:]
        w2 = Int4Tensor.from_float(torch.randn(64, 256, dtype=torch.bfloat16), 128)  # canonical: no CPU row reads it
        F.linear(x1, w2)
        assert ran == ["reference"]


# ---------------------------------------------------------------------- the op tables
class OpsBase(Int4Tensor):
    pass


class OpsLeaf(OpsBase):
    pass


def test_an_op_registered_after_a_call_is_found():
    w, x = OpsLeaf.from_float(torch.randn(16, 64), 32), torch.randn(1, 64)
    expected = F.linear(x, w.dequantize())
    assert torch.allclose(F.linear(x, w), expected, atol=1e-5)  # BlockGridTensor's F.linear, resolved
    marker = torch.full((1, 16), 7.0)
    try:
        OpsBase.implements_torch_function(F.linear)(lambda func, types, args, kwargs: marker)
        assert F.linear(x, w) is marker  # the base's new entry reaches the leaf already resolved
        OpsLeaf.implements_torch_function(F.linear)(lambda func, types, args, kwargs: marker * 2)
        assert torch.equal(F.linear(x, w), marker * 2)
    finally:
        OpsBase._torch_fn_table.clear()
        OpsLeaf._torch_fn_table.clear()
        _forget_resolved()
    assert torch.allclose(F.linear(x, w), expected, atol=1e-5)
