"""quantize_ and FqnToConfig on plain nn.Modules; torch.compile against eager."""
import copy
import warnings

import pytest
import torch
from torch import nn

from hf_aoq import (
    AOQError,
    AOQTensor,
    Float8DynamicActivationFloat8WeightConfig,
    Float8Tensor,
    Float8WeightOnlyConfig,
    FqnToConfig,
    Int4Tensor,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8Tensor,
    Int8WeightOnlyConfig,
    PerTensor,
    quantize_,
)

from conftest import cpu_int4_packing, sqnr
from models import tiny_llama_config, tiny_model


IDS = torch.tensor([[1, 5, 9, 77, 3, 0, 127]])

# Logit SQNR floors against the float model (random weights, two residual blocks).
MODEL_CONFIGS = [
    (Int4WeightOnlyConfig(32), 16.0),
    (Int8WeightOnlyConfig(), 36.0),
    (Int8DynamicActivationInt8WeightConfig(), 30.0),
    (Float8WeightOnlyConfig(), 25.0),
    (Float8DynamicActivationFloat8WeightConfig(), 22.0),
    (Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()), 22.0),
]


@pytest.mark.parametrize("config,floor", MODEL_CONFIGS, ids=[type(c).__name__ + str(i) for i, (c, _) in enumerate(MODEL_CONFIGS)])
def test_quantize_model_numerics(config, floor):
    model = tiny_model()
    with torch.no_grad():
        ref = model(IDS)
        q = quantize_(copy.deepcopy(model), config)
        linears = [m for m in q.modules() if isinstance(m, nn.Linear)]
        assert linears and all(isinstance(m.weight, AOQTensor) for m in linears)
        assert all(not isinstance(m.bias, AOQTensor) for m in linears if m.bias is not None)
        assert not isinstance(q.embed.weight, AOQTensor) and not isinstance(q.layers[0].norm.weight, AOQTensor)
        assert sqnr(ref, q(IDS)) > floor


@pytest.mark.parametrize("config", [c for c, _ in MODEL_CONFIGS], ids=[type(c).__name__ + str(i) for i, (c, _) in enumerate(MODEL_CONFIGS)])
def test_compile_matches_eager(config):
    # float32, so that the comparison sees the kernels and not bf16 rounding of fused float ops
    # (which also moves dynamic-activation codes across rounding boundaries).
    q = quantize_(tiny_model(torch.float32), config)
    with torch.no_grad():
        torch._dynamo.reset()
        compiled = torch.compile(q, fullgraph=True)
        for ids in (IDS, IDS[:, :3].repeat(2, 1)):
            assert sqnr(q(ids), compiled(ids)) > 60


def _config_of(p):
    if isinstance(p, Int4Tensor):
        return ("int4", p.group_size)
    if isinstance(p, Int8Tensor):
        return ("int8", p.act_quant)
    if isinstance(p, Float8Tensor):
        return ("fp8",)
    return None


def test_fqn_to_config_precedence():
    model = tiny_model(torch.float32)
    recipe = FqnToConfig({
        "_default": Int4WeightOnlyConfig(64),
        "re:layers\\.\\d+\\.q_proj": Int8WeightOnlyConfig(),          # module regex
        "re:layers\\.1\\.q_proj\\.weight": Float8WeightOnlyConfig(),   # parameter regex beats module regex
        "layers.0.down": None,                                       # exact module: skip
        "layers.1.down": Int8DynamicActivationInt8WeightConfig(),     # exact module
        "layers.1.down.weight": Int4WeightOnlyConfig(32),            # exact parameter beats exact module
        "re:.*norm.*": Int8WeightOnlyConfig(),                        # never matches norms (not Linear/Embedding)
        "re:embed": Int8WeightOnlyConfig(),                           # embeddings by regex
    })
    quantize_(model, recipe)
    got = {n: _config_of(p) for n, p in model.named_parameters()}
    assert got["layers.0.q_proj.weight"] == ("int8", None)
    assert got["layers.1.q_proj.weight"] == ("fp8",)
    assert got["layers.0.down.weight"] is None
    assert got["layers.1.down.weight"] == ("int4", 32)
    assert got["layers.0.up.weight"] == ("int4", 64)
    assert got["head.weight"] == ("int4", 64)
    assert got["layers.1.q_proj.bias"] is None and got["layers.0.down.bias"] is None
    assert got["layers.0.norm.weight"] is None
    assert got["embed.weight"] == ("int8", None)


