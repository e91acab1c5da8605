#!/usr/bin/env python
"""Side-by-side benchmark of hf_aoq against bf16, fp32 and (when installed) torchao and optimum-quanto.

Every configuration runs in fresh processes, so peak RSS and timings belong to it alone:

  measure   quantize-on-load time and peak RSS (VmHWM), model bytes (quantized tensors counted
            field by field), 256-token prefill time, batch-1 greedy decode tokens/s with a KV cache
            (after a warm-up, median of repeats), then save_pretrained to a temp dir (save size)
  reload    load the saved checkpoint in a new process: time and peak RSS
  fidelity  on the real SmolLM2-135M weights: SQNR (dB) of the logits against bf16 and top-1
            agreement, on a fixed prompt of prose from tests/data/lee_background.cor

The default model has TinyLlama-1.1B's shape (Llama, hidden 2048, intermediate 5632, 22 layers,
32 heads, 4 KV heads, vocab 32000) with seeded random weights, built once and cached as bf16
safetensors. With --moe it is a small Mixtral instead (hidden 1024, 8 experts of intermediate
2048, top-2, 8 layers, 16 heads, 4 KV heads, vocab 32000: fused 3-D experts, quantized as such),
and fidelity is measured on that model itself (random token ids) rather than on SmolLM2. The machine's read bandwidth is measured once, and the batch-1 decode limit is
reported as bandwidth / bytes read per token.

    .venv/bin/python scripts/benchmark.py                                 # everything
    .venv/bin/python scripts/benchmark.py --configs bf16,int4 --layers 4  # quick
    .venv/bin/python scripts/benchmark.py --model PATH --out result.json
    .venv/bin/python scripts/benchmark.py --moe --configs bf16,int4,int8 --batches 1
    .venv/bin/python scripts/benchmark.py --configs bf16,int8,int4,int4dq --llama-cpp PATH/llama-bench

With --llama-cpp, llama.cpp runs on the same model in the same invocation (its own converter,
llama-quantize for Q8_0/Q4_0/Q4_K_M, llama-bench at the same lengths and threads) and the report
adds hf_aoq / llama.cpp ratios (scripts/bench_llama_cpp.py; skipped with a note when absent).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_llama_cpp  # beside this script (scripts/ is sys.path[0] when it runs)
from bench_machine import dir_bytes, machine_info, model_bytes, peak_rss_mb, read_bandwidth, rss_mb
from bench_report import compiled_keys, markdown, ratio

REPO = Path(__file__).resolve().parent.parent
PROSE = REPO / "tests" / "data" / "lee_background.cor"

TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000)
MOE = dict(hidden_size=1024, intermediate_size=2048, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
TINY_MOE = dict(TINY, num_local_experts=4, num_experts_per_tok=2)

# name -> (backend, scheme). Schemes: int4 (g128 weight-only), int8 (weight-only, per row),
# int8dyn (int8 weights, dynamic per-token int8 activations), fp8 (e4m3 weight-only, per row),
# fp8dyn (e4m3 weights and dynamic activations, per row).
# hf_aoq only: int4dq (Int4DQTensor, groups of 32 with 4-bit group parameters: the command line's
# int4), and int4-head / int4dq-head / int8-head / int8dyn-head, int4 / int4dq / int8 / int8dyn with
# lm_head quantized too (int4 g128, Int4DQ g32; a tied lm_head is untied first), since at batch 1 the bf16 lm_head is
# the largest single weight read per token (and llama.cpp's Q4_0 / Q8_0 quantize it:
# bench_llama_cpp.PAIRS).
# The rest are hf_aoq.configs.config_for_scheme's names, with its defaults: int2..int6 (IntxTensor,
# groups of 32), int8-int2..int8-int6 (the same with int8 per-token activations), int8-int4,
# fp8-int4, int4-int4 (Int4Tensor with activations quantized per token) and fp8-static (float8
# with a static per-tensor activation scale per linear, calibrated before timing: see CALIBRATION),
# int3-dq and int2-dq (IntxDQTensor: 3- or 2-bit codes on Int4DQ's group grid, groups of 32).
SCHEMES = ("int4", "int8", "int8dyn", "fp8", "fp8dyn")
NAMED_SCHEMES = ("int2", "int3", "int5", "int6", "int8-int2", "int8-int3", "int8-int5", "int8-int6",
                 "int8-int4", "fp8-int4", "int4-int4", "fp8-static", "mxfp8", "mxfp4", "nvfp4", "nvfp4-wo", "fp6",
                 "fp8-sparse", "int3-asym", "int3-dq", "int2-dq")
# fp8-static's activation scales: chosen by hf_aoq.calibrate_activation_scales on CALIBRATION
# batches of 128 tokens: random ids of another seed than the timed ones on the benchmark model
# (it has no tokenizer), and prose from past the scored text on SmolLM2 in the fidelity step.
# Calibration hooks nn.Linear inputs only, so with --moe the fused 3-D experts stay bf16 there.
CALIBRATION = (2, 128)
CONFIGS: dict[str, tuple[str, str | None]] = {"bf16": ("plain", "bf16"), "fp32": ("plain", "fp32")}
for _s in SCHEMES:
    CONFIGS[_s] = ("hf_aoq", _s)
    if _s == "int4":
        CONFIGS["int4dq"] = ("hf_aoq", "int4dq")
        CONFIGS["int4-head"] = ("hf_aoq", "int4-head")
        CONFIGS["int4dq-head"] = ("hf_aoq", "int4dq-head")
    if _s in ("int8", "int8dyn"):
        CONFIGS[f"{_s}-head"] = ("hf_aoq", f"{_s}-head")
for _s in NAMED_SCHEMES:
    CONFIGS[_s] = ("hf_aoq", _s)
for _s in SCHEMES:
    CONFIGS[f"torchao-{_s}"] = ("torchao", _s)
for _s in SCHEMES:
    CONFIGS[f"quanto-{_s}"] = ("quanto", _s)
PEER_MODULES = {"torchao": "torchao", "quanto": "optimum.quanto"}


class BenchError(Exception):
    """A failure to report as one line."""


# ---------------------------------------------------------------------------- helpers (child side)

def hf_aoq_config(scheme: str, recipe=None):
    import hf_aoq
    from hf_aoq.configs import config_for_scheme

    if scheme == "fp8-static":
        if recipe is None:
            raise BenchError("fp8-static needs its calibrated recipe (static_scales_recipe)")
        return recipe
    if scheme in NAMED_SCHEMES:
        return config_for_scheme(scheme)
    if scheme == "int4":
        # Groups of 128 everywhere: where 128 does not divide the input size (SmolLM2's 576),
        # the last group of each row is partial.
        return hf_aoq.Int4WeightOnlyConfig(group_size=128)
    if scheme == "int4dq":
        return hf_aoq.Int4DQWeightOnlyConfig()
    if scheme.endswith("-head"):  # lm_head quantized too, as llama.cpp's Q4_0 (Q6_K) and Q8_0 do
        body = hf_aoq_config(scheme.removesuffix("-head"))
        return hf_aoq.FqnToConfig({"_default": body, "lm_head": body})
    return {
        "int8": hf_aoq.Int8WeightOnlyConfig,
        "int8dyn": hf_aoq.Int8DynamicActivationInt8WeightConfig,
        "fp8": hf_aoq.Float8WeightOnlyConfig,
        "fp8dyn": hf_aoq.Float8DynamicActivationFloat8WeightConfig,
    }[scheme]()


def quantization_config(backend: str, scheme: str, recipe=None):
    """The transformers quantization_config for a configuration (None for bf16/fp32); `recipe` is
    fp8-static's calibrated FqnToConfig."""
    if backend == "plain":
        return None
    if backend == "hf_aoq":
        import hf_aoq

        return hf_aoq.AOQConfig(hf_aoq_config(scheme, recipe), untie_embedding_weights=scheme.endswith("-head"))
    if backend == "torchao":
        import torchao.quantization as tq
        from transformers import TorchAoConfig

        granularity = tq.PerRow() if hasattr(tq, "PerRow") else None
        quant = {
            "int4": lambda: tq.Int4WeightOnlyConfig(group_size=128),
            "int8": lambda: tq.Int8WeightOnlyConfig(),
            "int8dyn": lambda: tq.Int8DynamicActivationInt8WeightConfig(),
            "fp8": lambda: tq.Float8WeightOnlyConfig(),
            "fp8dyn": lambda: tq.Float8DynamicActivationFloat8WeightConfig(granularity=granularity),
        }[scheme]()
        return TorchAoConfig(quant_type=quant)
    if backend == "quanto":
        from transformers import QuantoConfig

        weights, activations = {
            "int4": ("int4", None), "int8": ("int8", None), "int8dyn": ("int8", "int8"),
            "fp8": ("float8", None), "fp8dyn": ("float8", "float8"),
        }[scheme]
        return QuantoConfig(weights=weights, activations=activations)
    raise BenchError(f"unknown backend {backend!r}")


