"""llama.cpp beside hf_aoq in scripts/benchmark.py (`--llama-cpp PATH_TO_llama-bench`): the
benchmark's model is converted by llama.cpp's own converter (convert_hf_to_gguf.py, f16),
quantized by its own llama-quantize (Q8_0, Q4_0, Q4_K_M), and timed by llama-bench with the
benchmark's prompt length, decode length, repeats and threads; the rows come back in the
benchmark's units (decode tok/s at batch 1, prefill seconds, model bytes) with hf_aoq / llama.cpp
ratios for the same bits. llama.cpp is never a dependency: when the tools are absent or fail,
the comparison is skipped with a note saying why. How to build them: README ("llama.cpp").

The converter needs a tokenizer; the benchmark's default model is random weights without one,
so for a folder with no tokenizer files the converter runs with its "no vocabulary" writer
(tokenizer model "none", the vocabulary size kept), which llama-bench accepts: it feeds random
token ids either way.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TYPES = ("f16", "Q8_0", "Q4_0", "Q4_K_M")
# hf_aoq config -> the llama.cpp type of the same bits, for the ratios the issue's targets name
# (int8 weight-only per row against Q8_0's 8.5 bits; int4 g128 and the command line's int4 (int4dq)
# against Q4_0's 4.5 bits and Q4_K_M; bf16 against f16). llama-quantize also quantizes the output
# matrix (Q8_0 keeps Q8_0 there; Q4_0 and Q4_K_M write Q6_K), where hf_aoq's int4 and int8 keep
# lm_head in bf16: the -head configs quantize it too, which reads about what llama.cpp reads.
# Q8_0's matrix products quantize the activations to 8 bits as well (blocks of 32), as int8dyn
# does per token, so int8dyn is paired with it too.
PAIRS = (("bf16", "f16"), ("int8", "Q8_0"), ("int8-head", "Q8_0"), ("int8dyn", "Q8_0"), ("int8dyn-head", "Q8_0"),
         ("int4", "Q4_0"), ("int4dq", "Q4_0"), ("int4-head", "Q4_0"), ("int4dq-head", "Q4_0"), ("int4", "Q4_K_M"),
         ("int4dq", "Q4_K_M"), ("int4-head", "Q4_K_M"), ("int4dq-head", "Q4_K_M"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
# Run by the converter's Python when the model has no tokenizer: every text model class writes no
# vocabulary (TextModel._set_vocab_none) instead of reading one.
_NO_VOCAB = """
import sys
from conversion import load_all_models
from conversion.base import ModelBase, TextModel
load_all_models()
for classes in ModelBase._model_classes.values():
    for cls in classes.values():
        if issubclass(cls, TextModel):
            cls.set_vocab = TextModel._set_vocab_none
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
convert_hf_to_gguf.main()
"""


class LlamaCppError(Exception):
    """The comparison cannot run; the message says which tool or file and why."""


@dataclass(frozen=True)
class Tools:
    bench: Path
    quantize: Path
    converter: Path  # convert_hf_to_gguf.py, in the llama.cpp source tree

    @property
    def src(self) -> Path:
        return self.converter.parent


def find_tools(bench: str | os.PathLike, src: str | os.PathLike | None = None) -> Tools:
    """llama-bench at `bench`, llama-quantize beside it, and the converter in `src` (default:
    the source tree the build folder is in: SRC/build/bin/llama-bench)."""
    bench = Path(bench).expanduser().resolve()
    if not (bench.is_file() and os.access(bench, os.X_OK)):
        raise LlamaCppError(f"--llama-cpp {bench}: not an executable llama-bench")
    quantize = bench.with_name("llama-quantize")
    if not (quantize.is_file() and os.access(quantize, os.X_OK)):
        raise LlamaCppError(f"{quantize}: no llama-quantize beside llama-bench (build both targets)")
    roots = [Path(src).expanduser().resolve()] if src else [bench.parents[i] for i in (2, 3) if len(bench.parents) > i]
    for root in roots:
        if (root / "convert_hf_to_gguf.py").is_file():
            return Tools(bench, quantize, root / "convert_hf_to_gguf.py")
    raise LlamaCppError(f"no convert_hf_to_gguf.py in {', '.join(map(str, roots))} (pass --llama-cpp-src, the llama.cpp source tree)")


def _run(cmd: list[str], what: str, timeout: float, env: dict | None = None) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"{what} ran past {timeout:.0f} s") from None
    except OSError as e:
        raise LlamaCppError(f"{what}: {e}") from None
    if p.returncode:
        tail = [l for l in (p.stderr or p.stdout or "").strip().splitlines() if l.strip()][-1:] or ["no output"]
        raise LlamaCppError(f"{what} failed (exit status {p.returncode}): {tail[0][:300]}")
    return p.stdout


def convert(tools: Tools, model_dir: Path, out: Path, timeout: float) -> Path:
    """`model_dir` as an f16 GGUF at `out` (kept: reused while it is newer than the model's
    config.json), written to a temporary name and renamed."""
    if out.is_file() and out.stat().st_mtime >= (model_dir / "config.json").stat().st_mtime:
        return out
    tmp = out.with_name(out.name + ".tmp")
    has_vocab = any((model_dir / f).is_file() for f in TOKENIZER_FILES)
    args = [str(model_dir), "--outtype", "f16", "--outfile", str(tmp)]
    cmd = [sys.executable, str(tools.converter), *args] if has_vocab else [sys.executable, "-c", _NO_VOCAB, *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tools.src / "gguf-py"), str(tools.src)]))
    try:
        _run(cmd, f"llama.cpp's converter on {model_dir}", timeout, env)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def quantize(tools: Tools, f16: Path, qtype: str, timeout: float) -> Path:
    out = f16.with_name(f16.name.replace("-f16.gguf", f"-{qtype}.gguf"))
    if out.is_file() and out.stat().st_mtime >= f16.stat().st_mtime:
        return out
    tmp = out.with_name(out.name + ".tmp")
    try:
        _run([str(tools.quantize), str(f16), str(tmp), qtype], f"llama-quantize {qtype}", timeout)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _rate(r: dict) -> float:
    """A llama-bench test's tokens/s: the median of its samples, else its average."""
    samples = r.get("samples_ts")
    return float(statistics.median(samples)) if samples else float(r["avg_ts"])


