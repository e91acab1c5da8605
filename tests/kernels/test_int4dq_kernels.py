"""hf_aoq's CPU kernels for the Int4DQ weight format (csrc/int4dq.cpp: int4dq_linear;
csrc/int4dq_search.cpp: int4dq_row_params; csrc/linear_io.cpp: int4dq_linear_io) against a
pure-torch reference of the format written here from its definition:

    qdata   uint8 [N, K/2]  codes q in [0, 15], low nibble = even column
    gparams uint8 [N, G]    per group: a (low nibble), b (high nibble)
    rparams uint8 [N, 4]    per row: kd_lo, kd_hi, kc_lo, kc_hi
    tparams float32 [2]     T_d, T_c

    LUT[j] = float32(2^(-j/32)); dval(k) = 0 if k == 255 else (T_d * LUT[k % 32]) * 2^-(k // 32)
    cval(k) = 0 if m == 127 else (-1)^(k >> 7) * (T_c * LUT[2 * (m % 16)]) * 2^-(m // 16), m = k & 127
    dstep = (dhi - dlo) / 15, cstep = (chi - clo) / 15
    d = dlo + a * dstep, c = clo + b * cstep, w = (q - 7.5) * d + c   (float32, no fused ops)

The kernels read the codes in hf_aoq's pairs layout (int4_repack_pairs of the canonical
bytes, padded to whole groups) and the group bytes transposed ([G, N])."""
import pytest
import torch
import torch.nn.functional as F

from hf_aoq.kernels import cpu, cpu_ext
from hf_aoq.kernels.cpu import INT4_GEMV_MAX_ROWS as GEMV_MAX_ROWS  # the one definition; any value works here

from conftest import int16_activation_linear

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's CPU extension is not built here")


SHAPES = [
    (n, k, g)
    for n in (32, 48, 16)  # one 32-row block, a block and a 16-row tail, a lone 16-row block
    for k, g in ((64, 32), (576, 32), (80, 32), (576, 64), (80, 64))  # 80: a partial last group of 16
]


# ---- the reference -------------------------------------------------------------------------

LUT = torch.tensor([2.0 ** (-j / 32) for j in range(32)], dtype=torch.float64).to(torch.float32)
POW2 = torch.tensor([2.0**-i for i in range(8)], dtype=torch.float32)  # exact: 2^-(k // 32), k < 256


