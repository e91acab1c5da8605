"""hf_aoq's GEMV for plain bf16 weights (csrc/dense.cpp, kernels/cpu_dense.py) and DenseLinear, the
nn.Linear that runs it (hf_aoq/dense_linear.py): within float32 accumulation of the exact product,
one rounding to bf16, on every path (one row in blocks of four, several rows in tiles, column
tails, an N below four); DenseLinear takes it only where it applies and keeps nn.Linear's state;
quantizing a model routes the linears it leaves in bf16, and nothing it saves changes. The AVX2 and
AVX-512 builds give the same bits (tests/kernels/test_cpu_isa.py, slow)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_aoq import Int8WeightOnlyConfig, quantize_
from hf_aoq.dense_linear import DenseLinear, route_dense_linears
from hf_aoq.kernels import cpu_dense, cpu_ext, registry

SIMD = cpu_ext.available() and cpu_ext.chosen_isa() in ("avx2", "avx512")
needs_simd = pytest.mark.skipif(not SIMD, reason="hf_aoq's C++ extension with vector kernels is not built here "
                                                 f"({cpu_ext.chosen_isa() if cpu_ext.available() else 'none'})")


def _within_fp32_accumulation(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    exact = x.double() @ w.double().t()
    if bias is not None:
        exact = exact + bias.double()
    magnitude = x.double().abs() @ w.double().abs().t()
    bound = exact.abs() * 2.0 ** -8 + magnitude * x.shape[-1] * 2.0 ** -24 + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


@needs_simd
@pytest.mark.parametrize("n, k", [(64, 256), (102, 200), (3, 50), (4, 16), (37, 1040)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_gemv_is_the_product_within_float32_accumulation(n, k, rows):
    torch.manual_seed(n * k + rows)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    for b in (None, bias):
        y = cpu_dense.dense_linear(x, w, b)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        _within_fp32_accumulation(y, x, w, b)
    # Leading dimensions, as F.linear takes them; float32 and float16 rows come back in their dtype.
    y3 = cpu_dense.dense_linear(x.reshape(1, rows, k), w, None)
    assert y3.shape == (1, rows, n) and torch.equal(y3[0], cpu_dense.dense_linear(x, w, None))
    for dtype in (torch.float32, torch.float16):
        yd = cpu_dense.dense_linear(x.to(dtype), w, None)
        assert yd.dtype == dtype
        torch.testing.assert_close(yd.float(), y3[0].float(), rtol=2 ** -7, atol=1e-2)


@needs_simd
def test_gemv_rows_do_not_depend_on_their_neighbours():
    # One row in blocks of four weight rows (the last block overlapping the one before): each
    # output is the same however the row's block falls; several rows in tiles: the same per row.
    torch.manual_seed(1)
    w = torch.randn(103, 96, dtype=torch.bfloat16)
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    one = cpu_dense.dense_linear(x[:1], w, None)
    assert torch.equal(cpu_dense.dense_linear(x[:1], w[5:], None), one[:, 5:])
    four = cpu_dense.dense_linear(x, w, None)
    assert torch.equal(cpu_dense.dense_linear(x[2:4], w, None), four[2:4])


@needs_simd
def test_bad_weights_are_clear_errors():
    ext = cpu_ext.load()
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        ext.dense_linear_io(x, torch.randn(8, 16), None)
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        ext.dense_linear_io(x, torch.randn(16, 8, dtype=torch.bfloat16).t(), None)
    with pytest.raises(RuntimeError, match=r"expected \[..., 32\]"):
        ext.dense_linear_io(x, torch.randn(8, 32, dtype=torch.bfloat16), None)


def _calls(monkeypatch) -> list:
    calls = []
    real = cpu_dense.dense_linear

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(cpu_dense, "dense_linear", spy)
    return calls


@needs_simd
def test_dense_linear_runs_the_gemv_only_where_it_applies(monkeypatch):
    torch.manual_seed(2)
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    route_dense_linears(lin)
    assert type(lin) is DenseLinear and isinstance(lin, nn.Linear)
    calls = _calls(monkeypatch)
    x = torch.randn(2, 2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = lin(x)
    assert calls == [x.shape]
    _within_fp32_accumulation(y.reshape(4, 48), x.reshape(4, 64), lin.weight, lin.bias)
    # Elsewhere nn.Linear's forward, bit for bit: more rows, float32, a gradient wanted.
    many = torch.randn(cpu_dense.MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(lin(many), F.linear(many, lin.weight, lin.bias))
    assert lin(x).requires_grad  # the weight wants a gradient: aten's linear, which has one
    lin32 = nn.Linear(64, 48)
    route_dense_linears(lin32)
    assert type(lin32) is nn.Linear  # only bf16 weights are routed
    assert calls == [x.shape]
    # Without the extension's vector build, never.
    monkeypatch.setattr(cpu_ext, "chosen_isa", lambda: "generic")
    registry.forget_capabilities()
    try:
        with torch.no_grad():
            assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        assert calls == [x.shape]
    finally:
        monkeypatch.undo()
        registry.forget_capabilities()


@needs_simd
def test_dense_linear_compiles_without_graph_breaks():
    torch.manual_seed(3)
    lin = nn.Linear(64, 40, bias=False).to(torch.bfloat16).requires_grad_(False)
    route_dense_linears(lin)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    compiled = torch.compile(lin, fullgraph=True)
    assert torch.equal(compiled(x), lin(x))


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as in many language models

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


def test_quantize_routes_the_linears_it_leaves_in_bf16_and_saves_the_same_state():
    torch.manual_seed(4)
    model = _TwoLinears().to(torch.bfloat16)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, name: name == "body")
    assert type(model.head) is DenseLinear and type(model.body) is nn.Linear  # body holds an Int8Tensor
    assert model.head.weight is model.embed.weight
    state = model.state_dict()
    assert set(state) == {"embed.weight", "body.weight", "body.bias", "head.weight"}
    assert route_dense_linears(model) == [] and type(model.head) is DenseLinear  # idempotent
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3]])
        h = model.body(model.embed(ids))
        _within_fp32_accumulation(model(ids).reshape(3, 50), h.reshape(3, 32), model.embed.weight)
    # A subclass of nn.Linear (someone else's forward) is left alone.
    class Mine(nn.Linear):
        pass

    mine = Mine(8, 8).to(torch.bfloat16)
    assert route_dense_linears(mine) == [] and type(mine) is Mine
