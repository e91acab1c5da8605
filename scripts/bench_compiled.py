"""The compiled decode step as scripts/benchmark.py and scripts/profile_decode.py time it: a static
KV cache and the model's call under torch.compile (hf_aoq.workflows.generation.compiled_step), as
`hf-aoq generate --compile` runs it through transformers' generate."""
from __future__ import annotations

import statistics
import time
from typing import Callable


class CompiledDecoder:
    """Greedy decode with a static KV cache and the model's call under torch.compile, as
    `hf_aoq.workflows.generation.compiled_step` makes it for `hf-aoq generate --compile` (through
    transformers' generate): the prompt's prefill runs eagerly, every one-token step runs the
    compiled graph (one graph per batch size, fullgraph: hf_aoq's kernels are opaque ops in it)."""

    def __init__(self, model, max_cache_len: int):
        from hf_aoq.workflows.generation import compiled_step

        self.model, self.max_cache_len = model, max_cache_len
        self.step = compiled_step(model)

    def run(self, prompt, new_tokens: int, timed_from: int = 0) -> tuple[float, float]:
        """Decode `new_tokens` after `prompt`; (seconds of the first step, seconds of the steps
        from `timed_from` on)."""
        import torch
        from transformers import StaticCache

        b, n = prompt.shape
        if n + new_tokens > self.max_cache_len:
            raise ValueError(f"compiled decode: {n} + {new_tokens} tokens exceed the cache ({self.max_cache_len})")
        cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        with torch.inference_mode():
            out = self.model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1:].argmax(-1)
            first = start = 0.0
            for i in range(new_tokens):
                if i == timed_from:
                    start = time.perf_counter()
                t0 = time.perf_counter()
                pos = torch.full((b, 1), n + i, dtype=torch.long)
                out = self.step(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                if i == 0:
                    first = time.perf_counter() - t0
            return first, time.perf_counter() - start


def compiled_decode(model, prompt, new_tokens: int, eager_tps: Callable, repeats: int = 1) -> dict:
    """decode tok/s (median of `repeats`) with the compiled step, each repeat after an eager one
    (`eager_tps(model, prompt, new_tokens)`, benchmark.decode_tps: their median; on a shared machine the load moves between minutes, so the
    compiled/eager ratio is taken from runs side by side), the first compiled call's seconds
    (compilation included) apart, and the opaque ops (hf_aoq's kernels) one compiled step calls,
    as "op (calls)", seen by torch.profiler in an untimed pass."""
    import torch

    warm = 2
    dec = CompiledDecoder(model, prompt.shape[1] + warm + new_tokens)
    compile_s, _ = dec.run(prompt, warm)
    runs, eager = [], []
    for _ in range(repeats):
        eager.append(eager_tps(model, prompt, new_tokens))
        runs.append(prompt.shape[0] * new_tokens / dec.run(prompt, warm + new_tokens, timed_from=warm)[1])
    steps = 2
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dec.run(prompt, steps)  # the prefill is eager: its kernels are direct calls, not op events
    ops: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("hf_aoq::"):
            ops[e.name] = ops.get(e.name, 0) + 1
    return {"tps": statistics.median(runs), "runs": runs, "eager_tps": statistics.median(eager), "compile_s": compile_s,
            "kernels": [f"{k} ({n // steps})" for k, n in sorted(ops.items())]}
