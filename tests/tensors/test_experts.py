"""3-D fused-experts weights [E, N, K]: each expert quantized by the 2-D rule, in one tensor; the
ops MoE forwards run on them (indexing, F.linear on an expert, bmm, grouped_mm) against the
dequantized float reference; device packing per expert; save/load of the 3-D layout."""
import pytest
import torch
import torch.nn.functional as F

from hf_aoq import AOQError, FormatError, Float8SemiSparseTensor, Float8Tensor, FPxTensor, Int4DQTensor, Int4Tensor, Int8Tensor, MXTensor, NVFP4Tensor, serialization
from hf_aoq.core.granularity import PerTensor
from hf_aoq.tensors.experts import TransposedExperts, expert

E, N, K = 4, 64, 96  # K = 96: Int4's groups of 64 end in a partial group
SCHEMES = {
    "int4": lambda w: Int4Tensor.from_float(w, 32),
    "int4_g64_sym": lambda w: Int4Tensor.from_float(w, 64, True),
    "int4dq": lambda w: Int4DQTensor.from_float(w, 32),
    "int8": lambda w: Int8Tensor.from_float(w),
    "int8_g32": lambda w: Int8Tensor.from_float(w, 32),
    "int8_dynamic": lambda w: Int8Tensor.from_float(w, act_quant="per_token"),
    "fp8": lambda w: Float8Tensor.from_float(w),
    "fp8_per_tensor": lambda w: Float8Tensor.from_float(w, granularity=PerTensor()),
    "mxfp4": lambda w: MXTensor.from_float(w, torch.float4_e2m1fn_x2),
    "nvfp4": lambda w: NVFP4Tensor.from_float(w),
    "fp8_sparse": lambda w: Float8SemiSparseTensor.from_float(w),
    "fp6": lambda w: FPxTensor.from_float(w),  # e3m2: 96 codes of 6 bits, 72 bytes a row
    "fp5_e2m2": lambda w: FPxTensor.from_float(w, 2, 2),  # 60 bytes a row
}


def weight(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g)
    return (w * torch.linspace(0.5, 4, E)[:, None, None]).to(dtype)  # experts of different ranges


@pytest.fixture(params=sorted(SCHEMES))
def scheme(request):
    return request.param, SCHEMES[request.param]


def test_each_expert_is_quantized_as_a_2d_weight_in_one_tensor(scheme):
    _, make = scheme
    w = weight()
    t = make(w)
    assert t.shape == (E, N, K) and len(t.block_size) == 3 and t.block_size[0] == 1
    for e in range(E):
        one = make(w[e])
        assert one.fields().keys() == t.fields().keys()
        for name, field in one.tensor_fields().items():
            stacked = t.tensor_fields()[name]
            assert stacked.shape == (E, *field.shape), name  # one tensor per field, experts first
            assert torch.equal(stacked[e].reshape(-1).view(torch.uint8), field.reshape(-1).view(torch.uint8)), name
        assert torch.equal(t.dequantize()[e], one.dequantize())
        assert torch.equal(t[e].dequantize(), one.dequantize())


def test_placement_packs_each_expert_and_undoes_it(scheme):
    _, make = scheme
    w = weight()
    t = make(w)
    placed = t.place()
    one = make(w[0]).place()
    assert getattr(placed, "packing", None) == getattr(one, "packing", None)
    if getattr(one, "packing", None) is not None:
        assert torch.equal(placed[0].qdata, one.qdata)
    assert torch.equal(placed.dequantize(), t.dequantize())
    canonical = placed.to_canonical()
    for name, field in t.tensor_fields().items():
        assert torch.equal(canonical.tensor_fields()[name].view(torch.uint8), field.view(torch.uint8)), name


def test_save_and_load_keep_the_3d_layout(scheme, tmp_path):
    _, make = scheme
    t = make(weight()).place()
    path = str(tmp_path / "experts.safetensors")
    serialization.save_file({"mlp.experts.gate_up_proj": t}, path)
    from safetensors import safe_open

    canonical = t.to_canonical()
    with safe_open(path, "pt") as f:  # the file holds the canonical 3-D fields, experts first
        for name, field in canonical.tensor_fields().items():
            stored = f.get_tensor(f"mlp.experts.gate_up_proj:{name}")
            assert stored.shape == field.shape and stored.shape[0] == E, name
    back = serialization.load_file(path)["mlp.experts.gate_up_proj"]
    assert type(back) is type(t) and back.shape == (E, N, K)
    assert getattr(back, "packing", None) == getattr(t, "packing", None)  # placed again on load
    assert torch.equal(back.dequantize(), t.dequantize())


