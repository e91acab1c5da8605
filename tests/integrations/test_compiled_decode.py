"""The compiled decode step: a static KV cache and torch.compile of the forward in transformers'
generate (hf_aoq.workflows.generation.compile_config), with hf_aoq's kernels as opaque custom ops.
One graph for every decode step (fullgraph: a graph break is an error), the kernels eager mode
runs called from it, and the tokens of eager greedy decoding."""
import collections
import copy

import pytest
import torch
from torch._dynamo.utils import counters

from hf_aoq import (
    Float8WeightOnlyConfig,
    Int4DQWeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    quantize_,
)
from hf_aoq.kernels import registry
from hf_aoq.workflows.generation import compiled_generation_kwargs

from conftest import sqnr
from models import tiny_llama

PROMPT = torch.tensor([[1, 5, 9, 77, 3, 10, 127, 300]])
NEW = 6

CONFIGS = [
    pytest.param(Int4WeightOnlyConfig(32), id="int4"),
    pytest.param(Int4DQWeightOnlyConfig(), id="int4dq", marks=pytest.mark.slow),
    pytest.param(Int8WeightOnlyConfig(), id="int8", marks=pytest.mark.slow),
    pytest.param(Float8WeightOnlyConfig(), id="fp8", marks=pytest.mark.slow),
]


def opaque_calls(fn) -> collections.Counter:
    """How often `fn()` calls each of hf_aoq's opaque ops (eagerly: straight to the function)."""
    seen = collections.Counter()
    call = registry.OpaqueOp.__call__

    def counting(self, *args):
        seen[self.qualname] += 1
        return call(self, *args)

    registry.OpaqueOp.__call__ = counting
    try:
        fn()
    finally:
        registry.OpaqueOp.__call__ = call
    return seen


@pytest.mark.parametrize("config", CONFIGS)
def test_compiled_decode_is_one_graph_of_the_eager_kernels_with_eager_tokens(config):
    model = quantize_(tiny_llama().eval(), config)
    greedy = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)
    with torch.inference_mode():
        eager = model.generate(PROMPT, **greedy)
        out = model(input_ids=PROMPT, use_cache=True, logits_to_keep=1)
        step = opaque_calls(lambda: model(input_ids=eager.sequences[:, -1:], past_key_values=out.past_key_values,
                                          use_cache=True))
    assert step, "no hf_aoq kernel ran in an eager decode step"

    torch._dynamo.reset()
    counters.clear()
    kwargs = compiled_generation_kwargs(PROMPT.shape[1] + NEW, model)  # as `hf-aoq generate --compile`
    ours = model._compiled_call
    with torch.inference_mode():
        first = model.generate(PROMPT, **greedy, **kwargs)  # compiles (tracing calls the ops' fakes)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled = model.generate(PROMPT, **greedy, **kwargs)
    assert model._compiled_call is ours  # transformers' generate took hf_aoq's compiled step
    compiled_generation_kwargs(PROMPT.shape[1] + NEW, model)
    assert model._compiled_call is ours  # and a second call keeps it (no new compile)
    # Every step of both calls ran one graph: no graph break, no recompilation.
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(first.sequences, compiled.sequences)
    # The compiled steps (the prefill runs eagerly) call eager's kernels as opaque ops, as often.
    ran = collections.Counter(e.name for e in prof.events() if e.name.startswith("hf_aoq::"))
    assert ran == {op: n * (NEW - 1) for op, n in step.items()}, (ran, step)

    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(eager.logits, compiled.logits):
        assert sqnr(a, b) > 25


