"""Generate text with a saved checkpoint and time it (`hf-aoq generate`), and the demo that
quantizes SmolLM2-135M and compares it with bf16 (`hf-aoq demo`)."""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .common import UsageError, check_model_source, log


@dataclass
class Sampling:
    """Greedy by default; `do_sample` with temperature / top-p / top-k as transformers takes them."""

    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    def kwargs(self) -> dict:
        if not self.do_sample:
            return {"do_sample": False}
        out = {"do_sample": True}
        out.update({k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                      ("top_k", self.top_k)) if v is not None})
        return out


@dataclass
class Generated:
    text: str
    new_tokens: int
    seconds: float
    chat: bool  # whether the prompt went through the tokenizer's chat template
    compile_seconds: float | None = None  # the compiled warm-up's time (torch.compile included), if compiled

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


def busy_note(load_average: float | None = None, cpus: int | None = None) -> str | None:
    """Why tokens/s may be low on this machine, or None: other processes already keep the cores
    busy (the 1-minute load average before generating), where OpenMP's spinning threads slow
    every step down."""
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except (OSError, AttributeError):  # not on every OS
            return None
    cpus = cpus or os.cpu_count() or 1
    if load_average < 0.75 * cpus:
        return None
    return (f"note: this machine is busy (load average {load_average:.1f} on {cpus} CPUs), so tokens/s is lower than "
            f"on a quiet one; on shared cores OMP_WAIT_POLICY=PASSIVE (or fewer threads, OMP_NUM_THREADS) helps "
            f"(README, Benchmark)")


def _prompt_ids(tokenizer, prompt: str, chat: bool | None):
    """Token ids of `prompt`, through the tokenizer's chat template when it has one (an Instruct
    model) unless `chat` is False; `chat=True` without a template is an error."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has_template:
        raise UsageError("--chat: this tokenizer has no chat template; drop --chat to send the prompt as plain text")
    if chat is None:
        chat = has_template
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        return {k: v for k, v in ids.items() if k in ("input_ids", "attention_mask")}, True
    return dict(tokenizer(prompt, return_tensors="pt")), False


def compile_config():
    """transformers' CompileConfig for a compiled decode step: one graph of the whole forward
    (hf_aoq's kernels are opaque custom ops in it, so a graph break is an error), static shapes
    (the static KV cache holds them fixed), Inductor's default mode (reduce-overhead's CUDA graphs
    do nothing on CPU). transformers compiles only on accelerators unless `_compile_all_devices`
    is set: on CPU it is what takes the per-token Python and dispatch out (docs/performance.md)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    config._compile_all_devices = True
    return config


# Inductor's fused C++ kernels (a decode step's norms, rotary embedding, residual adds and
# activations) run in one thread below this many elements per thread (`cpp.min_chunk_size`;
# torch's default 512). At batch 1 a row is a few thousand elements: a microsecond of work,
# where a parallel region's fork, wake-up and join cost more. Measured on the compiled int4
# step of a 22-layer TinyLlama-shaped model (AMD EPYC Zen 4, 2 threads; one process, 40
# alternated rounds of 10 tokens): -1.4 ms a token (median of the pairs) against the default;
# every fused kernel in one thread (`cpp.threads=1`) -0.9 ms. Larger work (many rows) stays
# parallel.
SERIAL_CHUNK = 16384


def compiled_step(model, config=None):
    """`model`'s call under torch.compile, for this model alone, with no guards on its modules;
    with `config` (a CompileConfig), also given to transformers' generate as the model's compiled
    call (it reuses a compiled call made for an equal config).

    Before each call of a compiled graph dynamo checks its guards; for a 22-layer model about 6,000,
    almost all on the modules (hooks dicts, attribute types and values, every weight's tensors),
    which take 2 ms of a 24 ms int4 token on an AMD EPYC Zen 4 (docs/performance.md): once the
    weights have streamed through, the guards' objects are no longer in any cache. This step
    leaves out every guard on the model's modules (torch's skip_guard_on_all_nn_modules_unsafe)
    and keeps those on its inputs (the tokens, positions and the KV cache). What the left-out
    guards would have caught:

    - another model calling the same graph: dynamo keeps compiled graphs per code object, and the
      module guards are what tell two models of one class apart. Here the compiled function is
      made for `model`, with a code object of its own, so no other model reaches its graph.
    - `model` changed after its first compiled call (modules or weights replaced, hooks added,
      attributes set): the graph would go on running the model as it was. `hf-aoq generate` and
      the benchmark never change a model while they generate; `quantize_` (hf_aoq's `carry_out`)
      drops the compiled call it finds on a model.

    Inductor's fused kernels (norms, activations) run in one thread below SERIAL_CHUNK elements a
    thread, as a decode step's are.

    The graph checks no sizes (Inductor's `size_asserts` off): by default its wrapper asserts the
    size and strides of every input and of every opaque op's output, about 700 Python calls a
    token for a 22-layer model (4 for each Int4DQ weight), 0.7-1.0 ms of a 21-30 ms token (AMD
    EPYC Zen 4; docs/performance.md). What they would catch is caught before: the inputs' sizes
    are among the guards this step keeps, the modules' weights are the model as it was compiled
    (above), and each op's fake (its output's size, which the graph is built on) is checked
    against its kernel by the tests (torch.library.opcheck).

    The step is kept on the model (`_hf_aoq_compiled_step`) and given again on the next call, so
    that a second generate reuses its graphs instead of compiling anew. Where torch takes no guard
    filter (before 2.8), every guard stays."""
    import torch

    from ..quantize import COMPILED_STEP

    owner, step = model.__dict__.get(COMPILED_STEP, (None, None))
    if owner != id(model):  # none yet, or a copy's (a deepcopy keeps the original's step)
        def call(*args, **kwargs):
            return model(*args, **kwargs)

        call.__code__ = call.__code__.replace(co_name=f"hf_aoq_compiled_step_{id(model):x}")  # its own graph cache
        skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
        options = {"guard_filter_fn": skip} if skip else {}
        options["cpp.min_chunk_size"] = SERIAL_CHUNK  # a decode step's norms and activations in one thread
        options["size_asserts"] = False  # the checks the guards and the tests already make (above)
        step = torch.compile(call, fullgraph=True, dynamic=False, options=options)
        model.__dict__[COMPILED_STEP] = (id(model), step)  # the step keeps the model alive: its id is its own
    if config is not None:
        model._compiled_call, model._last_compile_config = step, config  # transformers' generate reads these
    return step