def ref_dval(k: torch.Tensor, t_d: torch.Tensor) -> torch.Tensor:
    v = (t_d * LUT[k % 32]) * POW2[k // 32]
    return torch.where(k == 255, torch.zeros_like(v), v)


def ref_cval(k: torch.Tensor, t_c: torch.Tensor) -> torch.Tensor:
    m = k & 127
    v = (t_c * LUT[2 * (m % 16)]) * POW2[m // 16]
    v = torch.where((k >> 7) == 1, -v, v)
    return torch.where(m == 127, torch.zeros_like(v), v)


def ref_row_params(rparams: torch.Tensor, tparams: torch.Tensor) -> torch.Tensor:
    """(dlo, dstep, clo, cstep) per row, float32 [N, 4]."""
    r = rparams.long()
    t_d, t_c = tparams[0], tparams[1]
    dlo, dhi = ref_dval(r[:, 0], t_d), ref_dval(r[:, 1], t_d)
    clo, chi = ref_cval(r[:, 2], t_c), ref_cval(r[:, 3], t_c)
    fifteen = torch.full_like(dlo, 15.0)
    return torch.stack([dlo, (dhi - dlo) / fifteen, clo, (chi - clo) / fifteen], dim=1)


def ref_group_params(gparams, rparams, tparams):
    """Per-group d and c, float32 [N, G] each."""
    rows = ref_row_params(rparams, tparams)
    a = (gparams & 15).to(torch.float32)
    b = (gparams >> 4).to(torch.float32)
    d = rows[:, 0:1] + a * rows[:, 1:2]
    c = rows[:, 2:3] + b * rows[:, 3:4]
    return d, c


def ref_dequantize(qdata, gparams, rparams, tparams, k: int, g: int) -> torch.Tensor:
    """The float32 weight [N, K] from the canonical fields."""
    n = qdata.shape[0]
    q = torch.stack([qdata & 15, qdata >> 4], dim=-1).reshape(n, -1)[:, :k].to(torch.float32)
    d, c = ref_group_params(gparams, rparams, tparams)
    d = d.repeat_interleave(g, dim=1)[:, :k]
    c = c.repeat_interleave(g, dim=1)[:, :k]
    return (q - 7.5) * d + c


# ---- random canonical fields ------------------------------------------------------------------


def random_fields(n: int, k: int, g: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // g)
    qdata = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    gparams = torch.randint(0, 256, (n, groups), generator=gen, dtype=torch.uint8)
    kd = torch.randint(0, 256, (n, 2), generator=gen, dtype=torch.int64)
    kd_lo, kd_hi = kd.max(dim=1).values, kd.min(dim=1).values  # a larger code is a smaller value: dhi >= dlo
    kc = torch.randint(0, 256, (n, 2), generator=gen, dtype=torch.int64)  # random signs
    rparams = torch.stack([kd_lo, kd_hi, kc[:, 0], kc[:, 1]], dim=1)
    # The special codes: dlo = 0 (255), and c ends of zero with either sign bit (127, 255).
    rparams[0, 0] = 255
    rparams[1, 2], rparams[1, 3] = 127, 255
    rparams[2, 2], rparams[2, 3] = 255, 127
    rparams[3, 0], rparams[3, 1] = 255, 255
    rparams = rparams.to(torch.uint8)
    tparams = torch.rand(2, generator=gen) * 0.1 + 0.01
    return qdata, gparams, rparams, tparams


def kernel_fields(qdata, gparams, g: int):
    """What the kernels take: codes in the pairs layout padded to whole groups, gparams in 64-row chunks."""
    padded_k = gparams.shape[1] * g
    packed = cpu_ext.load().int4_repack_pairs(qdata, padded_k)
    return packed, cpu.int4dq_cpu_gparams(gparams), padded_k


@pytest.mark.parametrize("n", [16, 48, 64, 80, 112, 208])
def test_cpu_gparams_layout_round_trips(n):
    """The CPU packing's group bytes: chunks of 64 rows (the last one holding what is left), each
    chunk's [G, rows] contiguous, as DQParams::bytes reads them; the inverse gives them back."""
    g = 5
    gparams = torch.randint(0, 256, (n, g), dtype=torch.uint8)
    flat = cpu.int4dq_cpu_gparams(gparams)
    assert flat.shape == (n * g,) and flat.is_contiguous()
    for row in range(n):
        c0 = row // 64 * 64
        width = min(64, n - c0)
        for j in range(g):
            assert flat[c0 * g + j * width + row - c0] == gparams[row, j]
    assert torch.equal(cpu.int4dq_canonical_gparams(flat, n), gparams)


def rel_err(expected, got):
    return float((expected.float() - got.float()).norm() / expected.float().norm())


# ---- tests ----------------------------------------------------------------------------------


def test_row_params_decode_every_code_exactly():
    """Every 8-bit code at every position, for a few tensor values: the C++ decoding equals the
    reference bit for bit."""
    ext = cpu_ext.load()
    codes = torch.arange(256, dtype=torch.uint8)
    rparams = torch.stack([codes, codes.flip(0), codes.roll(7), codes.roll(100)], dim=1).contiguous()
    for t in ([1.0, 1.0], [0.0123, 0.0457], [3.3e-3, 7.1], [1e-38, 2e-38]):  # the last: subnormal results
        tparams = torch.tensor(t, dtype=torch.float32)
        got = ext.int4dq_row_params(rparams, tparams)
        expected = ref_row_params(rparams, tparams)
        assert got.dtype == torch.float32 and got.shape == (256, 4)
        assert torch.equal(got, expected), t


@pytest.mark.parametrize("n,k,g", SHAPES)
def test_row_params_decode_random_fields(n, k, g):
    _, _, rparams, tparams = random_fields(n, k, g)
    got = cpu_ext.load().int4dq_row_params(rparams, tparams)
    assert torch.equal(got, ref_row_params(rparams, tparams))


@pytest.mark.parametrize("n", [1, 37, 64, 100, 256, 300, 528])
def test_row_table_at_every_row_count(n):
    """The vector decode's whole steps (16 rows on AVX-512, 8 on AVX2), its scalar tail and the
    256-row chunks of the [N, 4] form; the kernels' [8, N] table: the same rows, then in each whole
    64 rows the 512-bit step's lane order (row r at (r % 32) // 8 * 16 + r // 32 * 8 + r % 8),
    the rows past them in order. Every value against the reference, bit for bit."""
    torch.manual_seed(n)
    rparams = torch.randint(0, 256, (n, 4), dtype=torch.uint8)
    tparams = torch.tensor([0.0371, 2.9e-3])
    expected = ref_row_params(rparams, tparams)
    ext = cpu_ext.load()
    assert torch.equal(ext.int4dq_row_params(rparams, tparams), expected)
    table = ext.int4dq_cpu_rows(rparams, tparams)
    assert table.shape == (8, n) and torch.equal(table[:4], expected.t())
    n64 = n // 64 * 64
    lane = [b + (r % 32) // 8 * 16 + r // 32 * 8 + r % 8 for b in range(0, n64, 64) for r in range(64)]
    at = torch.tensor(lane + list(range(n64, n)), dtype=torch.long)
    in_lane_order = torch.empty_like(expected.t())
    in_lane_order[:, at] = expected.t()
    assert torch.equal(table[4:], in_lane_order)


@pytest.mark.parametrize("n,k,g", SHAPES)
def test_many_rows_path_dequantizes_exactly(n, k, g):
    """Fed the identity, the many-rows path returns its float32 dequantized weight: bit for bit
    the reference's."""
    qdata, gparams, rparams, tparams = random_fields(n, k, g)
    packed, gparams_cpu, padded_k = kernel_fields(qdata, gparams, g)
    eye = torch.eye(padded_k)
    got = cpu_ext.load().int4dq_linear(eye, packed, gparams_cpu, rparams, tparams, g, 0, False)
    assert got.shape == (padded_k, n)
    assert torch.equal(got.t()[:, :k], ref_dequantize(qdata, gparams, rparams, tparams, k, g))


@pytest.mark.parametrize("n,k,g", SHAPES)
def test_linear_both_paths_match_reference(n, k, g):
    qdata, gparams, rparams, tparams = random_fields(n, k, g)
    packed, gparams_cpu, padded_k = kernel_fields(qdata, gparams, g)
    w = ref_dequantize(qdata, gparams, rparams, tparams, k, g)
    ext = cpu_ext.load()
    torch.manual_seed(1)
    for m in (1, 2, 3, 5, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 70):
        x = torch.randn(m, k)
        xp = F.pad(x, (0, padded_k - k))
        got = ext.int4dq_linear(xp, packed, gparams_cpu, rparams, tparams, g, GEMV_MAX_ROWS, False)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert rel_err(x @ w.t(), got) < 1e-5, m
        # Half-precision activations: int16 codes at any number of rows (see test_cpu_kernels.py).
        got16 = ext.int4dq_linear(xp, packed, gparams_cpu, rparams, tparams, g, GEMV_MAX_ROWS, True)
        expected, bound = int16_activation_linear(xp, F.pad(w, (0, padded_k - k)), g)
        exact = (x.double() @ w.double().t())
        assert rel_err(expected, got16) < 1e-6, m
        assert ((got16 - exact).abs() <= bound + 1e-6 * exact.abs().max()).all(), m


def test_many_rows_path_over_several_chunks():
    """Large K makes the dequantized chunks 256 rows: 272 rows are two chunks, the last one a
    16-row block."""
    n, k, g = 272, 16384, 32
    qdata, gparams, rparams, tparams = random_fields(n, k, g, seed=5)
    packed, gparams_cpu, padded_k = kernel_fields(qdata, gparams, g)
    w = ref_dequantize(qdata, gparams, rparams, tparams, k, g)
    torch.manual_seed(2)
    ext = cpu_ext.load()
    for m in (2, 60):
        x = torch.randn(m, k)
        got = ext.int4dq_linear(x, packed, gparams_cpu, rparams, tparams, g, GEMV_MAX_ROWS, False)
        assert rel_err(x @ w.t(), got) < 1e-5, m


@pytest.mark.parametrize("n,k,g", [(48, 80, 32), (32, 576, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_call_entry_point_equals_the_composed_ops(n, k, g, dtype, with_bias):
    """int4dq_linear_io does x.float(), zero padding to whole groups, the kernel, + bias.float()
    and .to(dtype) in one call: the same bits as those steps composed from torch ops, with the row
    table decoded in the call (tparams [2]) or following T_d and T_c in tparams (the CPU packing's
    [2 + 8N], int4dq_cpu_rows)."""
    qdata, gparams, rparams, tparams = random_fields(n, k, g, seed=3)
    packed, gparams_cpu, padded_k = kernel_fields(qdata, gparams, g)
    ext = cpu_ext.load()
    table = ext.int4dq_cpu_rows(rparams, tparams)
    assert table.shape == (8, n) and table.dtype == torch.float32
    with_table = torch.cat([tparams, table.reshape(-1)])
    torch.manual_seed(4)
    bias = torch.randn(n, dtype=dtype) if with_bias else None
    for shape in ((1, k), (2, 3, k), (70, k)):
        x = torch.randn(*shape, dtype=dtype)
        eager = ext.int4dq_linear_io(x, packed, gparams_cpu, rparams, tparams, g, k, bias, GEMV_MAX_ROWS)
        kept = ext.int4dq_linear_io(x, packed, gparams_cpu, rparams, with_table, g, k, bias, GEMV_MAX_ROWS)
        assert torch.equal(kept, eager), shape
        x2 = F.pad(x.reshape(-1, k).float(), (0, padded_k - k))
        y = ext.int4dq_linear(x2, packed, gparams_cpu, rparams, tparams, g, GEMV_MAX_ROWS, dtype != torch.float32)
        if bias is not None:
            y = y + bias.float()
        composed = y.to(dtype).reshape(*shape[:-1], n)
        assert eager.dtype == dtype and eager.shape == (*shape[:-1], n)
        assert torch.equal(eager, composed), shape


def test_the_cpu_packing_carries_the_row_table_in_tparams():
    """The CPU packing appends the decoded row table to tparams (float32 [2 + 8N]: T_d, T_c, then
    int4dq_cpu_rows), so that no call decodes it, eager or compiled; the canonical form (and so
    every checkpoint) keeps tparams [2]. The kernel gives the same bits with the table decoded in
    the call, and refuses a tparams that is neither [2] nor [2 + 8N], naming it."""
    from hf_aoq import Int4DQTensor

    torch.manual_seed(5)
    canonical = Int4DQTensor.from_float(torch.randn(64, 96), 32)
    w = canonical.place()
    assert w.packing == "cpu_int4dq" and w.tparams.shape == (2 + 8 * 64,)
    assert torch.equal(w.tparams[:2], canonical.tparams)
    assert torch.equal(w.tparams[2:], cpu_ext.load().int4dq_cpu_rows(canonical.rparams, canonical.tparams).reshape(-1))
    back = w.to_canonical()
    assert back.tparams.shape == (2,) and torch.equal(back.tparams, canonical.tparams)
    ext = cpu_ext.load()
    for m in (1, 5, GEMV_MAX_ROWS + 3):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, 96, dtype=dtype)
            kept = ext.int4dq_linear_io(x, w.qdata, w.gparams, w.rparams, w.tparams, 32, 96, None, GEMV_MAX_ROWS)
            decoded_in_call = ext.int4dq_linear_io(x, w.qdata, w.gparams, w.rparams, w.tparams[:2], 32, 96, None,
                                                   GEMV_MAX_ROWS)
            assert torch.equal(kept, decoded_in_call), (m, dtype)
            if m == 1:  # the row F.linear takes at one row
                assert torch.equal(F.linear(x, w), kept), dtype
    with pytest.raises(RuntimeError, match="tparams"):
        cpu_ext.load().int4dq_linear_io(x, w.qdata, w.gparams, w.rparams, w.tparams[:-1].contiguous(), 32, 96, None,
                                        GEMV_MAX_ROWS)