def static_scales_recipe(path, batches):
    """fp8-static's recipe for the model at `path`: the bf16 model's linear inputs on `batches`
    (token id tensors) give each linear its activation scale. The recipe names exact weights, which
    would override AOQConfig's default skip of lm_head, so it leaves lm_head out itself, as every
    other config does. The bf16 copy is freed after."""
    import gc

    import hf_aoq
    from hf_aoq.configs import config_for_scheme
    from torch import nn

    model = load(path, "plain", "bf16")
    head = model.get_output_embeddings()
    recipe = hf_aoq.calibrate_activation_scales(model, config_for_scheme("fp8-static"), batches,
                                                filter_fn=lambda m, _: isinstance(m, nn.Linear) and m is not head)
    del model
    gc.collect()
    return recipe


def calibration_ids(vocab: int):
    import torch

    n, t = CALIBRATION
    return list(torch.randint(0, vocab, (n, 1, t), generator=torch.Generator().manual_seed(1)))


def load(path, backend: str, scheme: str, prequantized: bool = False, recipe=None):
    import torch
    from transformers import AutoModelForCausalLM

    if backend != "plain":
        import hf_aoq  # noqa: F401  (registers "aoq"; harmless for the peers)
    dtype = torch.float32 if scheme == "fp32" else torch.bfloat16
    kwargs = {} if prequantized or backend == "plain" else {"quantization_config": quantization_config(backend, scheme, recipe)}
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs).eval()


