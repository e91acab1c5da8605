"""scripts/bench_llama_cpp.py: llama.cpp beside hf_aoq in the benchmark. The flow (convert,
quantize, llama-bench, parse, ratios, report) runs against stand-in tools that behave as llama.cpp's
do (the same arguments, files and JSON); the real tools run when HF_AOQ_LLAMA_BENCH names a
llama-bench (skipped otherwise: llama.cpp is not a dependency)."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import bench_llama_cpp as lc  # noqa: E402

_BENCH = r'''#!{python}
import json, sys
a = sys.argv[1:]
opt = {{a[i]: a[i + 1] for i in range(0, len(a) - 1, 2)}}
model, p, n, t = opt["-m"], int(opt["-p"]), int(opt["-n"]), int(opt["-t"])
assert opt["-o"] == "json"
size = len(open(model, "rb").read())
rows = [dict(model_filename=model, n_prompt=p, n_gen=0, avg_ts=1e9 / size, samples_ts=[1e9 / size] * 3,
             model_type="llama ?B", cpu_info="stand-in", build_commit="fake", n_threads=t),
        dict(model_filename=model, n_prompt=0, n_gen=n, avg_ts=1e8 / size, samples_ts=[1e8 / size, 2e8 / size, 1e8 / size],
             model_type="llama ?B", cpu_info="stand-in", build_commit="fake", n_threads=t)]
print(json.dumps(rows))
'''
_QUANTIZE = r'''#!{python}
import sys
src, dst, qtype = sys.argv[1:4]
bits = {{"Q8_0": 8.5, "Q4_0": 4.5, "Q4_K_M": 4.85}}[qtype]
data = open(src, "rb").read()
open(dst, "wb").write(data[: int(len(data) * bits / 16)])
'''
# The converter's interface as hf_aoq calls it: MODEL --outtype f16 --outfile OUT, and, for a
# model without a tokenizer, the conversion package's model classes and TextModel._set_vocab_none.
_CONVERTER = r'''import sys
def main():
    a = sys.argv[1:]
    out = a[a.index("--outfile") + 1]
    assert a[a.index("--outtype") + 1] == "f16"
    import conversion
    import conversion.base as b
    if "LlamaForCausalLM" not in b.ModelBase._model_classes["text"]:
        conversion.load_all_models()
    vocab = "none" if b.ModelBase._model_classes["text"]["LlamaForCausalLM"].set_vocab is b.TextModel._set_vocab_none else "read"
    open(out, "wb").write((vocab + "\n").encode() + b"\0" * 16000)
if __name__ == "__main__":
    main()
'''
_CONVERSION_BASE = r'''class ModelBase:
    _model_classes = {"text": {}}
class TextModel(ModelBase):
    def _set_vocab_none(self):
        pass
class LlamaModel(TextModel):
    def set_vocab(self):
        raise RuntimeError("needs a tokenizer")
'''
_CONVERSION_INIT = r'''def load_all_models():
    from .base import ModelBase, LlamaModel
    ModelBase._model_classes["text"]["LlamaForCausalLM"] = LlamaModel
'''


def _exe(path: Path, text: str) -> Path:
    path.write_text(text.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def fake_llama_cpp(tmp_path) -> Path:
    """A llama.cpp tree as its build leaves it: SRC/build/bin/{llama-bench,llama-quantize} and
    SRC/convert_hf_to_gguf.py (+ SRC/conversion, SRC/gguf-py)."""
    src = tmp_path / "llama.cpp"
    (src / "build" / "bin").mkdir(parents=True)
    (src / "conversion").mkdir()
    (src / "gguf-py").mkdir()
    (src / "convert_hf_to_gguf.py").write_text(_CONVERTER)
    (src / "conversion" / "__init__.py").write_text(_CONVERSION_INIT)
    (src / "conversion" / "base.py").write_text(_CONVERSION_BASE)
    _exe(src / "build" / "bin" / "llama-quantize", _QUANTIZE)
    return _exe(src / "build" / "bin" / "llama-bench", _BENCH)


def _model(tmp_path, tokenizer: bool = False) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


def test_run_converts_quantizes_benches_and_caches(tmp_path, fake_llama_cpp):
    model = _model(tmp_path)
    kw = dict(prefill_tokens=64, decode_tokens=8, threads=2, repeats=3, timeout=60, log=lambda m: None)
    rows, notes = lc.run(fake_llama_cpp, model, tmp_path / "cache", **kw)
    assert notes == [] and list(rows) == list(lc.TYPES)
    f16 = tmp_path / "cache" / "llama.cpp" / "model-f16.gguf"
    # no tokenizer files: the converter ran with every model class writing no vocabulary
    assert f16.read_bytes().startswith(b"none\n")
    size = f16.stat().st_size
    assert rows["f16"]["model_bytes"] == size
    assert rows["Q4_0"]["model_bytes"] == int(size * 4.5 / 16)
    assert rows["f16"]["prefill_s"] == pytest.approx(64 * size / 1e9)
    assert rows["f16"]["decode_tps"] == pytest.approx(1e8 / size)  # the median of the samples, not their mean
    assert rows["Q8_0"]["threads"] == 2 and rows["Q8_0"]["build"] == "fake"
    # kept files are reused: a second run converts nothing
    stamp = f16.stat().st_mtime_ns
    lc.run(fake_llama_cpp, model, tmp_path / "cache", **kw)
    assert f16.stat().st_mtime_ns == stamp
    assert not list((tmp_path / "cache" / "llama.cpp").glob("*.tmp"))


def test_model_with_a_tokenizer_uses_the_converter_as_is(tmp_path, fake_llama_cpp):
    model = _model(tmp_path, tokenizer=True)
    tools = lc.find_tools(fake_llama_cpp)
    out = lc.convert(tools, model, tmp_path / "m-f16.gguf", 60)
    assert out.read_bytes().startswith(b"read\n")


def test_missing_or_broken_tools_say_what_and_where(tmp_path, fake_llama_cpp):
    with pytest.raises(lc.LlamaCppError, match="not an executable llama-bench"):
        lc.find_tools(tmp_path / "nowhere" / "llama-bench")
    (fake_llama_cpp.parent / "llama-quantize").unlink()
    with pytest.raises(lc.LlamaCppError, match="no llama-quantize beside llama-bench"):
        lc.find_tools(fake_llama_cpp)
    _exe(fake_llama_cpp.parent / "llama-quantize", "#!/bin/sh\necho 'unknown type' >&2\nexit 3\n")
    rows, notes = lc.run(fake_llama_cpp, _model(tmp_path), tmp_path / "c", prefill_tokens=8, decode_tokens=2,
                         threads=1, repeats=1, timeout=60, log=lambda m: None)
    assert list(rows) == ["f16"]  # each quantized type failed alone, with the tool's message
    assert len(notes) == 3 and all("llama-quantize" in n and "exit status 3" in n and "unknown type" in n for n in notes)


def test_parse_bench_requires_both_tests():
    row = dict(n_prompt=0, n_gen=16, avg_ts=10.0)
    with pytest.raises(lc.LlamaCppError, match="lacks the pp256 or tg16 test"):
        lc.parse_bench(json.dumps([row]), 256, 16)
    with pytest.raises(lc.LlamaCppError, match="printed no JSON"):
        lc.parse_bench("| model | size |", 256, 16)
    got = lc.parse_bench(json.dumps([row, dict(n_prompt=256, n_gen=0, avg_ts=512.0)]), 256, 16)
    assert got["prefill_s"] == 0.5 and got["decode_tps"] == 10.0


def test_parse_decode_and_alternated_ratios():
    rows = [dict(n_prompt=0, n_gen=0, avg_ts=0.0), dict(n_prompt=0, n_gen=16, avg_ts=9.0, samples_ts=[10.0, 12.0, 8.0])]
    assert lc.parse_decode(json.dumps(rows), 16) == 10.0
    with pytest.raises(lc.LlamaCppError, match="lacks the tg32 test"):
        lc.parse_decode(json.dumps(rows), 32)
    with pytest.raises(lc.LlamaCppError, match="printed no JSON"):
        lc.parse_decode("| model |", 16)
    got = lc.alternated_ratios([10.0, 20.0, 30.0], [20.0, 20.0, 20.0])
    assert got == {"median": 1.0, "min": 0.5, "max": 1.5, "rounds": 3}
    assert lc.alternated_ratios([], [1.0]) == {}


def test_pairs_alternate_the_order_every_round(monkeypatch):
    """benchmark.py's pairs step: hf_aoq's decode and each llama.cpp type's, in turn, the order
    reversed every other round, one list of tok/s per side."""
    import argparse

    import benchmark

    calls = []

    class Model:
        config = type("C", (), {"vocab_size": 100})

    def ours(model, prompt, n):
        calls.append(("hf_aoq", n))
        return float(len(calls))

    def theirs(bench, path, *, decode_tokens, threads, timeout):
        assert (bench, decode_tokens, threads) == ("llama-bench", 8, 2)
        calls.append((Path(path).name, decode_tokens))
        return 100.0 + len(calls)

    monkeypatch.setattr(benchmark, "load", lambda *args, **kw: Model())
    monkeypatch.setattr(benchmark, "decode_tps", ours)
    monkeypatch.setattr(benchmark.bench_llama_cpp, "decode_once", theirs)
    a = argparse.Namespace(config="int8", model="m", gguf="Q8_0=/x/q8.gguf,Q4_0=/x/q4.gguf", threads=2, compiled=False,
                           decode_tokens=8, prefill_tokens=16, llama_cpp="llama-bench", llama_cpp_rounds=3, timeout=60)
    got = benchmark.child_pairs(a)
    assert calls == [("hf_aoq", 4),  # warm-up
                     ("hf_aoq", 8), ("q8.gguf", 8), ("q4.gguf", 8),
                     ("q8.gguf", 8), ("q4.gguf", 8), ("hf_aoq", 8),
                     ("hf_aoq", 8), ("q8.gguf", 8), ("q4.gguf", 8)]
    assert got == {"hf_aoq_tps": [2.0, 7.0, 8.0], "compiled_tps": [],
                   "llama_tps": {"Q8_0": [103.0, 105.0, 109.0], "Q4_0": [104.0, 106.0, 110.0]}}


def test_ratios_pair_the_same_bits():
    ours = {"int8": {"decode_tps": 20.0, "prefill_s": 1.0, "model_bytes": 100}, "bf16": {"decode_tps": 5.0},
            "int4-head": {"decode_tps": 15.0, "prefill_s": 3.0, "model_bytes": 40}}
    theirs = {"Q8_0": {"decode_tps": 10.0, "prefill_s": 2.0, "model_bytes": 50}, "Q4_0": {"decode_tps": 30.0,
              "prefill_s": 1.5, "model_bytes": 20}}
    got = lc.ratios(ours, theirs)
    assert got == {"int8 / llama.cpp Q8_0": {"decode_tps": 2.0, "prefill_s": 0.5, "model_bytes": 2.0},
                   "int4-head / llama.cpp Q4_0": {"decode_tps": 0.5, "prefill_s": 2.0, "model_bytes": 2.0}}


def test_benchmark_reports_llama_cpp_rows_and_ratios(tmp_path, fake_llama_cpp):
    out = tmp_path / "bench.json"
    args = ["--tiny", "--layers", "1", "--configs", "bf16,int8", "--no-fidelity", "--cache-dir", str(tmp_path / "cache"),
            "--out", str(out), "--bandwidth-mb", "16", "--prefill-tokens", "16", "--decode-tokens", "2", "--repeats", "1",
            "--threads", "1", "--batches", "1"]
    r = subprocess.run([sys.executable, str(SCRIPTS / "benchmark.py"), *args, "--llama-cpp", str(fake_llama_cpp),
                        "--llama-cpp-rounds", "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    llama = report["llama_cpp"]
    assert set(llama["results"]) == set(lc.TYPES) and llama["threads"] == 1
    assert set(llama["vs"]) == {"bf16 / llama.cpp f16", "int8 / llama.cpp Q8_0"}
    assert "| hf_aoq / llama.cpp |" in r.stdout and "| Q4_K_M |" in r.stdout
    # the same pairs decoded alternated in one process, two rounds each
    alt = llama["alternated"]
    assert set(alt) == {"bf16 / llama.cpp f16", "int8 / llama.cpp Q8_0"}
    for key, v in alt.items():
        gguf = llama["results"][key.rpartition(" ")[2]]["gguf"]
        assert len(v["hf_aoq_tps"]) == 2 and v["compiled_tps"] == [] and v["compiled_ratio"] == {}
        assert v["llama_tps"] == [1e8 / Path(gguf).stat().st_size] * 2  # the stand-in's decode rate
        assert v["ratio"]["rounds"] == 2 and v["ratio"]["min"] <= v["ratio"]["median"] <= v["ratio"]["max"]
    assert "| hf_aoq / llama.cpp, alternated |" in r.stdout and "| int8 / llama.cpp Q8_0 | 2 |" in r.stdout
    # the saved report renders the same tables
    rendered = subprocess.run([sys.executable, str(SCRIPTS / "benchmark.py"), "--render", str(out)],
                              capture_output=True, text=True, timeout=120)
    assert "| int8 / llama.cpp Q8_0 |" in rendered.stdout
    # absent tools: the run completes, with a note
    r = subprocess.run([sys.executable, str(SCRIPTS / "benchmark.py"), *args, "--configs", "bf16",
                        "--llama-cpp", str(tmp_path / "no" / "llama-bench")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "llama.cpp skipped:" in r.stdout and "not an executable llama-bench" in r.stdout


@pytest.mark.skipif(not os.environ.get("HF_AOQ_LLAMA_BENCH"), reason="HF_AOQ_LLAMA_BENCH (a built llama-bench) not set")
def test_real_llama_cpp_on_a_tiny_llama(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    rows, notes = lc.run(os.environ["HF_AOQ_LLAMA_BENCH"], tmp_path / "model", tmp_path / "cache", prefill_tokens=32,
                         decode_tokens=4, threads=1, repeats=1, timeout=600, log=lambda m: None)
    assert notes == [] and set(rows) == set(lc.TYPES)
    assert rows["Q4_0"]["model_bytes"] < rows["Q8_0"]["model_bytes"] < rows["f16"]["model_bytes"]
    assert all(r["decode_tps"] > 0 and r["prefill_s"] > 0 for r in rows.values())
