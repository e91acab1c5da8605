#!/usr/bin/env python
"""Where one decode token's time goes: hf_aoq's kernels, attention, norms, Python and dispatch.

For each config (benchmark.py's names: bf16, int4, int4dq, int8, fp8, ...) it loads the model
(default: benchmark.py's TinyLlama-shaped Llama, cut to --layers), prefills a 16-token prompt and
decodes --tokens batch-1 tokens greedily, eagerly, with every interesting call timed by a stack
of wall clocks (each region's time excludes the regions nested in it):

  C++ kernel       hf_aoq's kernel call (registry.OpaqueOp's eager function: the C++ extension)
  kernel Python    the rest of the kernel-table row (input quantization, reshapes)
  linear dispatch  F.linear on the quantized weight: __torch_function__, the table lookup
  bf16 linears     nn.Linear with a plain weight (all of them in bf16; lm_head elsewhere)
  attention        the attention module less its projections: RoPE, KV cache update, SDPA
  norms            the RMSNorm modules
  MLP activation   the MLP module less its projections (act(gate) * up)
  layer glue       the decoder layer less the above (residual adds)
  model glue       the rest of the forward: embedding, rotary tables, mask, output objects
  loop             outside the forward: argmax, the Python loop

With --compiled it then times the same decode with a static KV cache and the forward compiled
(bench_compiled.CompiledDecoder, what `hf-aoq generate --compile` runs), alternating eager and
compiled runs, and reports the best ms/token of each. The per-layer figures
scale with the layer count; the head, embedding and loop are paid once per token.

    .venv/bin/python scripts/profile_decode.py --configs bf16,int4,int8 --layers 4 --threads 1 --compiled
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_compiled  # noqa: E402
import benchmark  # noqa: E402  (the benchmark's model, configs and loader)

ORDER = ("C++ kernel", "kernel Python", "linear dispatch", "bf16 linears", "lm_head", "attention", "norms",
         "MLP activation", "layer glue", "model glue", "loop")


class StackTimer:
    """Exclusive wall time per region: a region's time leaves out the regions opened inside it."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.stack: list[list] = []  # [name, start, time spent in children]

    def enter(self, name: str) -> None:
        self.stack.append([name, time.perf_counter(), 0.0])

    def exit(self) -> None:
        name, start, inner = self.stack.pop()
        spent = time.perf_counter() - start
        self.totals[name] = self.totals.get(name, 0.0) + spent - inner
        if self.stack:
            self.stack[-1][2] += spent

    @contextmanager
    def region(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.exit()


def instrument(model, timer: StackTimer):
    """Wrap the model's modules and hf_aoq's kernel calls in timed regions; returns an undo."""
    from torch import nn

    from hf_aoq import kernels
    from hf_aoq.core.tensor import AOQTensor
    from hf_aoq.kernels import registry

    undo = []
    head = model.get_output_embeddings()

    def label(module) -> str | None:
        cls = type(module).__name__
        if module is head:
            return "lm_head"
        if isinstance(module, nn.Linear):
            return "linear dispatch" if isinstance(module.weight, AOQTensor) else "bf16 linears"
        if cls.endswith("RMSNorm") or cls.endswith("LayerNorm"):
            return "norms"
        if cls.endswith("Attention"):
            return "attention"
        if cls.endswith("MLP"):
            return "MLP activation"
        if cls.endswith("DecoderLayer"):
            return "layer glue"
        return None

    for module in model.modules():
        name = label(module)
        if name is not None:
            pre = module.register_forward_pre_hook(lambda m, a, name=name: timer.enter(name))
            post = module.register_forward_hook(lambda m, a, o: timer.exit())
            undo += [pre.remove, post.remove]

    select = kernels.select_kernel
    timed: dict[int, tuple] = {}  # id(row) -> (row, its timed twin): made once, not per call

    def timed_select(op, x, w):
        k = select(op, x, w)
        known = timed.get(id(k))
        if known is None:
            def fn(*args, _fn=k.fn):
                with timer.region("kernel Python"):
                    return _fn(*args)

            known = timed[id(k)] = (k, type(k)(**{**k.__dict__, "fn": fn}))
        return known[1]

    kernels.select_kernel = timed_select
    undo.append(lambda: setattr(kernels, "select_kernel", select))
    call = registry.OpaqueOp.__call__

    def timed_call(self, *args):
        with timer.region("C++ kernel"):
            return call(self, *args)

    registry.OpaqueOp.__call__ = timed_call
    undo.append(lambda: setattr(registry.OpaqueOp, "__call__", call))
    return lambda: [u() for u in reversed(undo)]


def eager_breakdown(model, prompt, tokens: int) -> dict:
    import torch

    timer = StackTimer()
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        undo = instrument(model, timer)
        try:
            start = time.perf_counter()
            for _ in range(tokens):
                timer.enter("loop")
                timer.enter("model glue")
                out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                timer.exit()
                cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                timer.exit()
            wall = time.perf_counter() - start
        finally:
            undo()
    return {"ms_per_token": 1e3 * wall / tokens, **{k: 1e3 * v / tokens for k, v in timer.totals.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="bf16,int4,int8")
    p.add_argument("--model", default=None, help="a transformers model directory (default: benchmark.py's, built if absent)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compiled", action="store_true", help="also time the compiled decode step")
    p.add_argument("--rounds", type=int, default=3, help="eager and compiled timings, alternated (best is reported)")
    p.add_argument("--cache-dir", default="~/.cache/hf_aoq/bench")
    p.add_argument("--out", default="", help="write the figures as JSON here")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    if a.model:
        model_dir = Path(a.model)
    else:
        bench_args = benchmark.build_parser().parse_args(["--layers", str(a.layers), "--cache-dir", a.cache_dir])
        model_dir = benchmark.default_model_dir(bench_args)
        if not (model_dir / "config.json").is_file():
            bench_args.model = str(model_dir)
            benchmark.child_build_model(bench_args)
    results = {}
    for name in a.configs.split(","):
        backend, scheme = benchmark.CONFIGS[name]
        model = benchmark.load(model_dir, backend, scheme)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=gen)
        eager_breakdown(model, prompt, 4)  # warm-up
        r = eager_breakdown(model, prompt, a.tokens)
        dec = bench_compiled.CompiledDecoder(model, prompt.shape[1] + 2 + a.tokens) if a.compiled else None
        if dec is not None:
            r["compile_s"] = dec.run(prompt, 2)[0]
        eager, compiled = [], []
        for _ in range(a.rounds):  # alternated, best of each: on a shared machine the load moves
            eager.append(1e3 / benchmark.decode_tps(model, prompt, a.tokens))
            if dec is not None:
                compiled.append(1e3 * dec.run(prompt, 2 + a.tokens, timed_from=2)[1] / a.tokens)
        r["eager_plain_ms_per_token"], r["eager_runs"] = min(eager), eager
        if compiled:
            r["compiled_ms_per_token"], r["compiled_runs"] = min(compiled), compiled
        results[name] = r
        del model
        print(f"[{name}] done", file=sys.stderr, flush=True)

    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    print(f"ms per batch-1 decode token, {model_dir.name}, {a.threads} thread(s), {a.tokens} tokens "
          f"(instrumented; 'eager' and 'compiled': best of {a.rounds}, alternated, uninstrumented)\n")
    names = list(results)
    print("| region | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for region in ORDER:
        if any(region in r for r in results.values()):
            print(f"| {region} | " + " | ".join(f"{results[n].get(region, 0):.2f}" for n in names) + " |")
    for key, label in (("ms_per_token", "total (instrumented)"), ("eager_plain_ms_per_token", "eager"),
                       ("compiled_ms_per_token", "compiled (static cache)"), ("compile_s", "first compiled step, s")):
        if any(key in r for r in results.values()):
            print(f"| **{label}** | " + " | ".join(f"{results[n][key]:.2f}" if key in results[n] else "–"
                                                  for n in names) + " |")
    print(f"\n{layers} layers; per-layer regions scale with the layer count.")
    if a.out:
        Path(a.out).write_text(json.dumps({"model": str(model_dir), "threads": a.threads, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