def warm_imports(path, backend: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    if backend != "plain":
        import hf_aoq  # noqa: F401
    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(str(path)))]  # imports the modeling module


def timed_prefill(model, ids) -> float:
    import torch

    with torch.inference_mode():
        start = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start


def decode_tps(model, prompt, new_tokens: int) -> float:
    """Greedy decode with the KV cache of every row of `prompt` (the batch); only the one-token
    steps are timed. Tokens per second over all rows."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new_tokens):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return prompt.shape[0] * new_tokens / (time.perf_counter() - start)


def kernels_used(fn) -> list[str]:
    """The hf_aoq kernel-table rows `fn()` ran, as "op Type: kernel (calls)", the calls of hf_aoq's
    GEMV for the linears left in bf16 (DenseLinear, as "linear bf16: dense_linear") and of its
    decode-step attention (hf_aoq/decode_attention.py, as "attention: decode_attention")."""
    try:
        from hf_aoq import kernels
        from hf_aoq.kernels import cpu_attention, cpu_dense
    except ImportError:
        return []
    seen: dict[str, int] = {}
    select, dense, attention = kernels.select_kernel, cpu_dense.dense_linear, cpu_attention.decode_attention

    def counting(op, x, w):
        k = select(op, x, w)
        key = f"{op} {type(w).__name__}: {k.name}"
        seen[key] = seen.get(key, 0) + 1
        return k

    def counting_dense(x, w, bias):
        seen["linear bf16: dense_linear"] = seen.get("linear bf16: dense_linear", 0) + 1
        return dense(x, w, bias)

    def counting_attention(*args):
        seen["attention: decode_attention"] = seen.get("attention: decode_attention", 0) + 1
        return attention(*args)

    kernels.select_kernel, cpu_dense.dense_linear = counting, counting_dense
    cpu_attention.decode_attention = counting_attention
    try:
        fn()
    finally:
        kernels.select_kernel, cpu_dense.dense_linear = select, dense
        cpu_attention.decode_attention = attention
    return [f"{k} ({n})" for k, n in sorted(seen.items())]


def draw_inputs(vocab: int, prefill_tokens: int):
    """The measure step's random inputs, in the order it draws them: the generator (its batch
    prompts come next), the prefill ids and the batch-1 decode prompt."""
    import torch

    gen = torch.Generator().manual_seed(0)
    prefill_ids = torch.randint(0, vocab, (1, prefill_tokens), generator=gen)
    return gen, prefill_ids, torch.randint(0, vocab, (1, 16), generator=gen)


def child_measure(a) -> dict:
    import torch

    torch.manual_seed(0)
    backend, scheme = CONFIGS[a.config]
    warm_imports(a.model, backend)  # so that load_s is loading, not importing modeling code
    res, recipe = {}, None
    if scheme == "fp8-static":  # before the timer; its peak RSS counts the bf16 copy calibration loads
        start = time.perf_counter()
        vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
        recipe = static_scales_recipe(a.model, calibration_ids(vocab))
        res["calibrate_s"] = time.perf_counter() - start
    res["rss_before_load_mb"] = rss_mb()
    start = time.perf_counter()
    model = load(a.model, backend, scheme, recipe=recipe)
    res["load_s"] = time.perf_counter() - start
    res["load_peak_rss_mb"] = peak_rss_mb()
    res["model_bytes"], res["bytes_per_token"] = model_bytes(model)
    vocab = model.config.vocab_size
    gen, prefill_ids, prompt = draw_inputs(vocab, a.prefill_tokens)

    decode_tps(model, prompt, 4)  # warm-up (also any one-time kernel build)
    timed_prefill(model, prefill_ids[:, :16])
    res["prefill_s"] = min(timed_prefill(model, prefill_ids) for _ in range(a.prefill_repeats))
    runs = [decode_tps(model, prompt, a.decode_tokens) for _ in range(a.repeats)]
    res["decode_tps"] = statistics.median(runs)
    res["decode_tps_runs"] = runs
    for b in batches(a):
        if b > 1:  # several streams at once: batch b, aggregate tokens/s, median of the repeats
            prompts = torch.randint(0, vocab, (b, 16), generator=gen)
            decode_tps(model, prompts, 2)
            res[f"decode_tps_b{b}"] = statistics.median(decode_tps(model, prompts, a.decode_tokens)
                                                        for _ in range(a.repeats))
    if a.compiled:  # the same prompts, static KV cache, the decode step compiled (one compile per batch size)
        from bench_compiled import compiled_decode  # scripts/, beside this file

        for b in compiled_batches(a):
            prompts = prompt if b == 1 else torch.randint(0, vocab, (b, 16), generator=gen)
            c = compiled_decode(model, prompts, a.decode_tokens, decode_tps, a.repeats)
            suffix = "" if b == 1 else f"_b{b}"
            res[f"compiled_decode_tps{suffix}"], res[f"compile_s{suffix}"] = c["tps"], c["compile_s"]
            res[f"compiled_eager_decode_tps{suffix}"] = c["eager_tps"]  # eager, alternated with the compiled runs
            if b == 1:
                res["compiled_decode_tps_runs"], res["kernels_decode_compiled"] = c["runs"], c["kernels"]
    # Which rows of hf_aoq's kernel table ran (untimed passes: the counting costs a little).
    res["kernels_prefill"] = kernels_used(lambda: timed_prefill(model, prefill_ids))
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        step = out.logits[:, -1:].argmax(-1)
        res["kernels_decode"] = kernels_used(lambda: model(input_ids=step, past_key_values=out.past_key_values,
                                                           use_cache=True))
    res["peak_rss_mb"] = peak_rss_mb()
    try:
        start = time.perf_counter()
        model.save_pretrained(a.save_dir)
        res["save_s"] = time.perf_counter() - start
        res["save_bytes"] = dir_bytes(Path(a.save_dir))
    except Exception as e:  # noqa: BLE001 - a peer that cannot save is a result, not a crash
        res["save_error"] = _one_line(e)
    return res


def child_reload(a) -> dict:
    backend, scheme = CONFIGS[a.config]
    warm_imports(a.save_dir, backend)
    start = time.perf_counter()
    model = load(a.save_dir, backend, scheme, prequantized=True)
    seconds = time.perf_counter() - start
    bytes_, _ = model_bytes(model)
    return {"reload_s": seconds, "reload_peak_rss_mb": peak_rss_mb(), "reload_model_bytes": bytes_}


def child_fidelity(a) -> dict:
    import torch

    backend, scheme = CONFIGS[a.config]
    from transformers import AutoTokenizer

    if a.moe:  # the benchmarked MoE itself (no tokenizer: random ids)
        source = a.model
        vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
        ids = torch.randint(0, vocab, (1, a.fidelity_tokens), generator=torch.Generator().manual_seed(0))
        calib = calibration_ids(vocab)
    else:
        source = a.smollm2_dir
        tokenizer = AutoTokenizer.from_pretrained(a.smollm2_dir)
        text = PROSE.read_text(encoding="utf-8", errors="replace")[:4000]
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, : a.fidelity_tokens]
        n, t = CALIBRATION  # from past the scored text
        rest = tokenizer(PROSE.read_text(encoding="utf-8", errors="replace")[4000:20000], return_tensors="pt")["input_ids"]
        calib = [rest[:, i * t:(i + 1) * t] for i in range(n)]
    ref_model = load(source, "plain", "bf16")
    with torch.inference_mode():
        ref = ref_model(input_ids=ids).logits.float()
    del ref_model
    recipe = static_scales_recipe(source, calib) if scheme == "fp8-static" else None
    model = load(source, backend, scheme, recipe=recipe)
    with torch.inference_mode():
        got = model(input_ids=ids).logits.float()
    noise = (ref - got).pow(2).mean()
    sqnr = float("inf") if noise == 0 else float(10 * torch.log10(ref.pow(2).mean() / noise))
    agree = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    return {"sqnr_db": sqnr, "top1_agree": agree, "fidelity_tokens": int(ids.shape[1])}


def child_prepare_smollm2(a) -> dict:
    from hf_aoq import smollm2

    model, tokenizer = smollm2.load()
    tmp = Path(a.smollm2_dir + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(a.smollm2_dir)
    return {}


def child_build_model(a) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    shape = default_shape(a)
    config_cls, model_cls = (MixtralConfig, MixtralForCausalLM) if a.moe else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(**shape, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_cls(config).to(torch.bfloat16)
    tmp = Path(a.model + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tmp.rename(a.model)
    return {}


def child_pairs(a) -> dict:
    """Decode alternated with llama.cpp's, round by round in this one process: per round hf_aoq's
    eager decode (and its compiled one with --compiled), then one llama-bench decode of each GGUF
    of --gguf (TYPE=PATH,...), the order reversed every other round. Lists of tok/s."""
    import torch

    torch.manual_seed(0)
    backend, scheme = CONFIGS[a.config]
    model = load(a.model, backend, scheme)
    vocab = model.config.vocab_size
    _, _, prompt = draw_inputs(vocab, a.prefill_tokens)  # the measure step's prompt
    ggufs = dict(item.split("=", 1) for item in a.gguf.split(","))
    threads = a.threads or torch.get_num_threads()
    decoder = None
    if a.compiled:
        from bench_compiled import CompiledDecoder  # scripts/, beside this file

        decoder = CompiledDecoder(model, prompt.shape[1] + 2 + a.decode_tokens)
        decoder.run(prompt, 2)  # compiles
    decode_tps(model, prompt, 4)  # warm-up

    def ours() -> None:
        res["hf_aoq_tps"].append(decode_tps(model, prompt, a.decode_tokens))
        if decoder is not None:
            res["compiled_tps"].append(a.decode_tokens / decoder.run(prompt, 2 + a.decode_tokens, timed_from=2)[1])

    def theirs() -> None:
        for qtype, path in ggufs.items():
            res["llama_tps"][qtype].append(bench_llama_cpp.decode_once(
                a.llama_cpp, path, decode_tokens=a.decode_tokens, threads=threads, timeout=a.timeout))

    res = {"hf_aoq_tps": [], "compiled_tps": [], "llama_tps": {q: [] for q in ggufs}}
    for r in range(a.llama_cpp_rounds):
        for step in ((ours, theirs) if r % 2 == 0 else (theirs, ours)):
            step()
    return res


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


def run_child(a) -> int:
    step = {"measure": child_measure, "reload": child_reload, "fidelity": child_fidelity, "pairs": child_pairs,
            "prepare-smollm2": child_prepare_smollm2, "build-model": child_build_model}[a.child]
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        result = step(a)
    except Exception as e:  # noqa: BLE001 - one line back to the parent
        if a.debug:
            raise
        result = {"error": _one_line(e)}
    Path(a.result).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------- parent side

def batches(a) -> list[int]:
    return [int(b) for b in str(a.batches).split(",") if b.strip()]


def compiled_batches(a) -> list[int]:
    return [int(b) for b in str(a.compiled_batches).split(",") if b.strip()]


def spawn(a, step: str, extra: list[str], timeout: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--child", step, "--result", result_path, *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=not a.verbose, text=True, timeout=timeout, env=env)
        data = json.loads(Path(result_path).read_text() or "{}")
        if proc.returncode and "error" not in data:
            tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            data["error"] = f"{step} child failed: {tail[0][:300]}"
    except subprocess.TimeoutExpired:
        data = {"error": f"{step} child ran past {timeout:.0f} s"}
    except (json.JSONDecodeError, OSError):
        data = {"error": f"{step} child returned no result (killed? out of memory?)"}
    finally:
        Path(result_path).unlink(missing_ok=True)
    data["_wall_s"] = time.perf_counter() - start
    return data


def common_args(a) -> list[str]:
    out = ["--batches", str(a.batches), "--prefill-tokens", str(a.prefill_tokens), "--prefill-repeats", str(a.prefill_repeats),
           "--decode-tokens", str(a.decode_tokens), "--repeats", str(a.repeats),
           "--fidelity-tokens", str(a.fidelity_tokens)]
    if a.threads:
        out += ["--threads", str(a.threads)]
    if a.compiled:
        out += ["--compiled", "--compiled-batches", str(a.compiled_batches)]
    if a.moe:
        out.append("--moe")
    if a.debug:
        out.append("--debug")
    return out


def default_shape(a) -> dict:
    shape = dict((TINY_MOE if a.tiny else MOE) if a.moe else (TINY if a.tiny else TINYLLAMA))
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    return shape


def default_model_dir(a) -> Path:
    shape = default_shape(a)
    name = "llama-h{hidden_size}-i{intermediate_size}-l{num_hidden_layers}-a{num_attention_heads}" \
           "-kv{num_key_value_heads}-v{vocab_size}-seed0-bf16".format(**shape)
    if a.moe:
        name = "mixtral-e{num_local_experts}-k{num_experts_per_tok}-".format(**shape) + name.removeprefix("llama-")
    return Path(a.cache_dir).expanduser() / name


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_llama_cpp(a, model_dir: Path, results: dict, notes: list) -> dict:
    """llama.cpp's rows on the same model, threads and lengths, and hf_aoq / llama.cpp ratios."""
    threads = a.threads or machine_info(a)["torch_threads"]
    try:
        rows, more = bench_llama_cpp.run(a.llama_cpp, model_dir, a.cache_dir, src=a.llama_cpp_src,
                                         prefill_tokens=a.prefill_tokens, decode_tokens=a.decode_tokens,
                                         threads=threads, repeats=a.repeats, timeout=a.timeout, log=log)
    except bench_llama_cpp.LlamaCppError as e:
        notes.append(f"llama.cpp skipped: {e}")
        return {}
    notes.extend(more)
    first = next(iter(rows.values()), {})
    return {"results": rows, "vs": bench_llama_cpp.ratios(results, rows), "build": first.get("build"),
            "threads": first.get("threads"), "cpu": first.get("cpu"),
            "alternated": alternate_with_llama_cpp(a, model_dir, results, rows, notes)}