def _greedy_steps(step, model, n):
    """`n` greedy tokens after PROMPT: eager prefill into a static cache, then `step` per token."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=PROMPT.shape[1] + n)
    with torch.inference_mode():
        tok = model(input_ids=PROMPT, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        out = [tok]
        for i in range(n - 1):
            pos = torch.full((1, 1), PROMPT.shape[1] + i, dtype=torch.long)
            tok = step(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1:].argmax(-1)
            out.append(tok)
    return torch.cat(out, 1)


def test_compiled_steps_of_two_models_of_one_class_never_share_a_graph():
    """compiled_step keeps no guards on the model's modules, which are what would tell two models
    of one class apart: each model's step has a code object, so a graph, of its own. Interleaved,
    each gives its eager tokens; `quantize_` drops a compiled call the model holds."""
    from hf_aoq.workflows.generation import compiled_step

    a = quantize_(tiny_llama().eval(), Int4WeightOnlyConfig(32))
    b = quantize_(tiny_llama(seed=1).eval(), Int8WeightOnlyConfig())
    eager = {m: _greedy_steps(m, m, NEW) for m in (a, b)}
    assert not torch.equal(eager[a], eager[b])
    torch._dynamo.reset()
    counters.clear()
    steps = {m: compiled_step(m) for m in (a, b)}
    assert steps[a] is not steps[b] and compiled_step(a) is steps[a]  # kept on the model, given again
    for _ in range(2):
        for m in (a, b):
            assert torch.equal(_greedy_steps(steps[m], m, NEW), eager[m])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])

    compiled_step(a, config=object())  # as compiled_generation_kwargs leaves it for generate
    assert a._compiled_call is not None
    quantize_(a, Int8WeightOnlyConfig(), filter_fn=lambda module, name: name.endswith("lm_head"))
    assert "_compiled_call" not in a.__dict__ and compiled_step(a) is not steps[a]
    clone = copy.deepcopy(b)  # holds b's step in its __dict__: never given to the copy
    assert compiled_step(clone) is not steps[b] and compiled_step(b) is steps[b]


def test_compiled_generate_workflow_and_command_line(tiny_llama_dir, tmp_path, capsys):
    """`hf-aoq generate --compile` on a saved int8 checkpoint: the eager command's text, and the
    compile timed apart."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_aoq
    from hf_aoq.cli import main
    from hf_aoq.workflows import generate

    out = tmp_path / "int8"
    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=hf_aoq.AOQConfig(Int8WeightOnlyConfig()))
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.save_pretrained(out)
    prompt = "w5 w9 w77 w3 w10"
    eager = generate(model.eval(), tokenizer, prompt, 5, chat=False)
    assert eager.compile_seconds is None
    torch._dynamo.reset()
    assert main(["generate", str(out), prompt, "--max-new-tokens", "5", "--compile", "--no-chat"]) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines()[-2] == eager.text
    assert "compiled the decode step in" in printed.err


def test_the_compiled_steps_code_has_serial_fused_kernels_and_no_size_asserts():
    """At one row the step's norms and activations are a microsecond of work: no parallel region
    (generation.SERIAL_CHUNK), where Inductor's default parallelizes a 2048-wide row. And no
    assert_size_stride calls (compiled_step's docstring says what checks them instead)."""
    from torch._inductor.utils import run_and_get_code
    from transformers import StaticCache

    from hf_aoq.workflows.generation import compiled_step

    def step_code(step, model):
        cache = StaticCache(config=model.config, max_cache_len=4)
        with torch.inference_mode():
            model(input_ids=PROMPT[:, :2], past_key_values=cache, use_cache=True)
            _, code = run_and_get_code(step, input_ids=PROMPT[:, 2:3], past_key_values=cache,
                                       position_ids=torch.tensor([[2]]), use_cache=True)
        return "\n".join(code)

    model = tiny_llama(hidden=2048, intermediate=2048, layers=1, heads=16, kv_heads=4, vocab=256).eval()
    torch._dynamo.reset()
    default = step_code(torch.compile(lambda **kw: model(**kw), fullgraph=True, dynamic=False), model)
    assert "#pragma omp parallel" in default and "assert_size_stride(" in default  # the test can tell
    torch._dynamo.reset()
    code = step_code(compiled_step(model), model)
    assert "#pragma omp parallel" not in code and "assert_size_stride(" not in code
