"""AOQTensor: what the base class derives from the four declared field lists."""
import io
import sys
import types

import pytest
import torch

from hf_aoq import AOQError, AOQTensor, Float8Tensor, Int4Tensor, Int8Tensor
from hf_aoq.core.tensor import aten


class Scaled(AOQTensor):
    """A minimal tensor type: w = qdata * scale (+ bias_term), for exercising the base class."""

    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("block_size", "shape", "dtype")
    optional_tensor_data_names = ("bias_term",)
    optional_tensor_attribute_names = ("note",)

    def dequantize(self, dtype=None):
        w = self.qdata.float() * self.scale
        if self.bias_term is not None:
            w = w + self.bias_term
        return w.to(dtype or self.dtype)


def make(**kw):
    return Scaled(torch.arange(6, dtype=torch.int8).view(2, 3), torch.tensor([[0.5], [2.0]]), (1, 3), (2, 3),
                  torch.bfloat16, **kw)


def test_constructor_order_and_defaults():
    t = make()
    assert t.shape == (2, 3) and t.dtype == torch.bfloat16
    assert t.bias_term is None and t.note is None
    assert list(t.fields()) == ["qdata", "scale", "block_size", "shape", "dtype", "bias_term", "note"]
    positional = Scaled(t.qdata, t.scale, (1, 3), (2, 3), torch.bfloat16, torch.ones(2, 3), "hi")
    assert positional.note == "hi" and torch.equal(positional.bias_term, torch.ones(2, 3))


def test_constructor_errors_name_the_field():
    with pytest.raises(TypeError, match=r"missing required field\(s\) \['scale'\]"):
        Scaled(torch.zeros(2, 3), block_size=(1, 3), shape=(2, 3), dtype=torch.float32)
    with pytest.raises(TypeError, match="no field 'bogus'"):
        make(bogus=1)
    with pytest.raises(TypeError, match="'bias_term' must be a tensor"):
        make(bias_term=3)


def test_declarations_are_checked_at_class_creation():
    with pytest.raises(TypeError, match="must include"):
        type("NoShape", (AOQTensor,), {"tensor_data_names": ("qdata",), "tensor_attribute_names": ("dtype",)})
    with pytest.raises(TypeError, match="shadows a torch.Tensor attribute"):
        type("Shadow", (AOQTensor,), {"tensor_data_names": ("qdata",),
                                      "tensor_attribute_names": ("shape", "dtype"),
                                      "optional_tensor_attribute_names": ("layout",)})
    with pytest.raises(TypeError, match="declared twice"):
        type("Twice", (AOQTensor,), {"tensor_data_names": ("qdata", "qdata"),
                                     "tensor_attribute_names": ("shape", "dtype")})


def test_flatten_unflatten_defaults_missing_optional_attributes():
    t = make(bias_term=torch.zeros(2, 3), note="x")
    names, ctx = t.__tensor_flatten__()
    assert names == ["qdata", "scale", "bias_term"]
    inner = {n: getattr(t, n) for n in names}
    back = Scaled.__tensor_unflatten__(inner, ctx, t.shape, t.stride())
    assert back.note == "x" and torch.equal(back.bias_term, t.bias_term)
    # A context from before `note` existed: the attribute takes its default, no KeyError.
    old_ctx = tuple(kv for kv in ctx if kv[0] != "note")
    old = Scaled.__tensor_unflatten__({"qdata": t.qdata, "scale": t.scale}, old_ctx, t.shape, t.stride())
    assert old.note is None and old.bias_term is None


def test_repr_names_every_field():
    r = repr(make(note="n"))
    assert r.startswith("Scaled(") and "qdata=<int8 [2, 3]>" in r and "note=n" in r and "shape=[2, 3]" in r


def test_apply_to_tensors_and_replace():
    t = make(bias_term=torch.ones(2, 3))
    doubled = t.apply_to_tensors(lambda x: x * 2)
    assert torch.equal(doubled.scale, t.scale * 2) and torch.equal(doubled.bias_term, t.bias_term * 2)
    assert doubled.block_size == t.block_size
    assert t.replace(note="z").note == "z"


def test_detach_clone_alias_contiguous():
    t = make()
    for out in (t.detach(), t.clone(), aten.alias.default(t), t.contiguous()):
        assert type(out) is Scaled and torch.equal(out.dequantize(), t.dequantize())
    c = t.clone()
    assert c.qdata.data_ptr() != t.qdata.data_ptr()
    d = t.detach()
    assert d.qdata.data_ptr() == t.qdata.data_ptr()