def test_indexing_experts(scheme):
    _, make = scheme
    t = make(weight()).place()
    d = t.dequantize()
    assert torch.equal(t[torch.tensor(2)].dequantize(), d[2])  # a 0-d index tensor, as the eager forwards use
    assert torch.equal(t[-1].dequantize(), d[-1])
    ids = torch.tensor([3, 0, 0, 2])
    gathered = t[ids]
    assert type(gathered) is type(t) and gathered.shape == (4, N, K)
    assert torch.equal(gathered.dequantize(), d[ids])
    assert t[torch.tensor([], dtype=torch.long)].shape == (0, N, K)
    with pytest.raises(IndexError, match="out of (range|bounds)"):
        t[4]
    with pytest.raises(IndexError, match="out of range for 4 experts"):
        t[torch.tensor([1, 4])]


def close(out, ref, rel=2e-2):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.numel() == 0:
        return
    assert float((out.float() - ref.float()).abs().max()) <= rel * float(ref.float().abs().max()) + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_on_an_expert_runs_the_kernels_and_matches_the_reference(scheme, dtype):
    _, make = scheme
    t = make(weight()).place()
    d = t.dequantize(dtype)
    for rows in (0, 1, 5):  # M = 0: an expert without tokens
        x = torch.randn(rows, K, dtype=dtype)
        for e in range(E):
            w_e = t[e]
            ref = F.linear(t[e].simulate_input_quantization(x), d[e])
            close(F.linear(x, w_e), ref)


def test_grouped_mm_runs_expert_by_expert_and_skips_empty_groups(scheme):
    _, make = scheme
    t = make(weight()).place()
    d = t.dequantize()
    x = torch.randn(9, K, dtype=torch.bfloat16)
    offs = torch.tensor([3, 3, 7, 8], dtype=torch.int32)  # expert 1 gets no tokens; row 8 is past the end
    wt = t.transpose(-2, -1)
    assert isinstance(wt, TransposedExperts) and wt.shape == (E, K, N)
    out = F.grouped_mm(x, wt, offs=offs)
    ref = torch.zeros(9, N, dtype=torch.bfloat16)
    for e, (start, end) in enumerate(zip([0, 3, 3, 7], [3, 3, 7, 8])):
        ref[start:end] = F.linear(expert(t, e).simulate_input_quantization(x[start:end]), d[e])
    close(out[:8], ref[:8])
    assert torch.equal(out[8], torch.zeros(N, dtype=torch.bfloat16))
    close(torch._grouped_mm(x, wt, offs=offs)[:8], ref[:8])
    # No tokens at all, and the transpose undone.
    assert torch.equal(F.grouped_mm(x[:0], wt, offs=torch.zeros(E, dtype=torch.int32)), torch.zeros(0, N, dtype=x.dtype))
    assert wt.transpose(-2, -1) is t


@pytest.mark.parametrize("kind", ["int4", "int8", "mxfp4", "fp6"])
def test_grouped_mm_as_torch_compile_traces_it_gives_the_eager_answer(kind, monkeypatch):
    # Under torch.compile the group ends are data: grouped_mm calls one opaque op
    # (experts._grouped_mm_op), which rebuilds the weight from its inner tensors and runs the
    # eager loop. Same kernels on the same rows: bit for bit, zeros past the end, bias too.
    t = SCHEMES[kind](weight()).place()
    x = torch.randn(9, K, dtype=torch.bfloat16)
    offs = torch.tensor([3, 3, 7, 8], dtype=torch.int32)
    bias = torch.randn(E, N, dtype=torch.bfloat16)
    wt = t.transpose(-2, -1)
    eager = torch._grouped_mm(x, wt, offs=offs, bias=bias)
    stored_k_by_n = Int4Tensor.from_float(weight().transpose(-2, -1).contiguous(), 32)  # gpt-oss's [E, K, N]
    eager_kn = F.grouped_mm(x, stored_k_by_n, offs=offs)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = torch._grouped_mm(x, wt, offs=offs, bias=bias)
    assert torch.equal(traced, eager)
    assert torch.equal(traced[8], torch.zeros(N, dtype=torch.bfloat16))
    assert torch.equal(F.grouped_mm(x, stored_k_by_n, offs=offs), eager_kn)
    assert F.grouped_mm(x[:0], wt, offs=torch.zeros(E, dtype=torch.int32)).shape == (0, N)
    assert torch._grouped_mm(x, wt, offs=offs, out_dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_compiled_grouped_mm_runs_each_expert_on_its_own_rows_only(kind, monkeypatch):
    # A real fullgraph compile: each expert's kernel runs once, on its group's rows, and not for
    # an empty group (before, every expert ran on all 9 rows); the answer is eager's, bit for bit.
    from hf_aoq import kernels

    t = SCHEMES[kind](weight()).place()
    wt = t.transpose(-2, -1)
    bias = torch.randn(E, N, dtype=torch.bfloat16)
    x = torch.randn(9, K, dtype=torch.bfloat16)
    offs = torch.tensor([3, 3, 7, 8], dtype=torch.int32)
    rows = []
    linear = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda x, w, b=None: rows.append(x.shape[0]) or linear(x, w, b))
    eager = torch._grouped_mm(x, wt, offs=offs, bias=bias)
    assert rows == [3, 4, 1]
    rows.clear()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, offs: torch._grouped_mm(x, wt, offs=offs, bias=bias),
                             fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, offs), eager)
    assert rows == [3, 4, 1]
    rows.clear()
    other = torch.tensor([0, 9, 9, 9], dtype=torch.int32)  # other group ends: one expert gets every row
    out = compiled(x, other)
    assert rows == [9]
    assert torch.equal(out, torch._grouped_mm(x, wt, offs=other, bias=bias))