def parse_bench(text: str, prefill_tokens: int, decode_tokens: int) -> dict:
    """{"prefill_s", "decode_tps", "model_type", "cpu", "build"} from `llama-bench -o json`
    output holding one prompt test and one generation test of one model."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise LlamaCppError(f"llama-bench printed no JSON ({e})") from None
    if not isinstance(rows, list):
        raise LlamaCppError("llama-bench's JSON is not a list of tests")
    out: dict = {}
    for r in rows:
        if not isinstance(r, dict):
            continue
        if r.get("n_prompt") == prefill_tokens and not r.get("n_gen"):
            out["prefill_s"] = prefill_tokens / _rate(r)
        elif r.get("n_gen") == decode_tokens and not r.get("n_prompt"):
            out["decode_tps"] = _rate(r)
        out.setdefault("model_type", r.get("model_type"))
        out.setdefault("cpu", r.get("cpu_info"))
        out.setdefault("build", r.get("build_commit"))
        out.setdefault("threads", r.get("n_threads"))
    if "prefill_s" not in out or "decode_tps" not in out:
        raise LlamaCppError(f"llama-bench's JSON lacks the pp{prefill_tokens} or tg{decode_tokens} test")
    return out


def bench(tools: Tools, gguf: Path, *, prefill_tokens: int, decode_tokens: int, threads: int, repeats: int,
          timeout: float) -> dict:
    text = _run([str(tools.bench), "-m", str(gguf), "-p", str(prefill_tokens), "-n", str(decode_tokens),
                 "-t", str(threads), "-r", str(repeats), "-o", "json"], f"llama-bench on {gguf.name}", timeout)
    return dict(parse_bench(text, prefill_tokens, decode_tokens), model_bytes=gguf.stat().st_size, gguf=str(gguf))


def parse_decode(text: str, decode_tokens: int) -> float:
    """Decode tok/s from `llama-bench -p 0 -n N -o json` output (one generation test)."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise LlamaCppError(f"llama-bench printed no JSON ({e})") from None
    for r in rows if isinstance(rows, list) else ():
        if isinstance(r, dict) and r.get("n_gen") == decode_tokens and not r.get("n_prompt"):
            return _rate(r)
    raise LlamaCppError(f"llama-bench's JSON lacks the tg{decode_tokens} test")


def decode_once(bench_path: str | os.PathLike, gguf: str | os.PathLike, *, decode_tokens: int, threads: int,
                timeout: float) -> float:
    """One llama-bench decode of `decode_tokens` tokens (no prompt, one repetition): tok/s. The
    benchmark alternates these with hf_aoq's decodes in one process (benchmark.py's pairs step),
    so that both sides of a ratio see the same minute of a machine whose speed drifts."""
    text = _run([str(bench_path), "-m", str(gguf), "-p", "0", "-n", str(decode_tokens), "-t", str(threads),
                 "-r", "1", "-o", "json"], f"llama-bench on {Path(gguf).name}", timeout)
    return parse_decode(text, decode_tokens)


