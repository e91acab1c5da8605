import pytest
import torch

from models import tiny_llama_checkpoint


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def cpu_int4_packing() -> str:
    """The packing `place()` gives an Int4Tensor on this CPU: hf_aoq's pairs layout where its
    extension builds, aten's int4pack layout otherwise."""
    from hf_aoq.kernels import cpu_ext

    return "cpu_int4_pairs" if cpu_ext.available() else "cpu_int4pack"


def int16_activation_linear(x: torch.Tensor, w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the CPU int4 kernels' integer GEMV computes for float32 activations x [M, K] (K a
    multiple of g) and the dequantized weight w [N, K], in float64, from the definition: each
    group of g activations becomes int16 codes round(x * (32767 / max|x|)) (float32
    arithmetic), standing for code * max|x| / 32767. Returns (y, bound): the product with those
    values, and per output the most they can move it from x @ w.T, half a step per activation
    times |w|."""
    m, k = x.shape
    xg = x.float().reshape(m, k // g, g)
    mx = xg.abs().amax(-1, keepdim=True)
    inv = torch.full_like(mx, 32767) / mx  # a true division, as the kernel (32767 / mx would multiply by 1 / mx)
    codes = torch.where(mx > 0, torch.round(xg * inv).clamp(-32767, 32767), torch.zeros_like(xg))
    step = (mx / 32767).double()
    xhat = (codes.double() * step).reshape(m, k)
    half_steps = (step / 2).expand(m, k // g, g).reshape(m, k)
    return xhat @ w.double().t(), half_steps @ w.double().abs().t()


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; inf when identical."""
    ref = reference.detach().float()
    noise = (ref - approx.detach().float()).pow(2).mean()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).mean() / noise))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random bf16 Llama checkpoint with a tokenizer, shared by the CLI, Hub and card tests."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama_checkpoint(path)
    return path


@pytest.fixture
def no_network(monkeypatch):
    """Fail any connection (or name lookup) to a host other than this machine."""
    import socket

    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def local_only(host):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"a test tried to reach {host!r}; tests may only use the local test hub")

    def getaddrinfo(host, *args, **kwargs):
        local_only(host)
        return real_getaddrinfo(host, *args, **kwargs)

    def connect(self, address):
        if isinstance(address, tuple):
            local_only(address[0])
        return real_connect(self, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture
def hub(monkeypatch, tmp_path, no_network):
    """A local Hub (tests/hub_server.py) on 127.0.0.1 that huggingface_hub and transformers talk
    to for this test, with its own cache and token. Any connection to another host fails
    (`no_network`), and the server must not have seen a request it does not serve."""
    import huggingface_hub
    import huggingface_hub.constants as constants
    import transformers.utils.hub as transformers_hub
    from hub_server import HubServer

    server = HubServer().start()
    env = {
        "HF_ENDPOINT": server.url,
        "HF_TOKEN": "hf_local_test_token",
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_CACHE": str(tmp_path / "hf_home" / "hub"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "0",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", server.url)
    monkeypatch.setattr(transformers_hub, "_hf_api", None)
    server.env = env
    try:
        yield server
    finally:
        server.stop()
    assert not server.unhandled, f"the client made requests the test hub does not serve: {server.unhandled}"
    assert not server.non_local_clients
