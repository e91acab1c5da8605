"""The benchmark's read-bandwidth probe (kernels/csrc/bandwidth.cpp's read_xor) reads every byte:
its XOR of 8-byte words matches one computed by torch, at sizes around its 256-byte steps and
thread splits, and on a buffer placed on huge pages as the weights are."""
import pytest
import torch

from hf_aoq.kernels import cpu_ext, hugepages

needs_ext = pytest.mark.skipif(not cpu_ext.available(), reason="hf_aoq's CPU extension is not built here")


def xor_words(buf: torch.Tensor) -> int:
    """The XOR of buf's little-endian 8-byte words, a trailing part word zero-padded."""
    words = torch.cat([buf, buf.new_zeros(-buf.numel() % 8)]).view(torch.int64)
    while words.numel() > 1:
        if words.numel() % 2:
            words = torch.cat([words, words.new_zeros(1)])
        half = words.numel() // 2
        words = words[:half] ^ words[half:]
    return int(words[0]) if words.numel() else 0


@needs_ext
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 255, 256, 257, 1000, 4096 * 3 + 40, (1 << 20) + 13])
def test_read_xor_matches_torch(n, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        assert cpu_ext.load().read_xor(buf) == xor_words(buf)
    finally:
        torch.set_num_threads(before)


@needs_ext
def test_read_xor_on_huge_pages_and_a_changed_byte():
    buf = hugepages.on_huge_pages(torch.randint(0, 256, ((4 << 20) + 5,), dtype=torch.uint8,
                                                generator=torch.Generator().manual_seed(0)))
    ext = cpu_ext.load()
    first = ext.read_xor(buf)
    assert first == xor_words(buf)
    buf[(3 << 20) + 17] ^= 0x5A  # one byte in the middle of a thread's part changes the result
    assert ext.read_xor(buf) == xor_words(buf) != first


@needs_ext
def test_read_xor_rejects_other_buffers():
    ext = cpu_ext.load()
    with pytest.raises(RuntimeError, match="contiguous 1-D uint8"):
        ext.read_xor(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="contiguous 1-D uint8"):
        ext.read_xor(torch.zeros(32, dtype=torch.uint8)[::2])
