"""hf_aoq's opaque ops under torch.compile with autograd enabled: the output is non-differentiable,
as the eager call's is (C++ fills it), instead of the compile failing for want of a backward."""
import torch

from hf_aoq import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
from hf_aoq.kernels import cpu_ext

from models import tiny_model


def test_compile_with_grad_enabled_runs_like_eager():
    model = quantize_(tiny_model(torch.float32), Int8WeightOnlyConfig())
    lin = quantize_(torch.nn.Linear(128, 64), Int4WeightOnlyConfig(32))
    x = torch.randn(2, 128, requires_grad=True)
    ids = torch.tensor([[1, 5, 9, 77]])
    torch._dynamo.reset()
    assert torch.is_grad_enabled()
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(ids)  # failed: no autograd formula
    assert torch.allclose(got, model(ids), rtol=1e-4, atol=1e-4)
    y = torch.compile(lin, backend="aot_eager", fullgraph=True)(x)
    assert torch.allclose(y, lin(x), rtol=1e-4, atol=1e-4)
    if cpu_ext.available():  # hf_aoq's C++ rows: no gradient reaches x, eager or compiled
        assert not lin(x).requires_grad and not y.requires_grad