def test_exact_bias_name_that_cannot_be_quantized_is_an_error():
    model = tiny_model(torch.float32)
    with pytest.raises(AOQError, match=r"layers.0.q_proj.bias: expected a 2-D weight"):
        quantize_(model, FqnToConfig({"layers.0.q_proj.bias": Int8WeightOnlyConfig()}))


def test_first_matching_regex_wins_and_none_skips():
    model = tiny_model(torch.float32)
    quantize_(model, FqnToConfig({
        "re:layers\\.0\\..*": None,
        "re:layers\\..*": Int8WeightOnlyConfig(),
        "_default": Int4WeightOnlyConfig(32),
    }))
    assert not isinstance(model.layers[0].up.weight, AOQTensor)
    assert isinstance(model.layers[1].up.weight, Int8Tensor)
    assert isinstance(model.head.weight, Int4Tensor)


def test_unknown_exact_names_warn():
    model = tiny_model(torch.float32)
    with pytest.warns(UserWarning, match="layers.9.up"):
        quantize_(model, FqnToConfig({"layers.9.up": Int8WeightOnlyConfig()}))


def test_bad_recipes_are_errors():
    with pytest.raises(AOQError, match="not a valid regex"):
        FqnToConfig({"re:(": Int8WeightOnlyConfig()})
    with pytest.raises(AOQError, match="must be a quantization config or None"):
        FqnToConfig({"x": "int8"})
    with pytest.raises(AOQError, match="needs a quantization config"):
        quantize_(tiny_model(), "int8")


def test_filter_fn_and_single_config():
    model = tiny_model(torch.float32)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn.startswith("layers.1"))
    assert isinstance(model.layers[1].up.weight, Int8Tensor)
    assert not isinstance(model.layers[0].up.weight, AOQTensor)
    assert not isinstance(model.head.weight, AOQTensor)
    # Already-quantized weights are left alone on a second pass.
    quantize_(model, Int4WeightOnlyConfig(32))
    assert isinstance(model.layers[1].up.weight, Int8Tensor)
    assert isinstance(model.layers[0].up.weight, Int4Tensor)


def test_tied_weights_stay_tied():
    model = tiny_model(torch.float32, tied=True)
    with torch.no_grad():
        ref = model(IDS)
    quantize_(model, FqnToConfig({"embed": Int8WeightOnlyConfig(), "head": Int8WeightOnlyConfig()}))
    assert model.head.weight is model.embed.weight
    assert isinstance(model.head.weight, Int8Tensor)
    with torch.no_grad():
        assert sqnr(ref, model(IDS)) > 30
    model = tiny_model(torch.float32, tied=True)
    with pytest.raises(AOQError, match="shared with another module"):
        quantize_(model, FqnToConfig({"embed": Int8WeightOnlyConfig(), "head": Int4WeightOnlyConfig(32)}))


@pytest.mark.parametrize("recipe", [
    FqnToConfig({"0": Int8WeightOnlyConfig(), "3": None}),
    FqnToConfig({"3": Int8WeightOnlyConfig()}),  # the embedding has no key: left as it is
    Int8WeightOnlyConfig(),  # reaches the Linear only
])
def test_a_tied_pair_resolved_two_ways_is_an_error_not_untied(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 32, bias=False))
    model[3].weight = model[0].weight
    with pytest.raises(AOQError, match=r"3.weight is tied to 0.weight .*different configs"):
        quantize_(model, recipe)
    assert model[3].weight is model[0].weight and not isinstance(model[0].weight, AOQTensor)


