"""Large CPU weight buffers on transparent huge pages (kernels/hugepages.py): same values, the
mapping advised before its first touch, released with the tensor, and what place() does."""
import gc
import re

import pytest
import torch
import torch.nn.functional as F

from hf_aoq.kernels import hugepages
from hf_aoq.tensors import Float8Tensor, Int4DQTensor, Int8Tensor

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages here (not Linux, or THP 'never')")


def _mapping(addr: int) -> dict | None:
    """The /proc/self/smaps entry holding addr: its range and fields (VmFlags as a set)."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                lo, hi = int(m.group(1), 16), int(m.group(2), 16)
                if entry is not None:
                    break
                if lo <= addr < hi:
                    entry = {"range": (lo, hi)}
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = set(value.split()) if key == "VmFlags" else value.strip()
    return entry


@needs_thp
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_copy_is_equal_aligned_and_advised(dtype):
    src = torch.randn(1536, 1024 + 96).to(dtype)  # 1.6-6.6 MB: whole huge pages and a partial one
    out = hugepages.on_huge_pages(src)
    assert out.dtype == dtype and out.shape == src.shape and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8)) if dtype.itemsize == 1 else torch.equal(out, src)
    if src.nbytes < hugepages.HUGE_PAGE:
        assert out is src or out.data_ptr() % 64 == 0
        return
    assert out.data_ptr() % hugepages.HUGE_PAGE == 0 and out.data_ptr() != src.data_ptr()
    smaps = _mapping(out.data_ptr())
    assert smaps is not None and "hg" in smaps["VmFlags"], smaps  # MADV_HUGEPAGE before the first touch
    assert hugepages.on_huge_pages(out) is out  # placing twice copies once


@needs_thp
def test_mapping_released_with_the_tensor():
    out = hugepages.on_huge_pages(torch.ones(3 << 20, dtype=torch.uint8))
    addr = out.data_ptr()
    view = out[5:10]
    del out
    gc.collect()
    assert _mapping(addr) is not None  # a view keeps the storage, so the mapping
    assert view.sum().item() == 5
    del view
    gc.collect()
    entry = _mapping(addr)
    assert entry is None or "hg" not in entry["VmFlags"], entry


def test_small_or_disabled_stays_in_place(monkeypatch):
    small = torch.zeros(1000, dtype=torch.int8)
    assert hugepages.on_huge_pages(small) is small  # 64-byte aligned fresh allocation: no copy
    monkeypatch.setenv("HF_AOQ_HUGE_PAGES", "0")
    hugepages.available.cache_clear()
    try:
        assert not hugepages.available()
        big = torch.zeros(3 << 20, dtype=torch.int8)
        assert hugepages.on_huge_pages(big) is big
    finally:
        monkeypatch.delenv("HF_AOQ_HUGE_PAGES")
        hugepages.available.cache_clear()


def test_thp_mode_parsing(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    for text, mode in [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never"), ("garbage", None)]:
        f.write_text(text)
        monkeypatch.setattr(hugepages, "_THP_MODE", str(f))
        assert hugepages._thp_mode() == mode
    monkeypatch.setattr(hugepages, "_THP_MODE", str(tmp_path / "absent"))
    assert hugepages._thp_mode() is None


@needs_thp
@pytest.mark.parametrize("make", [
    lambda w: Int8Tensor.from_float(w),
    lambda w: Float8Tensor.from_float(w),
    lambda w: Int4DQTensor.from_float(w),
], ids=["int8", "float8", "int4dq"])
def test_place_puts_the_codes_on_huge_pages(make):
    torch.manual_seed(0)
    w = torch.randn(2048, 2048, dtype=torch.bfloat16)
    q = make(w)
    placed = q.place()
    assert placed.qdata.data_ptr() % hugepages.HUGE_PAGE == 0
    assert "hg" in _mapping(placed.qdata.data_ptr())["VmFlags"]
    assert torch.equal(placed.dequantize(), q.place().dequantize())
    assert torch.equal(placed.to_canonical().dequantize(), q.to_canonical().dequantize())
    x = torch.randn(3, 2048, dtype=torch.bfloat16)
    assert torch.equal(F.linear(x, placed), F.linear(x, q.place()))
    assert placed.place().qdata.data_ptr() == placed.qdata.data_ptr()  # placed once


@needs_thp
def test_place_fused_experts_stacks_once_onto_huge_pages():
    torch.manual_seed(0)
    w = torch.randn(4, 1024, 1024, dtype=torch.bfloat16)  # 4 MB of int8 codes, 1 MB an expert
    q = Int8Tensor.from_float(w)
    placed = q.place()
    assert placed.shape == q.shape and placed.qdata.data_ptr() % hugepages.HUGE_PAGE == 0
    assert torch.equal(placed.to_canonical().dequantize(), q.dequantize())


@needs_thp
def test_saved_and_loaded_weights_round_trip(tmp_path):
    from hf_aoq.serialization import load_file, save_file

    torch.manual_seed(0)
    q = Float8Tensor.from_float(torch.randn(2048, 1536, dtype=torch.bfloat16)).place()  # 3 MB of codes
    assert q.qdata.data_ptr() % hugepages.HUGE_PAGE == 0
    save_file({"w": q}, tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")["w"]  # placed: out of the file's map, onto huge pages
    assert loaded.qdata.data_ptr() % hugepages.HUGE_PAGE == 0 and "hg" in _mapping(loaded.qdata.data_ptr())["VmFlags"]
    assert torch.equal(loaded.qdata.view(torch.uint8), q.qdata.view(torch.uint8)) and torch.equal(loaded.scale, q.scale)


def test_describe_says_which_pages(monkeypatch, tmp_path):
    f = tmp_path / "enabled"
    monkeypatch.setattr(hugepages, "_THP_MODE", str(f))
    try:
        f.write_text("always [madvise] never")
        hugepages.available.cache_clear()
        expected = "2 MiB pages (THP madvise)" if hugepages.available() else "4 KiB pages (THP madvise)"
        assert hugepages.describe() == expected  # the latter off Linux
        f.write_text("always madvise [never]")
        hugepages.available.cache_clear()
        assert hugepages.describe() == "4 KiB pages (THP never)"
        monkeypatch.setenv("HF_AOQ_HUGE_PAGES", "0")
        hugepages.available.cache_clear()
        assert hugepages.describe() == "4 KiB pages (HF_AOQ_HUGE_PAGES=0)"
        monkeypatch.delenv("HF_AOQ_HUGE_PAGES")
        f.unlink()
        hugepages.available.cache_clear()
        assert hugepages.describe() == "4 KiB pages (no transparent huge pages)"
    finally:
        monkeypatch.undo()
        hugepages.available.cache_clear()