def test_the_compiled_op_describes_each_layout_and_decodes_it_once(scheme):
    from hf_aoq.tensors import experts

    _, make = scheme
    t = make(weight()).place()
    fields = t.tensor_fields()
    description = experts._description(type(t).__name__, tuple(fields), tuple(t.attributes().items()))
    cls, names, attributes = experts._decoded(description)
    assert experts._decoded(description)[2] is attributes  # cached: decoded once per description
    back = cls(**attributes, **dict(zip(names, fields.values())))
    assert type(back) is type(t) and back.fields().keys() == t.fields().keys()
    assert back.attributes() == t.attributes()
    assert torch.equal(back.dequantize(), t.dequantize())


@pytest.mark.parametrize("change, message", [
    (lambda d: d.replace('"Int4Tensor"', '"Tensor"'), "unknown tensor type 'Tensor'"),
    (lambda d: d.replace('"cpu_int4_pairs"', '"cpu_int8_aligned"'), "'cpu_int8_aligned' is a packing of Int8Tensor"),
    (lambda d: d.replace('"cpu_int4_pairs"', '"nope"'), "unknown packing 'nope'"),
    (lambda d: d.replace('"block_size"', '"blocks"'), "Int4Tensor has no tensor field or attribute 'blocks'"),
    (lambda d: d.replace('"scale", ', ''), "Int4Tensor needs each of its tensor fields"),
    (lambda d: d.replace('"ints"', '"pickle"'), "unknown value tag 'pickle'"),
    (lambda d: d[:-1], "grouped_mm experts description"),
])
def test_a_bad_description_is_refused(change, message):
    from hf_aoq.tensors import experts

    t = SCHEMES["int4"](weight()).place()
    if t.packing != "cpu_int4_pairs":
        pytest.skip("the C++ int4 packing is not available here")
    description = experts._description("Int4Tensor", tuple(t.tensor_fields()), tuple(t.attributes().items()))
    with pytest.raises((AOQError, FormatError), match=message):
        experts._decoded(change(description))


def test_bmm_on_gathered_experts(scheme):
    _, make = scheme
    t = make(weight()).place()
    ids = torch.tensor([1, 3, 3])
    x = torch.randn(3, K, dtype=torch.bfloat16)
    ref = torch.stack([F.linear(t[int(i)].simulate_input_quantization(x[j:j + 1]), t.dequantize()[int(i)])[0]
                       for j, i in enumerate(ids)])
    close(torch.bmm(t[ids], x.unsqueeze(-1)).squeeze(-1), ref)  # transformers' batched_mm
    close(torch.bmm(x.unsqueeze(1), t[ids].transpose(-2, -1)).squeeze(1), ref)
    assert torch.bmm(t[ids[:0]], x[:0].unsqueeze(-1)).shape == (0, N, 1)