def test_module_to_dtype_and_back():
    model = quantize_(tiny_model(), Int4WeightOnlyConfig(32))
    with torch.no_grad():
        out_bf16 = model(IDS)
        model.to(torch.float32)
        w = model.layers[0].up.weight
        assert isinstance(w, Int4Tensor) and w.dtype == torch.float32 and w.packing == cpu_int4_packing()
        out_f32 = model(IDS)
    assert out_f32.dtype == torch.float32
    assert sqnr(out_f32, out_bf16) > 30


def test_state_dict_roundtrip_in_memory():
    model = quantize_(tiny_model(), Int4WeightOnlyConfig(32))
    other = quantize_(tiny_model(), Int4WeightOnlyConfig(32))
    with torch.no_grad():
        for p in other.parameters():
            if isinstance(p, AOQTensor):
                for t in p.tensor_fields().values():
                    t.zero_()
        other.load_state_dict(model.state_dict())  # copy_ between same-metadata tensors
        assert torch.equal(other(IDS), model(IDS))


def test_quantized_model_runs_under_inference_mode_and_no_grad_only_needed_for_compile():
    model = quantize_(tiny_model(), Int8WeightOnlyConfig())
    with torch.inference_mode():
        a = model(IDS)
    b = model(IDS)  # eager with autograd enabled: biases are float parameters
    assert torch.equal(a, b.detach())


_COMPILE_IN_FRESH_PROCESS = """
import json, sys
import torch
from torch._dynamo.utils import counters
import hf_aoq.core.compile_cache as compile_cache
if sys.argv[1] != "-":
    compile_cache.package_source_digest = lambda: sys.argv[1]  # as if hf_aoq's sources had changed
    compile_cache.tag_compile_caches()  # importing hf_aoq tagged torch's caches with the real digest
from hf_aoq import Float8WeightOnlyConfig, quantize_
from models import tiny_model
from test_quantize import IDS
q = quantize_(tiny_model(torch.float32), Float8WeightOnlyConfig())
with torch.no_grad():
    torch.compile(q, fullgraph=True)(IDS)
print(json.dumps({"aot": dict(counters["aot_autograd"]), "fx": dict(counters["inductor"]),
                  "tag": torch.compiler.config.cache_key_tag}))
"""


