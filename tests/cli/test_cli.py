"""The README's quick-start job, run as a user would."""
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open


def test_demo_quantizes_saves_reloads_and_generates(tmp_path):
    out = tmp_path / "int4"
    result = subprocess.run(
        [sys.executable, "-m", "hf_aoq", "demo", "--out", str(out), "--new-tokens", "8"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("  int4: ") for line in lines), result.stdout
    ratio = next(line for line in lines if line.startswith("int4/bf16: size "))
    assert float(ratio.split("size ")[1].split("x")[0]) < 0.6  # embeddings stay bf16 by default
    shards = list(Path(out).glob("*.safetensors"))
    assert shards
    with safe_open(str(shards[0]), framework="pt") as f:
        assert "hf_aoq" in (f.metadata() or {})


def test_cli_errors_are_one_line():
    result = subprocess.run([sys.executable, "-m", "hf_aoq", "demo", "--group-size", "48"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "invalid choice" in result.stderr


# ---------------------------------------------------------------------- quantize / inspect / generate
# In-process through hf_aoq.cli.main, which `python -m hf_aoq` calls (test_cli_errors_are_one_line
# above runs the real thing): a subprocess costs seconds of imports on a small machine.
import importlib.util
import os
import json
import re
import shutil

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_aoq
from hf_aoq import cli, workflows
from hf_aoq.configs import SCHEMES, MXFPInferenceConfig, config_for_scheme, recipe_to_dict

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("no_network")  # the tests below must not need the internet


@pytest.fixture(scope="module")
def int4_dir(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "int4"
    rc = cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int4-plain", "--group-size", "32",
                   "--skip", "model.layers.1.mlp", "--out", str(out)])
    assert rc == 0
    return out


def test_quantize_saves_checkpoint_tokenizer_and_card(int4_dir):
    names = set(os.listdir(int4_dir))
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= names
    q = json.loads((int4_dir / "config.json").read_text())["quantization_config"]
    assert q["quant_type"] == {"type": "Int4WeightOnlyConfig", "group_size": 32, "symmetric": False, "qparams": "mse"}
    assert q["modules_to_not_convert"] == ["model.layers.1.mlp"]
    model = AutoModelForCausalLM.from_pretrained(int4_dir)
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, hf_aoq.Int4Tensor)
    assert isinstance(model.model.layers[1].self_attn.o_proj.weight, hf_aoq.Int4Tensor)
    assert not isinstance(model.model.layers[1].mlp.up_proj.weight, hf_aoq.AOQTensor)
    card = (int4_dir / "README.md").read_text()
    assert "weight SQNR, mean over quantized tensors" in card  # measured against the local float weights


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_name_builds_its_config(scheme, tmp_path):
    cfg = config_for_scheme(scheme)
    expected = {
        "int4": hf_aoq.Int4DQWeightOnlyConfig(),  # about g128's size, g32's accuracy
        "int4-plain": hf_aoq.Int4WeightOnlyConfig(group_size=128),
        "int8": hf_aoq.Int8WeightOnlyConfig(),
        "int8-dyn": hf_aoq.Int8DynamicActivationInt8WeightConfig(),
        "fp8": hf_aoq.Float8WeightOnlyConfig(),
        "fp8-dyn": hf_aoq.Float8DynamicActivationFloat8WeightConfig(),
        "mxfp8": MXFPInferenceConfig(),
        "mxfp4": MXFPInferenceConfig(weight_dtype=torch.float4_e2m1fn_x2),
        **{f"int{b}": hf_aoq.IntxWeightOnlyConfig(getattr(torch, f"int{b}"), hf_aoq.PerGroup(32)) for b in (2, 3, 5, 6)},
        **{f"int8-int{b}": hf_aoq.Int8DynamicActivationIntxWeightConfig(getattr(torch, f"int{b}"), hf_aoq.PerGroup(32))
           for b in (2, 3, 5, 6)},
        "int8-int4": hf_aoq.Int8DynamicActivationInt4WeightConfig(group_size=32),
        "fp8-int4": hf_aoq.Float8DynamicActivationInt4WeightConfig(group_size=128),
        "int4-int4": hf_aoq.Int4DynamicActivationInt4WeightConfig(group_size=128),
        "fp8-static": hf_aoq.Float8StaticActivationFloat8WeightConfig(scale=None),
        "nvfp4": hf_aoq.NVFP4InferenceConfig(mm_config="dynamic"),
        "nvfp4-wo": hf_aoq.NVFP4WeightOnlyConfig(),
        "fp6": hf_aoq.FPXWeightOnlyConfig(3, 2),
        "fp8-sparse": hf_aoq.Float8DynamicActivationFloat8SemiSparseWeightConfig(activation_dtype=torch.float8_e4m3fn),
        **{f"int{b}-asym": hf_aoq.IntxWeightOnlyConfig(getattr(torch, f"int{b}"), hf_aoq.PerGroup(32), "asymmetric")
           for b in (2, 3, 5, 6)},
        "int3-dq": hf_aoq.IntxDQWeightOnlyConfig(3, 32),
        "int2-dq": hf_aoq.IntxDQWeightOnlyConfig(2, 32),
    }[scheme]
    assert cfg == expected
    if scheme == "fp8-static":  # its scales come from calibration text, which it needs
        with pytest.raises(workflows.UsageError, match="fp8-static needs --calibration"):
            workflows.build_aoq_config(scheme)
        (tmp_path / "text.txt").write_text("some text")
        assert workflows.build_aoq_config(scheme, calibration=str(tmp_path / "text.txt")).quant_type == expected
        return
    assert workflows.build_aoq_config(scheme).quant_type == expected


def test_group_size_reaches_the_config():
    # One rule: the group size changes the scheme's group size, never its tensor type (issue 20,
    # item 6: `--scheme int4 --group-size 32` used to switch to plain int4 at 5 bits per weight).
    assert config_for_scheme("int4", 32) == hf_aoq.Int4DQWeightOnlyConfig(group_size=32)
    assert config_for_scheme("int4", 64) == hf_aoq.Int4DQWeightOnlyConfig(group_size=64)
    assert config_for_scheme("int4-plain", 64) == hf_aoq.Int4WeightOnlyConfig(group_size=64)
    assert config_for_scheme("int8", 64) == hf_aoq.Int8WeightOnlyConfig(group_size=64)
    with pytest.raises(hf_aoq.AOQError, match="no group size"):
        config_for_scheme("fp8", 64)


def test_recipe_file_comes_first_and_scheme_is_the_default(tiny_llama_dir, tmp_path, capsys):
    recipe = hf_aoq.FqnToConfig({
        "model.layers.0.self_attn.q_proj": None,
        "re:.*mlp.*": hf_aoq.Int8WeightOnlyConfig(),
    })
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe_to_dict(recipe)))
    out = tmp_path / "mixed"
    rc = cli.main(["quantize", str(tiny_llama_dir), "--recipe", str(path), "--scheme", "fp8", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"^\[hf-aoq\] loading .* and quantizing while loading", stdout, re.M)
    assert re.search(r"^\[hf-aoq\] quantized in [\d.]+ s; saving to ", stdout, re.M)
    assert re.search(r"^\[hf-aoq\] saved 13 quantized tensors of 21: ", stdout, re.M)
    layers = AutoModelForCausalLM.from_pretrained(out).model.layers
    assert isinstance(layers[0].mlp.down_proj.weight, hf_aoq.Int8Tensor)
    assert isinstance(layers[0].self_attn.k_proj.weight, hf_aoq.Float8Tensor)
    assert not isinstance(layers[0].self_attn.q_proj.weight, hf_aoq.AOQTensor)
    assert isinstance(layers[1].self_attn.q_proj.weight, hf_aoq.Float8Tensor)


def _row(stdout: str, name: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if line.startswith(name + " "))
    return re.split(r"\s{2,}", line.strip())


def test_inspect_lists_every_tensor_with_sizes_and_error(int4_dir, tiny_llama_dir, capsys):
    assert cli.main(["inspect", str(int4_dir), "--error", str(tiny_llama_dir)]) == 0
    out = capsys.readouterr().out
    assert "format: hf_aoq format version 1, written by hf_aoq " + hf_aoq.__version__ in out
    name = "model.layers.0.mlp.up_proj.weight"
    row = _row(out, name)
    assert row[:3] == [name, "int4 g32 asym", "256x128"]
    # before: 256*128 bf16; after: what the file stores for it (codes, scale and zero).
    with safetensors.safe_open(str(int4_dir / "model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys() if k.startswith(name + ":"))
    assert row[3] == "65.5 kB" and row[4] == f"{stored / 1e3:.1f} kB" and stored < 65536 / 3
    assert 15 < float(row[5]) < 40 and row[6] == "ok"
    assert _row(out, "model.layers.1.mlp.up_proj.weight")[1:3] == ["bf16", "256x128"]
    assert re.search(r"^total: 21 tensors, 11 quantized; [\d.]+ kB -> [\d.]+ kB \(0\.\d\dx\)$", out, re.M)
    assert out.rstrip().endswith("every tensor loads: yes")


def test_inspect_reports_a_tensor_that_does_not_load(int4_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(int4_dir, broken)
    shard = broken / "model.safetensors"
    with safetensors.safe_open(str(shard), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.0.mlp.up_proj.weight:scale"] = tensors["model.layers.0.mlp.up_proj.weight:scale"][:10]
    safetensors.torch.save_file(tensors, str(shard), metadata=metadata)
    assert cli.main(["inspect", str(broken)]) == 2
    captured = capsys.readouterr()
    assert _row(captured.out, "model.layers.0.mlp.up_proj.weight")[-1] == "FAILS"
    assert _row(captured.out, "model.layers.0.mlp.gate_proj.weight")[-1] == "ok"
    assert "every tensor loads: NO" in captured.out
    assert captured.err.count("\n") == 1 and "do not load" in captured.err


def test_inspect_a_truncated_file_is_one_line(int4_dir, tmp_path, capsys):
    broken = tmp_path / "truncated"
    shutil.copytree(int4_dir, broken)
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert cli.main(["inspect", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not load" in err and "model.safetensors" in err


def test_generate_prints_the_greedy_text_and_speed(int4_dir, capsys):
    assert cli.main(["generate", str(int4_dir), "w5 w6 w7", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    match = re.fullmatch(r"(\d+) new tokens in [\d.]+ s: [\d.]+ tokens/s", out[-1])
    assert match and 1 <= int(match.group(1)) <= 6
    tokenizer = AutoTokenizer.from_pretrained(int4_dir)
    model = AutoModelForCausalLM.from_pretrained(int4_dir)
    ids = tokenizer("w5 w6 w7", return_tensors="pt")
    with torch.inference_mode():
        expected = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out[-2] == tokenizer.decode(expected[0, 3:], skip_special_tokens=True)


@pytest.mark.parametrize("argv, message", [
    (["quantize", "/no/such/model", "--scheme", "int4", "--out", "{tmp}/o"], "no such folder"),
    (["quantize", "{model}", "--scheme", "fp8", "--group-size", "64", "--out", "{tmp}/o"], "no group size"),
    (["quantize", "{model}", "--out", "{tmp}/o"], "--scheme int4|int4-plain|int8"),
    (["quantize", "{model}", "--scheme", "int4", "--group-size", "128", "--out", "{tmp}/o"],
     "--scheme int4 (Int4DQ) takes --group-size 32 or 64; for plain int4 in groups of 128 use --scheme int4-plain"),
    (["quantize", "{model}", "--recipe", "{tmp}/bad.json", "--out", "{tmp}/o"], "bad.json is not valid JSON"),
    (["quantize", "{model}", "--recipe", "{tmp}/unknown.json", "--out", "{tmp}/o"], "unknown.json"),
    (["quantize", "{model}", "--recipe", "{tmp}/missing.json", "--out", "{tmp}/o"], "cannot read the recipe file"),
    (["quantize", "{model}", "--scheme", "int4", "--out", "{model}"], "pass --overwrite"),
    (["quantize", "{model}", "--scheme", "int4", "--calibration", "{tmp}/none.txt", "--out", "{tmp}/o"],
     "none.txt: no such text file"),
    (["quantize", "{tmp}", "--scheme", "int4", "--out", "{tmp}/o"], "has no config.json"),
    (["inspect", "{tmp}/nothing"], "no such folder"),
    (["inspect", "{model}", "--error", "{tmp}/nothing"], "--error"),
    (["generate", "{float}", "hello"], "no tokenizer"),
    (["quantize", "{model}", "--scheme", "int4", "--max-shard-size", "5XB", "--out", "{tmp}/o"],
     "--max-shard-size 5XB: not a size; give an integer number of bytes, or a number with KB, MB, GB or TB"),
    (["quantize", "{model}", "--scheme", "int4", "--max-shard-size", "0", "--out", "{tmp}/o"], "--max-shard-size 0:"),
    (["convert-torchao", str(REPO_ROOT / "tests" / "fixtures" / "torchao" / "int8_weight_only"), "{tmp}/o",
      "--max-shard-size", "big"], "--max-shard-size big: not a size"),
])
def test_errors_are_one_line_with_what_to_do(argv, message, tiny_llama_dir, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "unknown.json").write_text(json.dumps({"type": "Int3Config"}))
    no_tokenizer = tmp_path / "float"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_llama_dir) / name, no_tokenizer / name)
    argv = [a.format(tmp=tmp_path, model=tiny_llama_dir, float=no_tokenizer) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hf-aoq {argv[0]}: ") and message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_other_failures_are_one_line_too_and_debug_shows_the_traceback(tiny_llama_dir, tmp_path, capsys):
    argv = ["quantize", str(tiny_llama_dir), "--scheme", "int8", "--group-size", "48", "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 1  # 48 does not divide the 128-wide layers
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "AOQError" in err and "does not fit" in err and "--debug" in err
    with pytest.raises(hf_aoq.AOQError, match="does not fit"):
        cli.main(argv + ["--debug"])
    with pytest.raises(cli.CLIError):
        cli.main(["--debug", "inspect", str(tmp_path / "nothing")])


def test_quantize_and_push_script_uses_the_cli_functions(hub, tiny_llama_dir, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("quantize_and_push", REPO_ROOT / "scripts" / "quantize_and_push.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.cli is cli
    out = tmp_path / "fp8"
    rc = script.main([str(tiny_llama_dir), "user/tiny-fp8", "--scheme", "fp8-dyn", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    files = hub.repos["user/tiny-fp8"].files
    assert files["model.safetensors"] == (out / "model.safetensors").read_bytes()
    assert "fp8 e4m3 per-row dyn-act per_row" in files["README.md"].decode()


def test_inspect_reads_the_shards_of_a_checkpoint_as_one(int4_dir, tmp_path, capsys):
    # save_pretrained writes the metadata of the whole checkpoint into every shard.
    model = AutoModelForCausalLM.from_pretrained(int4_dir)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert cli.main(["inspect", str(tmp_path)]) == 0
    sharded = capsys.readouterr().out
    assert cli.main(["inspect", str(int4_dir)]) == 0
    whole = capsys.readouterr().out
    assert re.search(r"^checkpoint: .* \(\d+ files\)$", sharded, re.M)
    assert sharded.splitlines()[1:] == whole.splitlines()[1:]


def test_readme_quick_start_is_what_ci_and_these_tests_run():
    """The README's two quick-start commands, verbatim: the first is the demo this file runs
    (after scripts/install.sh, which .ci/run also runs), the second is CI's test command."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]
    assert commands == [
        "bash scripts/install.sh && .venv/bin/python -m hf_aoq demo",
        "bash scripts/install.sh && .venv/bin/python -m pytest -q",
    ]
    ci = (root / ".ci" / "run").read_text()
    assert "scripts/install.sh" in ci and ".venv/bin/python -m pytest -q" in ci


@pytest.mark.parametrize("value, size", [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("100KB", 100_000), ("100kb", 100_000), ("1.5GB", 1_500_000_000),
    ("2TB", 2 * 10**12), ("123456", 123456), (4096, 4096),
])
def test_max_shard_size_reads_what_save_pretrained_reads(value, size):
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    assert cli.parse_size(value) == size
    # save_pretrained hands the value to huggingface_hub's splitter, which must read it as `size`:
    # items of `size` bytes in all fit one shard, one byte more does not. (Digits on the command
    # line are bytes, as an int is for save_pretrained.)
    as_given = int(value) if isinstance(value, str) and value.isdigit() else value

    def shards(sizes):
        split = split_state_dict_into_shards_factory(sizes, get_storage_size=lambda n: n, max_shard_size=as_given,
                                                     filename_pattern="model{suffix}.safetensors")
        return len(split.filename_to_tensors)

    assert shards({"a": size - 1, "b": 1}) == 1
    assert shards({"a": size, "b": 1}) == 2


def test_quantize_max_shard_size_writes_shards_with_an_index(int4_dir, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "sharded"
    rc = cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int4-plain", "--group-size", "32",
                   "--skip", "model.layers.1.mlp", "--out", str(out), "--max-shard-size", "100KB", "--no-measure"])
    assert rc == 0, capsys.readouterr().err
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    # The same stored tensors as the one-file checkpoint of the same command without the option.
    whole = safetensors.torch.load_file(int4_dir / "model.safetensors")
    sharded = {}
    for f in shards:
        sharded.update(safetensors.torch.load_file(out / f))
    assert set(index["weight_map"]) == set(sharded) == set(whole)
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, hf_aoq.Int4Tensor)
    reference = AutoModelForCausalLM.from_pretrained(int4_dir)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert cli.main(["inspect", str(out)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("every tensor loads: yes")