def alternate_with_llama_cpp(a, model_dir: Path, results: dict, rows: dict, notes: list) -> dict:
    """hf_aoq / llama.cpp decode ratios from rounds alternated in one process (child_pairs): one
    child per hf_aoq config of bench_llama_cpp.PAIRS that decoded here, against each llama.cpp type
    paired with it. The separate rows above ran minutes apart; on a machine whose speed drifts
    (these VMs': 20-50% within minutes) only these ratios compare like with like."""
    if a.llama_cpp_rounds <= 0:
        return {}
    by_config: dict[str, list[str]] = {}
    for ours, theirs in bench_llama_cpp.PAIRS:
        if "decode_tps" in results.get(ours, {}) and rows.get(theirs, {}).get("gguf"):
            by_config.setdefault(ours, []).append(theirs)
    out = {}
    for ours, types in by_config.items():
        log(f"[{ours}] decode alternated with llama.cpp {', '.join(types)}, {a.llama_cpp_rounds} rounds ...")
        ggufs = ",".join(f"{t}={rows[t]['gguf']}" for t in types)
        m = spawn(a, "pairs", ["--config", ours, "--model", str(model_dir), "--gguf", ggufs, "--llama-cpp", a.llama_cpp,
                               "--llama-cpp-rounds", str(a.llama_cpp_rounds)] + common_args(a), a.timeout)
        for t in types:
            key = f"{ours} / llama.cpp {t}"
            if m.get("error"):
                out[key] = {"error": m["error"]}
                notes.append(f"{key}, alternated: {m['error']}")
                continue
            theirs = m["llama_tps"][t]
            out[key] = {"hf_aoq_tps": m["hf_aoq_tps"], "compiled_tps": m["compiled_tps"], "llama_tps": theirs,
                        "ratio": bench_llama_cpp.alternated_ratios(m["hf_aoq_tps"], theirs),
                        "compiled_ratio": bench_llama_cpp.alternated_ratios(m["compiled_tps"], theirs)}
    return out


