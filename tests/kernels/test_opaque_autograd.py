"""hf_aoq's opaque ops under torch.compile with autograd enabled: the output is non-differentiable,
as the eager call's is (C++ fills it), instead of the compile failing for want of a backward."""
import pytest
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


def test_every_opaque_op_is_a_pt2_compliant_library_op_with_a_fake():
    from hf_aoq.kernels import registry

    ops = registry.opaque_ops()
    assert "hf_aoq::int4_linear_io_cpu" in ops and "hf_aoq::decode_attention_cpu" in ops
    for name, op in ops.items():
        assert op.qualname == name and op.op is getattr(torch.ops.hf_aoq, name.split("::")[1]).default
        assert torch.Tag.pt2_compliant_tag in op.op.tags, name
        assert torch._library.simple_registry.singleton.find(name).fake_impl.kernel is not None, name


@pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's C++ extension is not built here")
def test_opcheck_the_cpu_ops_schema_fake_and_autograd_registration():
    """torch.library.opcheck: the schema (no input mutated, the output aliases no input), the fake
    against the real output, the autograd registration and AOT dispatch, on a small int4 linear
    and a decode-attention call; inputs that require grad give outputs that do not."""
    from hf_aoq.kernels import cpu, cpu_attention

    w = quantize_(torch.nn.Linear(64, 48), Int4WeightOnlyConfig(32)).weight
    assert w.packing == "cpu_int4_pairs"
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    args = (x, w.qdata, w.scale, 32, 64, None, cpu.INT4_GEMV_MAX_ROWS)
    torch.library.opcheck(cpu.int4_linear_io.op, args)
    q = torch.randn(1, 8, 1, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    torch.library.opcheck(cpu_attention.decode_attention.op, (q, k, v, None, 0.25))
    out = cpu_attention.decode_attention.op(q, k, v, None, 0.25)
    assert not out.requires_grad
    torch.testing.assert_close(out, cpu_attention.decode_attention.eager(q.detach(), k, v, None, 0.25), rtol=0, atol=0)


# The ops whose CPU kernel csrc/dispatch.cpp registers with the dispatcher: a compiled graph calls
# them without going through Python.
CPP_CPU_OPS = ("int4_linear_io_cpu", "int4dq_linear_io_cpu", "int8_linear_io_cpu",
               "int8dyn_linear_io_cpu", "int8dyn_vnni_linear_cpu", "fp8_linear_io_cpu", "fp8_dpbf16_linear_cpu",
               "dense_linear_io_cpu", "decode_attention_cpu")
# The ones whose kernel runs only in the extension's avx512 build, and of those the ones that need
# AVX512-VBMI too.
AVX512_BUILD_OPS = ("int8dyn_vnni_linear_cpu", "fp8_dpbf16_linear_cpu")
VBMI_OPS = ("fp8_dpbf16_linear_cpu",)


def _per_token_op_calls():
    """(op, args) of each op in CPP_CPU_OPS that this build runs: a small call with a bias and one
    without, at the rows of a decode step and a few more."""
    from hf_aoq import Float8WeightOnlyConfig, Int4DQWeightOnlyConfig, Int8DynamicActivationInt8WeightConfig
    from hf_aoq.kernels import cpu, cpu_attention, cpu_dense, cpu_fp8_dot, cpu_int8dyn  # noqa: F401 - defines the ops
    from hf_aoq.kernels.build_cache import cpu_features

    def weight(config, n=48, k=64):
        return quantize_(torch.nn.Linear(k, n), config).weight

    x1, x3 = torch.randn(1, 1, 64, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    b = torch.randn(48, dtype=torch.bfloat16)
    w4, wdq = weight(Int4WeightOnlyConfig(32)), weight(Int4DQWeightOnlyConfig(group_size=32))
    w8, wd8 = weight(Int8WeightOnlyConfig()), weight(Int8DynamicActivationInt8WeightConfig())
    wf8 = weight(Float8WeightOnlyConfig())
    wv8 = weight(Int8DynamicActivationInt8WeightConfig(), n=64)  # the VNNI kernel's N: a multiple of 32
    avx512 = cpu_ext.chosen_isa() == "avx512"
    vbmi = avx512 and "avx512vbmi" in cpu_features()
    f8_codes, f8_scale = wf8.qdata.view(torch.uint8), wf8.scale.reshape(-1).float().contiguous()
    dense = torch.randn(48, 64, dtype=torch.bfloat16)
    q = torch.randn(1, 8, 1, 16)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    mask = torch.tensor([[[[True, True, False, True, True]]]])
    calls = []
    for x, bias in ((x1, None), (x3, b)):
        calls += [
            ("int4_linear_io_cpu", (x, w4.qdata, w4.scale, 32, 64, bias, cpu.INT4_GEMV_MAX_ROWS)),
            ("int4dq_linear_io_cpu", (x, wdq.qdata, wdq.gparams, wdq.rparams, wdq.tparams, 32, 64, bias,
                                      cpu.INT4_GEMV_MAX_ROWS)),
            ("int8_linear_io_cpu", (x, w8.qdata, w8.scale, bias, cpu.INT8_GEMV_MAX_ROWS)),
            ("int8dyn_linear_io_cpu", (x, wd8.qdata, wd8.scale, bias, cpu.INT8_GEMV_MAX_ROWS)),
            ("fp8_linear_io_cpu", (x, wf8.qdata, wf8.scale, cpu._FP8_SHIFT[wf8.qdata.dtype], bias,
                                   cpu.FP8_GEMV_MAX_ROWS)),
            ("dense_linear_io_cpu", (x, dense, bias)),
        ]
        if avx512:
            calls.append(("int8dyn_vnni_linear_cpu", (x.reshape(-1, 64), wv8.qdata, wv8.scale,
                                                      None if bias is None else torch.randn(64, dtype=torch.bfloat16),
                                                      cpu_int8dyn.INT8DYN_VNNI_GEMV_MAX_ROWS)))
        if vbmi:
            calls.append(("fp8_dpbf16_linear_cpu", (x.reshape(-1, 64), f8_codes, f8_scale,
                                                    cpu._FP8_SHIFT[wf8.qdata.dtype], bias)))
    calls += [("decode_attention_cpu", (q, k, v, None, 0.25)), ("decode_attention_cpu", (q, k, v, mask, 0.25))]
    absent = (set() if avx512 else set(AVX512_BUILD_OPS)) | (set() if vbmi else set(VBMI_OPS))
    assert {name for name, _ in calls} == set(CPP_CPU_OPS) - absent
    return calls


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's C++ extension is not built here")
def test_opcheck_every_per_token_op():
    """A compiled decode step (generation.compiled_step) leaves out Inductor's size asserts, so
    each op's fake must give its kernel's output size and dtype: torch.library.opcheck (schema,
    fake against the real output, autograd registration, AOT dispatch) on every op a decode step
    calls."""
    for name, args in _per_token_op_calls():
        # The schema check compares the inputs before and after with aten ops that float8 lacks
        # on CPU: that one test is left out for the float8 op.
        utils = OPCHECK_TESTS[1:] if name == "fp8_linear_io_cpu" else OPCHECK_TESTS
        torch.library.opcheck(getattr(torch.ops.hf_aoq, name).default, args, test_utils=utils)


@pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's C++ extension is not built here")
def test_the_per_token_cpu_ops_have_a_cpp_kernel_that_gives_the_python_kernels_numbers():
    from hf_aoq.kernels import cpu, cpu_attention, cpu_dense, registry  # noqa: F401 - defines the ops

    ops = registry.opaque_ops()
    for name in CPP_CPU_OPS:
        assert f"hf_aoq::{name}" in ops, name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"hf_aoq::{name}", "CPU"), name
    assert cpu_ext.load().register_cpu_kernels() is False  # once per process
    w = quantize_(torch.nn.Linear(64, 48), Int4WeightOnlyConfig(32)).weight
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    args = (x, w.qdata, w.scale, 32, 64, None, cpu.INT4_GEMV_MAX_ROWS)
    assert torch.equal(cpu.int4_linear_io.op(*args), cpu.int4_linear_io.eager(*args))
    w8 = quantize_(torch.nn.Linear(64, 48), Int8WeightOnlyConfig()).weight
    b = torch.randn(48, dtype=torch.bfloat16)
    args = (x, w8.qdata, w8.scale, b, cpu.INT8_GEMV_MAX_ROWS)
    assert torch.equal(cpu.int8_linear_io.op(*args), cpu.int8_linear_io.eager(*args))
