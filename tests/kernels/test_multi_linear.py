"""Several quantized weights of one input in one kernel call (csrc int4pack_linear_io_multi, the
op `hf_aoq::int4_linear_io_multi_cpu`), and the compiled-graph rewrite that puts it in place of a
layer's q, k and v calls (kernels/graph_passes.py).

The multi-weight call must give each weight's output bit for bit as the single call does: on the
int16 path (half-precision activations: one parallel region over all the weights' rows, the
AVX-512 64-row step, the 32-row block and the 16-row tail block all met across weight
boundaries), on the float32 path (one call after another), at GEMV and GEMM rows, with scales
of each dtype and of mixed dtypes, and with the input padded to whole groups."""
import operator

import pytest
import torch

from hf_aoq import Int4Tensor
from hf_aoq.kernels import cpu, cpu_ext, graph_passes

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's CPU extension is not built here")


def weights(rows, k, g, dtypes, seed=0):
    torch.manual_seed(seed)
    return [Int4Tensor.from_float((torch.randn(n, k) * 0.05).to(dt), g).place() for n, dt in zip(rows, dtypes)]


def single(x, w):
    return cpu.int4_linear_io.eager(x, w.qdata, w.scale, w.block_size[-1], w.shape[-1], None)


def multi(x, ws):
    return cpu.int4_linear_io_multi.eager(x, [w.qdata for w in ws], [w.scale for w in ws], ws[0].block_size[-1],
                                          ws[0].shape[-1])


# Rows per weight: q, k, v of a small GQA layer (two full 64-row steps, then 32-row blocks); tails
# of 16 rows in the middle of the list; one weight alone.
ROWS = [(256, 64, 64), (80, 48, 112, 16), (208,)]


@pytest.mark.parametrize("rows", ROWS, ids=str)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_each_output_is_the_single_calls_bit_for_bit(rows, x_dtype, m):
    k, g = 160, 32
    scale_dtypes = [torch.bfloat16] * len(rows)
    ws = weights(rows, k, g, scale_dtypes, seed=len(rows))
    x = torch.randn(2, m, k).to(x_dtype)
    x[0, 0, :g] *= 40  # an outlier group
    got = multi(x, ws)
    assert len(got) == len(ws)
    for w, y in zip(ws, got):
        expected = single(x, w)
        assert y.dtype == x_dtype and y.shape == (2, m, w.shape[0])
        assert torch.equal(y, expected)


@pytest.mark.parametrize("scale_dtypes", [(torch.float32,) * 3, (torch.float16,) * 3,
                                          (torch.bfloat16, torch.float32, torch.float16)], ids=str)
def test_scale_dtypes_same_and_mixed_and_a_padded_input(scale_dtypes):
    k, g = 200, 64  # padded to 256 columns inside
    ws = weights((128, 64, 48), k, g, scale_dtypes, seed=3)
    assert all(w.scale.dtype == dt for w, dt in zip(ws, scale_dtypes))
    x = torch.randn(1, 1, k, dtype=torch.bfloat16)
    for w, y in zip(ws, multi(x, ws)):
        assert torch.equal(y, single(x, w))


def test_bad_arguments_name_what_was_expected():
    ws = weights((64, 64), 128, 32, (torch.bfloat16,) * 2)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    ext = cpu_ext.load()
    with pytest.raises(RuntimeError, match="one of each per weight"):
        ext.int4pack_linear_io_multi(x, [w.qdata for w in ws], [ws[0].scale], 32, 128, cpu.INT4_GEMV_MAX_ROWS)
    other = weights((64,), 256, 32, (torch.bfloat16,))[0]
    with pytest.raises(RuntimeError, match=r"packed\[1\]"):
        ext.int4pack_linear_io_multi(x, [ws[0].qdata, other.qdata], [ws[0].scale, other.scale], 32, 128,
                                     cpu.INT4_GEMV_MAX_ROWS)


def _qkv_graph(ws, k, g, bias=None):
    """An FX graph of three int4 linears of one input (q, k, v), one of another input and one with
    a bias: what the rewrite must fuse and what it must leave."""
    graph = torch.fx.Graph()
    x, x2 = graph.placeholder("x"), graph.placeholder("x2")
    args = [(graph.placeholder(f"p{i}"), graph.placeholder(f"s{i}")) for i in range(len(ws))]
    b = graph.placeholder("b")
    op = cpu.int4_linear_io.op
    outs = [graph.call_function(op, (x, p, s, g, k, None)) for p, s in args[:3]]
    outs.append(graph.call_function(op, (x2, *args[3], g, k, None)))  # another input
    outs.append(graph.call_function(op, (x, *args[4], g, k, b)))  # a bias
    graph.output(tuple(outs))
    return graph


def test_the_rewrite_fuses_linears_of_one_input_and_keeps_their_outputs():
    k, g = 128, 32
    ws = weights((256, 64, 64, 64, 64), k, g, (torch.bfloat16,) * 5, seed=5)
    graph = _qkv_graph(ws, k, g)
    before = torch.fx.GraphModule(torch.nn.Module(), graph)
    x, x2, bias = torch.randn(1, 1, k).bfloat16(), torch.randn(1, 1, k).bfloat16(), torch.randn(64).bfloat16()
    inputs = [x, x2, *[t for w in ws for t in (w.qdata, w.scale)], bias]
    expected = before(*inputs)

    fused_graph = _qkv_graph(ws, k, g)
    assert graph_passes.fuse_shared_input_linears(fused_graph) == 3
    targets = [n.target for n in fused_graph.nodes if n.op == "call_function"]
    assert targets.count(cpu.int4_linear_io_multi.op) == 1
    assert targets.count(cpu.int4_linear_io.op) == 2  # another input; a bias
    assert targets.count(operator.getitem) == 3
    fused_graph.lint()
    got = torch.fx.GraphModule(torch.nn.Module(), fused_graph)(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_pass_keys_inductors_cache_and_runs_a_configured_pass_after_it():
    seen = []

    class Theirs(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            seen.append([n.target for n in graph.nodes if n.op == "call_function"])

        def uuid(self):
            return "theirs"

    k, g = 128, 32
    ws = weights((64,) * 5, k, g, (torch.bfloat16,) * 5)
    both = graph_passes.SharedInputLinears(Theirs())
    both(_qkv_graph(ws, k, g))
    assert cpu.int4_linear_io_multi.op in seen[0]  # theirs saw the rewritten graph
    assert both.uuid()[1] == "theirs" and graph_passes.SharedInputLinears().uuid() == both.uuid()[0]