def build_report(a, model_desc: str, bandwidth: float, probes: dict, results: dict, notes: list, complete: bool) -> dict:
    import torch
    import transformers

    base = results.get("bf16", {})
    metrics = ("decode_tps", *(f"decode_tps_b{b}" for b in batches(a) if b > 1), "prefill_s", "model_bytes", "load_s", "load_peak_rss_mb", "save_bytes", "reload_s")
    for name, r in results.items():
        r["vs_bf16"] = {m: ratio(r.get(m), base.get(m)) for m in metrics}
        for eager_key, key in compiled_keys(results):  # compiled decode: against eager bf16, and its own eager
            if key in r:
                r["vs_bf16"][key] = ratio(r.get(key), base.get(eager_key))
                side_by_side = r.get("compiled_eager_" + eager_key, r.get(eager_key))
                r.setdefault("compiled_vs_eager", {})[eager_key] = ratio(r.get(key), side_by_side)
    vs_peers = {}
    for name, r in results.items():
        backend, scheme = CONFIGS[name]
        if backend != "hf_aoq":
            continue
        for peer in PEER_MODULES:
            p = results.get(f"{peer}-{scheme}")
            if p and "decode_tps" in p and "decode_tps" in r:
                vs_peers[f"{name} / {peer}-{scheme}"] = {m: ratio(r.get(m), p.get(m)) for m in ("decode_tps", "prefill_s", "model_bytes")}

    report = {
        "machine": machine_info(a),
        "model": model_desc,
        "settings": {k: getattr(a, k) for k in ("prefill_tokens", "prefill_repeats", "decode_tokens", "repeats", "fidelity_tokens", "bandwidth_mb",
                                                "compiled", "compiled_batches")},
        "read_bandwidth_bytes_per_s": bandwidth,
        "read_bandwidth_probes": probes,
        "results": results,
        "vs_peers": vs_peers,
        "notes": notes,
        "complete": complete,
    }
    return report