def test_copy_between_same_metadata_and_error_otherwise():
    dst = make()
    src = dst.apply_to_tensors(lambda x: x + 1)
    dst.copy_(src)
    assert torch.equal(dst.qdata, src.qdata)
    other = Scaled(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2, 1), (1, 4), (2, 4), torch.bfloat16)
    with pytest.raises(AOQError, match="same type, attributes and field shapes"):
        dst.copy_(other)
    with pytest.raises(AOQError):
        dst.copy_(torch.zeros(2, 3))


def test_to_device_and_dtype():
    t = make()
    same = t.to("cpu")
    assert type(same) is Scaled
    f32 = t.to(torch.float32)
    assert f32.dtype == torch.float32 and f32.dequantize().dtype == torch.float32
    assert torch.equal(f32.dequantize(), t.dequantize(torch.float32))
    with pytest.raises(AOQError, match="only a floating dtype"):
        t.to(torch.int8)


def test_unsupported_op_names_op_and_type():
    with pytest.raises(NotImplementedError, match=r"Scaled does not support the op aten\.sum"):
        aten.sum.default(make())


def test_op_tables_are_inherited_and_overridable():
    class Child(Scaled):
        pass

    calls = []

    @Child.implements(aten.clone.default)
    def _clone(func, types, args, kwargs):
        calls.append("child")
        return args[0]

    c = Child(*make().fields().values())
    assert c.detach() is not c  # inherited from AOQTensor's table
    c.clone()
    assert calls == ["child"]
    make().clone()  # the parent's table is untouched
    assert calls == ["child"]


def _module_with(cls_v):
    mod = types.ModuleType("hf_aoq_bc_demo")
    mod.Demo = cls_v
    cls_v.__module__ = "hf_aoq_bc_demo"
    cls_v.__qualname__ = "Demo"
    return mod


def test_pickle_bc_optional_fields_added_later(monkeypatch):
    """The seeds' scenario: pickle a tensor, then the type gains an optional tensor and an
    optional attribute; the old pickle loads with both defaulted, through weights_only too."""
    v1 = type("Demo", (AOQTensor,), {
        "tensor_data_names": ("qdata", "scale"),
        "tensor_attribute_names": ("shape", "dtype"),
        "dequantize": lambda self, dtype=None: (self.qdata.float() * self.scale).to(dtype or self.dtype),
    })
    monkeypatch.setitem(sys.modules, "hf_aoq_bc_demo", _module_with(v1))
    old = v1(torch.ones(2, 2, dtype=torch.int8), torch.full((2, 1), 3.0), (2, 2), torch.float32)
    buf = io.BytesIO()
    torch.save({"w": old}, buf)
    # In real life the old class is gone once the new one ships; here both live in one process,
    # so rename the old one lest the allow-list resolve the stored name to it.
    v1.__module__ = "hf_aoq_bc_demo_retired"

    v2 = type("Demo", (AOQTensor,), {
        "tensor_data_names": ("qdata", "scale"),
        "tensor_attribute_names": ("shape", "dtype"),
        "optional_tensor_data_names": ("act_scale",),
        "optional_tensor_attribute_names": ("act_mode",),
        # A class-level value of the same name must not stand in for the instance field.
        "act_mode": "class-level",
        "dequantize": v1.dequantize,
    })
    monkeypatch.setitem(sys.modules, "hf_aoq_bc_demo", _module_with(v2))
    for weights_only in (True, False):
        buf.seek(0)
        new = torch.load(buf, weights_only=weights_only)["w"]
        assert type(new) is v2
        assert new.act_scale is None
        assert new.__dict__["act_mode"] is None and new.act_mode is None
        assert torch.equal(new.dequantize(), torch.full((2, 2), 3.0))


@pytest.mark.parametrize("make_tensor", [
    lambda w: Int4Tensor.from_float(w, 32).place(),
    lambda w: Int4Tensor.from_float(w, 32),
    lambda w: Int8Tensor.from_float(w, None, act_quant="per_token"),
    lambda w: Float8Tensor.from_float(w),
])
def test_real_types_survive_torch_save_weights_only(make_tensor):
    w = torch.randn(16, 64, dtype=torch.bfloat16)
    t = make_tensor(w)
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["w"]
    assert type(back) is type(t) and back.attributes() == t.attributes()
    assert torch.equal(back.dequantize(), t.dequantize())


def test_schema_version_is_declared():
    for cls in (Int4Tensor, Int8Tensor, Float8Tensor):
        assert isinstance(cls.schema_version, int) and cls.schema_version >= 1
