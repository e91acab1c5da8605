"""The command line as a new user meets it (issue 20): fast help, early and clear errors,
overwrites that replace the whole checkpoint, progress, one scheme rule, generate's options."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_aoq
from hf_aoq import cli, workflows
from hf_aoq.configs import SCHEMES
from hf_aoq.integrations.transformers import AOQConfig

pytestmark = pytest.mark.usefixtures("no_network")

_HEAVY = "import sys; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))"


# ---------------------------------------------------------------------- help (item 4)
@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_neither_torch_nor_transformers(flag):
    # As the `hf-aoq` console script runs it: argv[0] is the script, then `from hf_aoq.cli import main`.
    code = (f"import sys; sys.argv = ['/venv/bin/hf-aoq', {flag!r}]\nfrom hf_aoq.cli import main\n"
            f"try:\n    main()\nexcept SystemExit:\n    pass\n{_HEAVY}")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("[]"), result.stdout
    # `python -m hf_aoq`: -X importtime lists every module imported.
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "hf_aoq", flag], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "transformers"}
    assert (hf_aoq.__version__ in result.stdout) if flag == "--version" else ("int4-plain" in result.stdout)


def test_the_help_describes_every_scheme_and_command():
    assert list(cli.SCHEMES) == list(SCHEMES)  # the help's table and the config table name the same schemes
    text = cli.build_parser().format_help()
    for word in ("weight-only", "-dyn", "bits/weight", "examples:", "quantize", "push", "generate", "demo"):
        assert word in text
    sub = cli.build_parser()._subparsers._group_actions[0].choices
    for name in ("generate", "demo"):
        for action in sub[name]._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_importing_hf_aoq_still_registers_the_quantizer():
    result = subprocess.run([sys.executable, "-c", "import hf_aoq\nfrom transformers.quantizers import auto\n"
                             "print(auto.AUTO_QUANTIZER_MAPPING['aoq'].__name__)"], capture_output=True, text=True,
                            timeout=300)
    assert result.stdout.strip() == "AOQHfQuantizer", result.stderr


# ---------------------------------------------------------------------- sources (item 3)
@pytest.mark.parametrize("source, message", [
    ("./no-such-model", "./no-such-model: no such folder"),
    ("/no/such/model", "/no/such/model: no such folder (/no/such does not exist either)"),
    ("{tmp}/typo", "typo: no such folder"),  # the parent exists: a path, not a Hub id
    ("{tmp}/file.txt", "file.txt: a file, not a folder"),
    ("not a hub id!", "no such folder"),
])
def test_a_path_that_does_not_exist_is_said_at_once(source, message, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    argv = ["quantize", source.format(tmp=tmp_path), "--scheme", "int8", "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2  # no_network: any attempt to reach the Hub would fail the test instead
    err = capsys.readouterr().err
    assert message in err and "HF_TOKEN" not in err, err


def test_an_unreachable_hub_is_said_quickly(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert cli.main(["quantize", "someone/some-model", "--scheme", "int8", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the Hub at http://127.0.0.1:9" in err and "not in the local cache" in err, err


# ---------------------------------------------------------------------- overwrite (issue 13, item 2)
def _stored(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_overwrite_replaces_every_file_of_the_old_checkpoint(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int4", "--out", str(out), "--no-measure"]) == 0
    assert "model.safetensors" in _stored(out)
    (out / "notes.txt").write_text("an old file")
    argv = ["quantize", str(tiny_llama_dir), "--scheme", "int8", "--out", str(out), "--max-shard-size", "100KB",
            "--no-measure", "--overwrite"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    names = _stored(out)
    assert "model.safetensors" not in names and "notes.txt" not in names and "model.safetensors.index.json" in names
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, hf_aoq.Int8Tensor)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_a_failed_overwrite_leaves_the_old_checkpoint(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert cli.main(["quantize", str(tiny_llama_dir), "--scheme", "int4", "--out", str(out), "--no-measure"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(*args, **kwargs):
        raise RuntimeError("disk trouble while writing the card")

    monkeypatch.setattr("hf_aoq.model_card.write_model_card", broken)
    argv = ["quantize", str(tiny_llama_dir), "--scheme", "int8", "--out", str(out), "--no-measure", "--overwrite"]
    assert cli.main(argv) == 1 and "disk trouble" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_demo_refuses_a_folder_with_files_without_overwrite(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert cli.main(["demo", "--out", str(tmp_path)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err and (tmp_path / "keep.txt").exists()


# ---------------------------------------------------------------------- defaults (item 6)
def test_aoq_config_takes_transformers_name_and_reads_the_old_key():
    new = AOQConfig(hf_aoq.Int8WeightOnlyConfig(), include_input_output_embeddings=True)
    assert new.include_input_output_embeddings and new.include_embeddings
    data = new.to_dict()
    assert data["include_input_output_embeddings"] is True and "include_embeddings" not in data
    assert AOQConfig.from_dict(data) == new
    old = {**data, "include_embeddings": True}
    del old["include_input_output_embeddings"]
    assert AOQConfig.from_dict(old) == new  # a config.json written before the rename
    assert AOQConfig(hf_aoq.Int8WeightOnlyConfig(), include_embeddings=True) == new
    with pytest.raises(hf_aoq.AOQError, match="older name"):
        AOQConfig(hf_aoq.Int8WeightOnlyConfig(), include_input_output_embeddings=True, include_embeddings=False)
    with pytest.raises(hf_aoq.FormatError, match="older name"):
        AOQConfig.from_dict({**data, "include_embeddings": False})


def test_device_dtype_and_revision_reach_from_pretrained(tiny_llama_dir, tmp_path, monkeypatch):
    seen = {}
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    argv = ["quantize", str(tiny_llama_dir), "--scheme", "int8", "--out", str(tmp_path / "o"), "--no-measure",
            "--device", "cpu", "--dtype", "fp32", "--trust-remote-code"]
    assert cli.main(argv) == 0
    assert seen["device_map"] == "cpu" and seen["dtype"] is torch.float32 and seen["trust_remote_code"] is True
    assert cli.main(argv[:-3] + ["--device", "cpu", "--device-map", "auto"]) == 2


# ---------------------------------------------------------------------- progress (item 5)
def test_calibration_and_measurement_show_progress(tiny_llama_dir, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{3 + i % 500}" for i in range(600)))
    argv = ["quantize", str(tiny_llama_dir), "--scheme", "int4-plain", "--group-size", "32", "--calibration",
            str(text), "--calibration-tokens", "256", "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert re.search(r"GPTQ calibration: 100%\S* *\| *2/2 ", err), err  # one step per decoder layer
    assert re.search(r"Measuring weight error: 100%\S* *\| *14/14 ", err), err


# ---------------------------------------------------------------------- generate (item 9)
def test_generate_uses_the_chat_template_and_samples(tiny_llama_dir, tmp_path, capsys):
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "chat"
    shutil.copytree(tiny_llama_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = "{% for m in messages %}w7 {{ m['content'] }} w8{% endfor %}"
    tokenizer.save_pretrained(folder)
    AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=AOQConfig(hf_aoq.Int8WeightOnlyConfig())).save_pretrained(folder)
    assert cli.main(["generate", str(folder), "w5 w6", "--max-new-tokens", "4", "--do-sample", "--temperature",
                     "0.8", "--top-k", "5", "--seed", "1"]) == 0
    first = capsys.readouterr().out.splitlines()
    assert first[-1].endswith("tokens/s (chat template)")
    assert cli.main(["generate", str(folder), "w5 w6", "--max-new-tokens", "4", "--do-sample", "--temperature",
                     "0.8", "--top-k", "5", "--seed", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-2] == first[-2]  # --seed repeats the sample
    assert cli.main(["generate", str(folder), "w5 w6", "--max-new-tokens", "4", "--no-chat"]) == 0
    assert not capsys.readouterr().out.splitlines()[-1].endswith("(chat template)")


def test_a_busy_machine_is_named_with_what_helps():
    assert workflows.busy_note(load_average=0.3, cpus=4) is None
    note = workflows.busy_note(load_average=5.2, cpus=2)
    assert "busy (load average 5.2 on 2 CPUs)" in note and "OMP_WAIT_POLICY=PASSIVE" in note


def test_sizes_are_read_by_huggingface_hub():
    assert workflows.parse_size("1.5GB") == 1_500_000_000 and workflows.parse_size("123") == 123
    with pytest.raises(workflows.UsageError, match="not a size"):
        workflows.parse_size("5XB")


def test_recipe_json_reaches_the_checkpoint(tiny_llama_dir, tmp_path):
    from hf_aoq.configs import recipe_to_dict

    path = tmp_path / "r.json"
    path.write_text(json.dumps(recipe_to_dict(hf_aoq.FqnToConfig({"re:.*mlp.*": hf_aoq.Int8WeightOnlyConfig()}))))
    config = workflows.build_aoq_config("int4", 64, str(path))
    assert config.quant_type.mapping["_default"] == hf_aoq.Int4DQWeightOnlyConfig(group_size=64)
