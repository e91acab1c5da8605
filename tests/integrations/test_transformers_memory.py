"""Quantize-on-load streams: each weight is quantized as transformers reads it.

The test checks the structure: every call of the quantize op sees exactly the weight being
read in float, and every weight planned before it already quantized in the model, so the float
model never exists in memory. Then the peak resident size of a whole quantize-on-load, measured
in a fresh process, must stay within 1.3x the quantized model's size.
"""
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_aoq  # noqa: F401  (registers "aoq")
from hf_aoq import AOQConfig, AOQTensor, Int4WeightOnlyConfig
from hf_aoq.core import memory
from hf_aoq.integrations import transformers as integration

from models import tiny_llama_checkpoint


def test_each_weight_is_quantized_as_it_is_read(tmp_path, monkeypatch):
    path = str(tmp_path)
    tiny_llama_checkpoint(path, layers=3, tokenizer=False)
    calls = []
    original = integration.AOQQuantize.convert

    def watching(self, input_dict, model=None, **kwargs):
        planned = set(self.hf_quantizer._configs)
        (name,) = input_dict  # one parameter per call
        (value,) = input_dict[name]
        assert name in planned and not isinstance(value, AOQTensor) and value.dtype == torch.bfloat16
        state = {}
        for other in planned - {name}:
            p = model.get_parameter(other)
            state[other] = "quantized" if isinstance(p, AOQTensor) else p.device.type
        calls.append((name, state))
        return original(self, input_dict, model=model, **kwargs)

    monkeypatch.setattr(integration.AOQQuantize, "convert", watching)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=AOQConfig(Int4WeightOnlyConfig(64)))

    planned = {n for n, p in model.named_parameters() if isinstance(p, AOQTensor)}
    assert len(planned) == 3 * 7 and [c[0] for c in calls] and {c[0] for c in calls} == planned
    assert len(calls) == len(planned)  # once each
    done = set()
    for name, state in calls:
        # Every other planned weight is either already quantized or not read yet (still on
        # the meta device): never a float copy sitting in the model.
        assert {n for n, s in state.items() if s == "quantized"} == done
        assert all(s == "meta" for n, s in state.items() if n not in done)
        done.add(name)


# ---------------------------------------------------------------------- peak memory
# Run in a fresh process, so that the peak belongs to the load alone. The peak resident size
# (VmHWM, reset just before loading) counts both heap memory and the mapped checkpoint's pages.
_PEAK_SCRIPT = """
import json, sys, torch
import hf_aoq  # noqa: F401  (registers "aoq")
from transformers import AutoModelForCausalLM

def kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])

path, scheme = sys.argv[1], sys.argv[2]
config = None if scheme == "none" else hf_aoq.AOQConfig(hf_aoq.configs.config_for_scheme(scheme))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current resident size
base = kib("VmRSS")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config)
peak = kib("VmHWM")
nbytes = 0
for p in model.parameters():
    fields = p.tensor_fields().values() if isinstance(p, hf_aoq.AOQTensor) else [p]
    nbytes += sum(t.numel() * t.element_size() for t in fields)
print(json.dumps({"growth": (peak - base) * 1024, "model_bytes": nbytes}))
"""


def _peak_growth(path, scheme):
    import json
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(path), scheme],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_on_load_peak_memory_is_near_the_quantized_size(tmp_path, scheme):
    # A ~330 MiB bf16 checkpoint: large enough that the quantized model, not the interpreter's
    # bookkeeping, dominates the growth. Before its mapped pages were released as loading went
    # on, the peak was the float checkpoint plus the quantized model (about 3x for int4).
    path = str(tmp_path / "model")
    tiny_llama_checkpoint(path, hidden=1024, intermediate=4096, layers=8, vocab=16384, tokenizer=False)
    float_bytes = sum(f.stat().st_size for f in (tmp_path / "model").glob("*.safetensors"))
    got = _peak_growth(path, scheme)
    ratio = got["growth"] / got["model_bytes"]
    assert got["model_bytes"] < 0.7 * float_bytes
    assert ratio <= 1.3, f"{scheme}: peak grew by {got['growth'] >> 20} MiB for a {got['model_bytes'] >> 20} MiB model"


# ---------------------------------------------------------------------- releasing mapped pages
def _rss_file_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page maps")
def test_release_file_pages_keeps_every_byte(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(512, 1024) for i in range(8)}  # 16 MiB
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    with safe_open(str(path), framework="pt", device="cpu") as f:
        views = {k: f.get_tensor(k) for k in f.keys()}
    assert sum(float(v.sum()) for v in views.values())  # fault every page in
    # A write to a mapped page makes a private copy: the only one, which must survive.
    views["t3"][10:20] = 7.0
    expected = {k: v.clone() for k, v in tensors.items()}
    expected["t3"][10:20] = 7.0
    if not memory.mapped_file_ranges([path]):
        pytest.skip("safetensors copied the file instead of mapping it")
    before = _rss_file_kib()
    released = memory.release_file_pages([path])
    assert released >= 15 << 20
    assert _rss_file_kib() < before - 10 * 1024
    for k, v in views.items():
        assert torch.equal(v, expected[k]), k  # read back from the file, or kept: never lost
    assert memory.release_file_pages([tmp_path / "other.safetensors"]) == 0  # not mapped: untouched