def alternated_ratios(ours: list[float], theirs: list[float]) -> dict:
    """Per-round ratios of alternated decodes (hf_aoq / llama.cpp tok/s): median, min, max."""
    r = [a / b for a, b in zip(ours, theirs) if a and b]
    if not r:
        return {}
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "rounds": len(r)}


def run(bench_path, model_dir, cache_dir, *, src=None, prefill_tokens: int, decode_tokens: int, threads: int,
        repeats: int, timeout: float, log=print) -> tuple[dict[str, dict], list[str]]:
    """({llama.cpp type: row}, notes): every type of TYPES that converted, quantized and ran."""
    tools = find_tools(bench_path, src)
    model_dir = Path(model_dir)
    cache = Path(cache_dir).expanduser() / "llama.cpp"
    cache.mkdir(parents=True, exist_ok=True)
    log(f"[llama.cpp] converting {model_dir.name} with {tools.converter} ...")
    f16 = convert(tools, model_dir, cache / f"{model_dir.name}-f16.gguf", timeout)
    rows, notes = {}, []
    for qtype in TYPES:
        try:
            path = f16 if qtype == "f16" else quantize(tools, f16, qtype, timeout)
            log(f"[llama.cpp {qtype}] llama-bench pp{prefill_tokens} tg{decode_tokens}, {threads} threads ...")
            rows[qtype] = bench(tools, path, prefill_tokens=prefill_tokens, decode_tokens=decode_tokens,
                                threads=threads, repeats=repeats, timeout=timeout)
        except LlamaCppError as e:
            notes.append(f"llama.cpp {qtype}: {e}")
    return rows, notes


def ratios(results: dict[str, dict], llama: dict[str, dict]) -> dict[str, dict]:
    """hf_aoq / llama.cpp for the pairs of PAIRS present in both: decode tok/s (above 1: hf_aoq
    decodes faster), prefill seconds (below 1: hf_aoq prefills faster), model bytes."""
    out = {}
    for ours, theirs in PAIRS:
        r, p = results.get(ours) or {}, llama.get(theirs) or {}
        if "decode_tps" in r and "decode_tps" in p:
            out[f"{ours} / llama.cpp {theirs}"] = {
                m: (r[m] / p[m] if r.get(m) and p.get(m) else None) for m in ("decode_tps", "prefill_s", "model_bytes")}
    return out


def markdown(report: dict, fmt) -> list[str]:
    """The llama.cpp rows and ratios of a benchmark report, as Markdown lines; `fmt` formats a number."""
    llama = report.get("llama_cpp") or {}
    if not llama.get("results"):
        return []
    lines = ["", f"llama.cpp (build {llama.get('build')}, {llama.get('threads')} threads, its own converter and "
             "quantizer, llama-bench, batch 1):", "",
             "| llama.cpp | model MB | decode tok/s | prefill s |", "| --- | --- | --- | --- |"]
    for qtype, r in llama["results"].items():
        lines.append(f"| {qtype} | {fmt(r['model_bytes'] / 1e6, '.1f')} | {fmt(r.get('decode_tps'))} | {fmt(r.get('prefill_s'))} |")
    if llama.get("vs"):
        lines += ["", "| hf_aoq / llama.cpp | decode tok/s ratio | prefill s ratio | model bytes ratio |",
                  "| --- | --- | --- | --- |"]
        for key, v in llama["vs"].items():
            lines.append(f"| {key} | {fmt(v.get('decode_tps'))} | {fmt(v.get('prefill_s'))} | {fmt(v.get('model_bytes'))} |")
    alt = llama.get("alternated") or {}
    if alt:
        def span(r: dict) -> str:
            return f"{fmt(r['median'])} ({fmt(r['min'])}-{fmt(r['max'])})" if r else ""

        lines += ["", "Decode alternated in one process, round by round (hf_aoq, then each llama.cpp type, the order "
                  "reversed every other round), so that both sides of each ratio ran in the same minute: medians of "
                  "the rounds' tok/s, and the median (min-max) of the per-round ratios.", "",
                  "| hf_aoq / llama.cpp, alternated | rounds | hf_aoq tok/s | compiled tok/s | llama.cpp tok/s | "
                  "decode ratio | compiled decode ratio |", "| --- | --- | --- | --- | --- | --- | --- |"]
        def med(xs: list) -> float | None:
            return statistics.median(xs) if xs else None

        for key, v in alt.items():
            if v.get("error"):
                lines.append(f"| {key} | | {v['error']} | | | | |")
                continue
            lines.append(f"| {key} | {len(v.get('llama_tps', []))} | {fmt(med(v.get('hf_aoq_tps')))} | "
                         f"{fmt(med(v.get('compiled_tps')))} | {fmt(med(v.get('llama_tps')))} | "
                         f"{span(v.get('ratio', {}))} | {span(v.get('compiled_ratio', {}))} |")
    return lines
