"""Quantize-on-load streams: each weight is quantized as transformers reads it.

The test checks the structure: every call of the quantize op sees exactly the weight being
read in float, and every weight planned before it already quantized in the model, so the float
model never exists in memory. Peak memory itself depends on the allocator and page cache, so it
is measured by running this file as a script (see the end) rather than asserted in a test.
"""
import os
import sys
import threading
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_aoq
from hf_aoq import AOQConfig, AOQTensor, Int4WeightOnlyConfig
from hf_aoq.integrations import transformers as integration


def tiny_llama_dir(path, hidden=128, intermediate=256, layers=3, vocab=512):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def test_each_weight_is_quantized_as_it_is_read(tmp_path, monkeypatch):
    path = tiny_llama_dir(tmp_path)
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


# ---------------------------------------------------------------------- measurement (not a test)
def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _measure(path, config):
    """Peak growth of anonymous resident memory while from_pretrained runs, in MiB."""
    base = _status_kib("RssAnon")
    peak, stop = [base], []

    def poll():
        while not stop:
            peak[0] = max(peak[0], _status_kib("RssAnon"))
            time.sleep(0.001)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    kwargs = {} if config is None else {"quantization_config": config}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs)
    stop.append(True)
    watcher.join()
    quantized = sum(
        sum(t.numel() * t.element_size() for t in p.tensor_fields().values())
        for p in model.parameters()
        if isinstance(p, AOQTensor)
    )
    return (peak[0] - base) / 1024, quantized / 2**20, model


if __name__ == "__main__":
    # python tests/test_transformers_memory.py {make DIR | int8 DIR | int4 DIR | prequant DIR}
    # Each mode in its own process; "make" writes a ~300 MiB bf16 Llama, "int4" also saves
    # DIR-int4 for "prequant".
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "make":
        tiny_llama_dir(path, hidden=1024, intermediate=4096, layers=8, vocab=16384)
        sys.exit(0)
    configs = {
        "int8": AOQConfig(hf_aoq.Int8WeightOnlyConfig()),
        "int4": AOQConfig(Int4WeightOnlyConfig(128)),
        "prequant": None,
    }
    source = path + "-int4" if mode == "prequant" else path
    float_mib = sum(os.path.getsize(os.path.join(source, f)) for f in os.listdir(source) if f.endswith(".safetensors"))
    peak, quantized, model = _measure(source, configs[mode])
    print(f"{mode}: peak anonymous RSS growth {peak:.0f} MiB; quantized weights {quantized:.0f} MiB; "
          f"checkpoint {float_mib / 2**20:.0f} MiB")
    if mode == "int4":
        model.save_pretrained(path + "-int4", max_shard_size="100MB")