def compiled_generation_kwargs(max_cache_len: int, model=None) -> dict:
    """generate()'s arguments for a static KV cache of `max_cache_len` tokens and the decode step
    compiled; the same length on every call keeps the cache's shape, so the graph is reused. With
    `model`, its compiled step is `compiled_step(model)` (no guards on its modules) rather than
    transformers' torch.compile of its `__call__`."""
    config = compile_config()
    if model is not None:
        compiled_step(model, config)
    return {"cache_implementation": "static", "compile_config": config, "max_cache_len": max_cache_len}


def generate(model, tokenizer, prompt: str, max_new_tokens: int, *, sampling: Sampling | None = None,
             chat: bool | None = None, exact_length: bool = False, compiled: bool = False) -> Generated:
    """Generate after a warm-up, timing only the generation. With `compiled`, a static KV cache and
    the decode step under torch.compile: the warm-up decodes two tokens, so that it compiles the
    step (timed apart, `compile_seconds`) and the timed generation reuses the graph."""
    import torch

    sampling = sampling or Sampling()
    inputs, used_chat = _prompt_ids(tokenizer, prompt, chat)
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    extra = {"min_new_tokens": max_new_tokens} if exact_length else {}
    warm = {"max_new_tokens": 1}
    compile_seconds = None
    if compiled:
        extra.update(compiled_generation_kwargs(inputs["input_ids"].shape[1] + max(max_new_tokens, 2), model))
        warm = {**extra, "max_new_tokens": 2, "min_new_tokens": 2}
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(**inputs, do_sample=False, pad_token_id=pad, **warm)
        if compiled:
            compile_seconds = time.perf_counter() - start
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling.kwargs(), **extra)
        seconds = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1]:]
    return Generated(tokenizer.decode(new, skip_special_tokens=True), new.numel(), seconds, used_chat, compile_seconds)


def load_for_generation(path: str, tokenizer_name: str | None = None, *, device_map=None, revision=None,
                        trust_remote_code: bool = False, token=None):
    """(model, tokenizer) of a saved checkpoint folder or Hub id, checked first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..integrations import transformers as _registers_aoq  # noqa: F401

    check_model_source(path, revision=revision, token=token)
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or path, revision=None if tokenizer_name else revision,
                                                  trust_remote_code=trust_remote_code, token=token)
    except Exception as e:
        raise UsageError(f"no tokenizer in {tokenizer_name or path} ({type(e).__name__}); save one there with "
                         f"tokenizer.save_pretrained, or pass --tokenizer NAME") from e
    log(f"loading {path}")
    kwargs = {"revision": revision, "trust_remote_code": trust_remote_code, "token": token}
    if device_map is not None:
        kwargs["device_map"] = device_map
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval(), tokenizer


@dataclass
class DemoResult:
    out: Path
    quantize_seconds: float
    prompt: str
    bf16: Generated
    int4: Generated
    bf16_bytes: int
    int4_bytes: int
    config: object


def demo(out, *, group_size: int = 32, prompt: str = "The capital of France is", new_tokens: int = 24,
         overwrite: bool = False) -> DemoResult:
    """SmolLM2-135M (GGUF, unpacked to bf16) quantized while loading with what `--scheme int4`
    makes (Int4DQ), saved to `out` like `hf-aoq quantize` does, reloaded, and compared with bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from .. import smollm2
    from ..configs import config_for_scheme
    from ..integrations.transformers import AOQConfig
    from .quantization import check_out_folder, quantize_checkpoint

    out = Path(out)
    check_out_folder(out, overwrite)
    torch.manual_seed(0)
    try:
        gguf = smollm2.gguf_path()
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    log(f"SmolLM2-135M from {gguf.name} (transformers unpacks the GGUF to bf16)")
    base, tokenizer = smollm2.load(torch.bfloat16)
    config = config_for_scheme("int4", group_size)
    with tempfile.TemporaryDirectory(prefix="hf_aoq_demo_") as tmp:
        base_dir = Path(tmp) / "bf16"
        base.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
        result = quantize_checkpoint(str(base_dir), AOQConfig(config), out, overwrite=overwrite, measure=False,
                                     card_base_model=smollm2.HUB_ID)
        bf16_bytes = sum(f.stat().st_size for f in base_dir.glob("*.safetensors"))
    int4_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    # Plain text, no chat template: the same prompt for both, compared token for token.
    bf16 = generate(base, tokenizer, prompt, new_tokens, chat=False, exact_length=True)
    int4 = generate(reloaded, tokenizer, prompt, new_tokens, chat=False, exact_length=True)
    return DemoResult(out, result.seconds, prompt, bf16, int4, bf16_bytes, int4_bytes, config)