def test_experts_stored_in_by_out_run_on_the_reference():
    # gpt-oss stores experts [E, in, out] and computes x @ w[e]: quantized along its last dim.
    w = weight()  # read as [E, K=N, N=K]
    t = Int4Tensor.from_float(w, 32)
    d = t.dequantize()
    x = torch.randn(5, N, dtype=torch.bfloat16)
    close(x @ t[2], x @ d[2])
    offs = torch.tensor([2, 2, 4, 5], dtype=torch.int32)
    out = F.grouped_mm(x, t, offs=offs)
    ref = torch.cat([x[0:2] @ d[0], x[2:4] @ d[2], x[4:5] @ d[3]])
    close(out, ref)
    close(torch.bmm(x.unsqueeze(1), t[torch.tensor([0, 1, 1, 2, 3])]).squeeze(1),
          torch.stack([x[i] @ d[j] for i, j in enumerate([0, 1, 1, 2, 3])]))


def test_other_ops_see_the_dequantized_weight():
    t = Int8Tensor.from_float(weight())
    x = torch.randn(E, K, 3, dtype=torch.bfloat16)
    close(torch.matmul(t, x), torch.matmul(t.dequantize(), x))
    close(torch.matmul(x.transpose(1, 2), t.transpose(-2, -1)), torch.matmul(x.transpose(1, 2), t.dequantize().mT))


def test_bad_expert_weights_are_refused():
    with pytest.raises(AOQError, match=r"w \(expert 0\): int4 group_size must be one of"):
        Int4Tensor.from_float(weight(), 48, name="w")
    with pytest.raises(AOQError, match=r"w: fused experts are a non-empty 3-D"):
        Int8Tensor.from_float(torch.zeros(0, 4, 8), name="w")
    with pytest.raises(AOQError, match=r"w \(expert 0\): expected a float32, bfloat16 or float16 weight"):
        Float8Tensor.from_float(torch.zeros(2, 4, 8, dtype=torch.int32), name="w")


def _stored(t, tmp_path, **changes):
    """Save `t` with some fields replaced (bypassing the save-side check), then load it."""
    bad = t.replace(**changes)
    path = str(tmp_path / "bad.safetensors")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(type(t), "check_fields", classmethod(lambda cls, fields: None))
        serialization.save_file({"experts.w": bad}, path)
    return serialization.load_file(path)


@pytest.mark.parametrize("case, message", [
    ("int4 block (4, 1, 32)", "'block_size': \\(4, 1, 32\\), expected \\(1, g\\) with g in .*after a leading 1"),
    ("int4 scale of one expert", "field 'scale'"),
    ("int4dq tparams per tensor", "field 'tparams'"),
    ("fp8 4-D", "'shape'"),
])
def test_the_loader_refuses_inconsistent_3d_fields(case, message, tmp_path):
    w = weight()
    if case.startswith("int4 "):
        t = Int4Tensor.from_float(w, 32)
        # One block spanning the experts: a consistent grid, but no kernel runs it.
        changes = ({"block_size": (4, 1, 32), "scale": t.scale[:1], "zero": t.zero[:1]} if "block" in case
                   else {"scale": t.scale[0]})
    elif case.startswith("int4dq"):
        t = Int4DQTensor.from_float(w, 32)
        changes = {"tparams": t.tparams[0]}
    else:
        t = Float8Tensor.from_float(w)
        changes = {"qdata": t.qdata[None], "scale": t.scale[None], "shape": (1, E, N, K), "block_size": (1, 1, 1, K)}
    with pytest.raises(FormatError, match=rf"tensor 'experts.w', .*{message}"):
        _stored(t, tmp_path, **changes)


def test_one_expert_of_the_transposed_view_runs_x_at_it_as_a_linear(scheme, monkeypatch):
    # gpt-oss's eager forward: x @ w[e] on its [E, in, out] parameter, here the view of [E, out, in].
    from hf_aoq import kernels

    _, make = scheme
    t = make(weight()).place()
    view = TransposedExperts(t)
    picked = []
    select = kernels.select_kernel
    monkeypatch.setattr(kernels, "select_kernel", lambda op, x, w: picked.append(select(op, x, w)) or picked[-1])
    x = torch.randn(5, K, dtype=torch.bfloat16)
    for index in (2, torch.tensor(2), torch.tensor(-1, dtype=torch.int32)):
        w_e = view[index]
        e = int(index) % E
        assert isinstance(w_e, TransposedExperts) and w_e.shape == (K, N)
        assert torch.equal(w_e, t[e].dequantize().t())  # any other op: the float transpose
        picked.clear()
        assert torch.equal(x @ w_e, F.linear(x, t[e]))  # the same kernel as the linear
        assert len(picked) == 2 and picked[0] is picked[1]
        assert w_e.transpose(0, 1) is not None and w_e.transpose(0, 1).shape == (N, K)
    assert torch.equal(torch.matmul(x[0], view[1]), x[0] @ t[1].dequantize().t())  # one row: the float path
