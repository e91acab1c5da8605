"""What scripts/benchmark.py measures about the machine and the models, apart from speed: peak
and current RSS of this process, storage bytes of (quantized) tensors and models, the read and
copy bandwidth the decode limit is computed from, and a description of the CPU and builds."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_rss_mb() -> float:
    return _status_kb("VmHWM") / 1024


def rss_mb() -> float:
    return _status_kb("VmRSS") / 1024


def tensor_bytes(t) -> int:
    """Storage bytes of a tensor; a wrapper subclass (hf_aoq, torchao, quanto) is counted by its fields."""
    import torch

    if isinstance(t, torch.nn.Parameter):
        t = t.data
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def model_bytes(model) -> tuple[int, int]:
    """(bytes of all parameters, bytes read per decoded token). The second leaves out the input
    embedding (one row is read per token) unless it is the lm_head weight too, and counts of
    fused MoE experts [E, N, K] only the top-k a token is routed to."""
    total = sum(tensor_bytes(p) for p in model.parameters())  # parameters() counts a tied weight once
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    per_token = total if tied else total - tensor_bytes(emb)
    top_k = getattr(model.config, "num_experts_per_tok", None)
    for name, p in model.named_parameters():
        if top_k and ".experts." in name and p.ndim == 3:
            per_token -= tensor_bytes(p) * (p.shape[0] - top_k) // p.shape[0]
    return total, per_token


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _best_seconds(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls of fn, after one untimed call (the first touch)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(megabytes: int, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: best of `repeats` sums over a float32 buffer of `megabytes`."""
    import torch

    x = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    return x.numel() * 4 / _best_seconds(x.sum, repeats)


def measure_copy_bandwidth(megabytes: int, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a copy of a `megabytes` buffer: a probe that does
    no arithmetic (where the sum above is compute-bound, the copy moves more bytes per second)."""
    import torch

    x = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _best_seconds(lambda: y.copy_(x), repeats)


def measure_read_probe(megabytes: int, repeats: int = 5) -> tuple[float, str] | None:
    """Read bandwidth in bytes/s of hf_aoq's load-only probe (kernels/csrc/bandwidth.cpp: vector
    loads, XOR-folded) over a `megabytes` buffer placed as the quantized weights are (2 MiB pages
    where Linux offers them), and where it read from; None without the C++ extension. On a Zen 4
    VM torch's reductions read 28-36 GB/s while the same loop in C++ read 54 from huge pages in a
    quiet minute (csrc/bandwidth.cpp)."""
    import torch

    try:
        from hf_aoq.kernels import cpu_ext, hugepages
    except ImportError:
        return None
    ext = cpu_ext.load()
    if ext is None or not hasattr(ext, "read_xor"):
        return None
    buf = hugepages.on_huge_pages(torch.ones(megabytes << 20, dtype=torch.uint8))
    best = _best_seconds(lambda: ext.read_xor(buf), repeats)
    pages = "2 MiB pages" if hugepages.is_on_huge_pages(buf) else "4 KiB pages"
    return buf.numel() / best, f"hf_aoq's load-only probe, {pages}"


def read_bandwidth(megabytes: int) -> tuple[float, dict[str, float], str]:
    """(bytes/s, every probe's bytes/s, the probe taken): the fastest of torch's sum over a float32
    buffer, a copy (read + write bytes) and hf_aoq's load-only probe. Each is a lower bound on what
    the memory delivers, so the largest is the decode limit's bandwidth."""
    probes = {"torch sum": measure_bandwidth(megabytes), "torch copy (read + write)": measure_copy_bandwidth(megabytes)}
    probe = measure_read_probe(megabytes)
    if probe is not None:
        probes[probe[1]] = probe[0]
    name = max(probes, key=probes.get)
    return probes[name], probes, name


def machine_info(a) -> dict:
    """What the machine is: CPU model, the instruction sets that matter (and what the OS allows),
    which build of hf_aoq's kernels it loads, threads, versions."""
    import torch
    import transformers

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": a.threads or torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    try:
        from hf_aoq.kernels import cpu_ext, cpu_isa

        info.update(cpu_isa.describe())
        info["hf_aoq_extension_isa"] = cpu_ext.chosen_isa()
        from hf_aoq.kernels import hugepages

        info["weight_pages"] = hugepages.describe()
    except ImportError:
        pass
    return info