def test_compile_cache_is_keyed_on_hf_aoq_sources(tmp_path):
    # torch.compile caches compiled graphs on disk, keyed on the traced program and on each
    # input's `_stable_hash_for_caching`. The program holds torch.nn.functional.linear, not
    # hf_aoq's kernel code: without hf_aoq's sources in the key, a graph compiled by an older
    # hf_aoq (other kernels, other op arguments) was reused after an upgrade and returned NaN.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    here = Path(__file__).parent  # test_quantize, and tests/ for conftest and models
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")])
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)

    def compile_once(digest):
        r = subprocess.run([sys.executable, "-c", _COMPILE_IN_FRESH_PROCESS, digest], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = compile_once("-")
    assert first["aot"].get("autograd_cache_saved", 0) >= 1, first
    assert first["fx"].get("fxgraph_cache_miss", 0) >= 1, first
    again = compile_once("-")  # same sources: the key is stable across processes
    assert again["aot"].get("autograd_cache_hit", 0) >= 1 and not again["aot"].get("autograd_cache_miss"), again
    # Other sources: compiled afresh, by AOT autograd and by Inductor. The traced graph reads the
    # same, so Inductor's FX graph cache (which does not see the ops' schemas) would otherwise
    # return the older hf_aoq's compiled code: keyed through torch's cache key tag.
    changed = compile_once("0" * 64)
    assert changed["aot"].get("autograd_cache_miss", 0) >= 1 and not changed["aot"].get("autograd_cache_hit"), changed
    assert changed["fx"].get("fxgraph_cache_miss", 0) >= 1 and not changed["fx"].get("fxgraph_cache_hit"), changed
    assert changed["tag"].split(" ")[-1] == "hf_aoq-" + "0" * 32 and first["tag"] != changed["tag"]


def test_the_compile_cache_tag_keeps_the_users_words(monkeypatch):
    import torch

    from hf_aoq.core import compile_cache

    monkeypatch.setattr(compile_cache, "package_source_digest", lambda: "ab" * 32)
    # config.patch, not monkeypatch: monkeypatch's undo would delete the setting (torch's config
    # module keeps no instance attribute to restore), hiding it from every later compile.
    before = torch.compiler.config.cache_key_tag
    with torch.compiler.config.patch(cache_key_tag="mine hf_aoq-0123 also"):
        compile_cache.tag_compile_caches()
        assert torch.compiler.config.cache_key_tag == "mine also hf_aoq-" + "ab" * 16
        compile_cache.tag_compile_caches()  # again: the same tag
        assert torch.compiler.config.cache_key_tag == "mine also hf_aoq-" + "ab" * 16
    assert torch.compiler.config.cache_key_tag == before


def test_source_digest_sees_every_source_file(tmp_path):
    from hf_aoq.core.compile_cache import source_digest

    (tmp_path / "pkg" / "csrc").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "csrc" / "k.cpp").write_text("int f() { return 1; }\n")
    base = source_digest(tmp_path / "pkg")
    assert source_digest(tmp_path / "pkg") == base
    (tmp_path / "pkg" / "csrc" / "k.cpp").write_text("int f() { return 2; }\n")
    assert source_digest(tmp_path / "pkg") != base
    (tmp_path / "pkg" / "csrc" / "k.cpp").write_text("int f() { return 1; }\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not a source")
    assert source_digest(tmp_path / "pkg") == base


def test_plan_is_one_decision_per_tensor():
    from hf_aoq.quantize import Decision, plan

    model = tiny_model(torch.float32, tied=True)
    recipe = FqnToConfig({"embed": Int8WeightOnlyConfig(), "head": Int8WeightOnlyConfig(),
                          "layers.0.up": Int4WeightOnlyConfig(32), "layers.1.up.weight": None})
    decisions = plan(model, recipe)
    assert decisions == {
        # one tensor under two names, read by an Embedding too: quantized once, not placed
        "embed.weight": Decision(Int8WeightOnlyConfig(), (128, 64), place=False, tied=("head.weight",)),
        "layers.0.up.weight": Decision(Int4WeightOnlyConfig(32), (128, 64), place=True),
    }
    # The caller's skips win over exact names; default skips give way to them.
    assert plan(model, recipe, skip=lambda m, n: m == "layers.0.up").keys() == {"embed.weight"}
    assert plan(model, recipe, default_skip=lambda m, n: m.startswith("layers")).keys() == decisions.keys()
    assert plan(model, Int8WeightOnlyConfig(), default_skip=lambda m, n: m.startswith("layers.1"),
                filter_fn=lambda m, n: isinstance(m, nn.Linear) and n != "head").keys() == {
        f"layers.0.{p}.weight" for p in ("q_proj", "up", "down")}


def test_the_transformers_quantizer_plans_with_quantize_plan(monkeypatch):
    from transformers import LlamaForCausalLM

    import hf_aoq.integrations.transformers.quantizer as integration
    from hf_aoq import AOQConfig

    calls = []
    real = integration.plan
    monkeypatch.setattr(integration, "plan", lambda *a, **k: calls.append(k) or real(*a, **k))
    config = tiny_llama_config(hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, vocab=128)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    quantizer = integration.AOQHfQuantizer(AOQConfig(Int8WeightOnlyConfig(), modules_to_not_convert=["o_proj"]),
                                           pre_quantized=False)
    quantizer._process_model_before_weight_loading(model)
    assert len(calls) == 1 and calls[0]["ties"] == {}
    assert set(quantizer._configs) == {f"model.layers.0.{p}.weight" for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