def main_parent(a) -> int:
    names = [c.strip() for c in a.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise BenchError(f"unknown config(s) {unknown}; choose from {','.join(CONFIGS)}")
    notes: list[str] = []
    available = {}
    for backend, module in PEER_MODULES.items():
        try:
            available[backend] = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            available[backend] = False
    skipped = [c for c in names if CONFIGS[c][0] in available and not available[CONFIGS[c][0]]]
    for backend in PEER_MODULES:
        if any(CONFIGS[c][0] == backend for c in skipped):
            notes.append(f"{backend} configs skipped: `{PEER_MODULES[backend]}` is not importable")
    names = [c for c in names if c not in skipped]
    if "bf16" not in names:
        notes.append("bf16 not among the configs: no ratios to bf16")

    cache = Path(a.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    if a.model:
        model_dir = Path(a.model).expanduser()
        if not (model_dir / "config.json").is_file():
            raise BenchError(f"--model {model_dir}: no config.json there (expected a transformers model directory)")
        model_desc = str(model_dir)
    else:
        model_dir = default_model_dir(a)
        kind = "Mixtral (MoE)" if a.moe else "Llama"
        model_desc = f"random-weight {kind}, {model_dir.name} (cached in {model_dir.parent})"
        if not (model_dir / "config.json").is_file():
            log(f"building {model_dir.name} (once) ...")
            extra = ["--model", str(model_dir)] + (["--tiny"] if a.tiny else []) + (["--layers", str(a.layers)] if a.layers else [])
            r = spawn(a, "build-model", extra + common_args(a), a.timeout)
            if "error" in r:
                raise BenchError(f"building the default model failed: {r['error']}")

    smollm2_dir = cache / "smollm2-135m-bf16"
    if not a.no_fidelity and not a.moe and not (smollm2_dir / "config.json").is_file():
        log("unpacking SmolLM2-135M to bf16 safetensors (once) ...")
        r = spawn(a, "prepare-smollm2", ["--smollm2-dir", str(smollm2_dir)] + common_args(a), a.timeout)
        if "error" in r:
            notes.append(f"fidelity skipped: {r['error']}")
            a.no_fidelity = True
    if a.no_fidelity and not any(n.startswith("fidelity skipped") for n in notes):
        notes.append("fidelity skipped (--no-fidelity)")

    log(f"measuring read bandwidth ({a.bandwidth_mb} MB buffer) ...")
    bandwidth, probes, probe = read_bandwidth(a.bandwidth_mb)
    notes.append("read bandwidth probes: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in probes.items())
                 + f"; the decode limit takes the fastest ({probe})")

    results: dict[str, dict] = {}
    for name in names:
        r: dict = {"backend": CONFIGS[name][0], "scheme": CONFIGS[name][1]}
        with tempfile.TemporaryDirectory(prefix=f"hf_aoq_bench_{name}_") as tmp:
            save_dir = str(Path(tmp) / "saved")
            base = ["--config", name, "--model", str(model_dir), "--save-dir", save_dir] + common_args(a)
            log(f"[{name}] load, prefill, decode, save ...")
            m = spawn(a, "measure", base, a.timeout)
            r.update({k: v for k, v in m.items() if not k.startswith("_")})
            if "error" not in m and "save_error" not in m:
                log(f"[{name}] reload ...")
                rl = spawn(a, "reload", base, a.timeout)
                r.update({k if k != "error" else "reload_error": v for k, v in rl.items() if not k.startswith("_")})
        if not a.no_fidelity and name != "bf16":
            log(f"[{name}] fidelity on {'the MoE' if a.moe else 'SmolLM2-135M'} ...")
            f = spawn(a, "fidelity", ["--config", name, "--smollm2-dir", str(smollm2_dir), "--model", str(model_dir)]
                      + common_args(a), a.timeout)
            r.update({k if k != "error" else "fidelity_error": v for k, v in f.items() if not k.startswith("_")})
        elif not a.no_fidelity:
            r.update(sqnr_db=float("inf"), top1_agree=1.0)
        if r.get("bytes_per_token"):
            r["decode_limit_tps"] = bandwidth / r["bytes_per_token"]
        for k in ("error", "save_error", "reload_error", "fidelity_error"):
            if r.get(k):
                notes.append(f"{name}: {k.replace('_', ' ')}: {r[k]}")
        results[name] = r
        if a.out:  # after every configuration, so that an interrupted run keeps what it measured
            Path(a.out).write_text(json.dumps(build_report(a, model_desc, bandwidth, probes, results, notes, complete=False), indent=2, default=str))
        if "decode_tps" in r:
            log(f"[{name}] decode {r['decode_tps']:.2f} tok/s, prefill {r['prefill_s']:.2f} s, "
                f"model {r['model_bytes'] / 1e6:.1f} MB, load {r['load_s']:.1f} s")

    report = build_report(a, model_desc, bandwidth, probes, results, notes, complete=True)
    if a.llama_cpp:
        report["llama_cpp"] = run_llama_cpp(a, model_dir, results, notes)
    import torch
    import transformers

    table = markdown(report)
    mach = report["machine"]
    print(f"## hf_aoq benchmark\n\nModel: {model_desc}. Machine: {mach.get('cpu', mach['processor'])} "
          f"({mach['processor']}), {mach['cpus']} CPUs, {mach['torch_threads']} torch threads; CPU flags that matter: "
          f"{', '.join(mach.get('flags', [])) or 'unknown'}; torch dispatch {mach.get('torch_capability')}, hf_aoq's "
          f"kernels built for {mach.get('hf_aoq_extension_isa')}, bf16 GEMM on {mach.get('bf16_gemm')}, "
          f"quantized weights on {mach.get('weight_pages', 'unknown pages')}. "
          f"torch {torch.__version__}, transformers {transformers.__version__}. "
          f"Read bandwidth {bandwidth / 1e9:.1f} GB/s; decode limit = bandwidth / bytes read per token "
          f"(all weights but the input embedding), at batch 1; batches {a.batches} decode that many streams at once "
          f"(tok/s over all of them). Greedy, KV cache; decode over {a.decode_tokens} tokens, "
          f"median of {a.repeats}; prefill {a.prefill_tokens} tokens, best of {a.prefill_repeats}. "
          + (f"Fidelity: logits of this MoE vs its bf16 self ({a.fidelity_tokens} random token ids). " if a.moe else
             f"Fidelity: logits on SmolLM2-135M vs bf16 ({a.fidelity_tokens} tokens of tests/data/lee_background.cor). ") +
          f"Bytes read per token count the top-k experts of each MoE layer only. "
          f"RSS includes the process baseline (python, torch, transformers: ~0.35 GB). A plain safetensors load is "
          f"lazy (mmap): its load time and load peak RSS leave out paging the weights in, which the first forward pays; "
          f"'peak RSS' is the whole measure step's. Reload is timed right after the save, with the page cache warm.\n")
    print(table)
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2, default=str))
        log(f"wrote {a.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from: {','.join(CONFIGS)} (default: all; absent peers are skipped)")
    p.add_argument("--model", default=None, help="a local transformers model directory (default: random TinyLlama-shaped Llama)")
    p.add_argument("--layers", type=int, default=None, help="layers of the default model (default 22; fewer for a quick run)")
    p.add_argument("--tiny", action="store_true", help="a tiny default model (hidden 128, 2 layers, vocab 1000) for tests")
    p.add_argument("--moe", action="store_true", help="the default model is a small Mixtral (hidden 1024, 8 experts, "
                   "top-2, 8 layers; with --tiny: hidden 128, 4 experts), fidelity measured on it")
    p.add_argument("--cache-dir", default="~/.cache/hf_aoq/bench", help="where the default model and SmolLM2 bf16 are kept")
    p.add_argument("--out", default="benchmark.json", help="the JSON report (default benchmark.json; '' for none)")
    p.add_argument("--batches", default="1,4,16", help="decode batch sizes (comma-separated; default 1,4,16)")
    p.add_argument("--prefill-tokens", type=int, default=256)
    p.add_argument("--prefill-repeats", type=int, default=1)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="decode repeats (the median is reported)")
    p.add_argument("--fidelity-tokens", type=int, default=128)
    p.add_argument("--no-fidelity", action="store_true", help="skip the SmolLM2 fidelity step")
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="buffer size for the bandwidth measurement")
    p.add_argument("--compiled", action="store_true", help="also decode with a static KV cache and the step under "
                   "torch.compile (what `hf-aoq generate --compile` runs); the first compile is timed apart")
    p.add_argument("--compiled-batches", default="1,4", help="batch sizes of the compiled decode (default 1,4)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the children (default: torch's choice)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    p.add_argument("--render", default=None, metavar="JSON", help="only print the Markdown table of a saved (or partial) report")
    p.add_argument("--llama-cpp", default=None, metavar="LLAMA_BENCH",
                   help="also run llama.cpp on the same model: the path of llama-bench (llama-quantize beside it; "
                        "see scripts/bench_llama_cpp.py); skipped with a note when it cannot run")
    p.add_argument("--llama-cpp-src", default=None, metavar="DIR",
                   help="llama.cpp's source tree, for convert_hf_to_gguf.py (default: the tree llama-bench was built in)")
    p.add_argument("--llama-cpp-rounds", type=int, default=5, metavar="N",
                   help="with --llama-cpp: also decode each hf_aoq config alternated with its llama.cpp pairs in one "
                        "process, N rounds, and report the per-round ratios (default 5; 0: skip)")
    p.add_argument("--verbose", action="store_true", help="show the children's output")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    # internal: one step of one configuration, in a fresh process
    for flag in ("--child", "--result", "--config", "--save-dir", "--smollm2-dir", "--gguf"):
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    for k in ("prefill_tokens", "decode_tokens", "repeats", "prefill_repeats", "fidelity_tokens", "bandwidth_mb"):
        if getattr(a, k) <= 0:
            print(f"benchmark: --{k.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    if a.child:
        return run_child(a)
    if a.render:
        try:
            report = json.loads(Path(a.render).read_text())
            print(markdown(report))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"benchmark: --render {a.render}: {_one_line(e)}", file=sys.stderr)
            return 2
        if report.get("notes"):
            print("\nNotes:\n" + "\n".join(f"- {n}" for n in report["notes"]))
        return 0
    try:
        return main_parent(a)
    except BenchError as e:
        print(f"benchmark: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001
        if a.debug:
            raise
        print(f"benchmark: {_one_line(e)} (run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
