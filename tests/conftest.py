import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; inf when identical."""
    ref = reference.detach().float()
    noise = (ref - approx.detach().float()).pow(2).mean()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).mean() / noise))
