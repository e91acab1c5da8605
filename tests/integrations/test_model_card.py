"""The model card that save_pretrained of a quantized model writes (hf_aoq/model_card.py, template in
model_cards/): a new README.md, or the quantization section added to the card already there,
idempotently; its content comes from the saved files."""
import json
import shutil
import os
from importlib import resources
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import hf_aoq
from hf_aoq import model_card
from hf_aoq.checkpoint import TensorInfo, format_bytes, read_checkpoint
from hf_aoq.model_card import END, START

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("no_network")


@pytest.fixture(scope="module")
def quantized(tiny_llama_dir):
    recipe = hf_aoq.FqnToConfig({
        "_default": hf_aoq.Int4WeightOnlyConfig(group_size=32),
        "re:.*self_attn\\.[qkv]_proj": hf_aoq.Int8DynamicActivationInt8WeightConfig(),
        "model.layers.1.mlp.down_proj": None,
    })
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16,
                                                quantization_config=hf_aoq.AOQConfig(recipe))


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n", 2)[1])


def test_save_pretrained_writes_a_card(quantized, tiny_llama_dir, tmp_path):
    quantized.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    info = read_checkpoint(tmp_path, build=False)

    meta = front_matter(card)
    assert meta["library_name"] == "transformers" and {"hf_aoq", "int4", "int8"} <= set(meta["tags"])
    assert "base_model" not in meta  # a local folder is not a Hub id
    assert f"| base model | `{tiny_llama_dir}` |" in card
    assert f"| size before (float weights) | {format_bytes(info.bytes_before)} |" in card
    assert f"| size after (this checkpoint) | {format_bytes(info.bytes_after)} (" in card
    assert info.bytes_after < info.bytes_before
    assert "| `model.layers.*.self_attn.q_proj` | 2 | int8 per-row dyn-act per_token |" in card
    assert "| `model.layers.*.self_attn.o_proj` | 2 | int4 g32 asym |" in card
    assert "| `model.layers.0.mlp.down_proj` | 1 | int4 g32 asym |" in card  # layer 1's is skipped
    assert f"| hf_aoq version | {hf_aoq.__version__} |" in card and "| checkpoint format version | 1 |" in card
    assert "pip install hf_aoq" in card and "import hf_aoq" in card
    assert f'from_pretrained("{tmp_path}")' in card
    recipe = json.loads(card.split("```json\n", 1)[1].split("```", 1)[0])
    assert recipe == json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert "Not measured" in card
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_card_already_there_is_kept_and_gets_the_section_once(quantized, tmp_path):
    mine = "---\nlicense: apache-2.0\n---\n\n# My quantized model\n\nNotes I wrote.\n"
    (tmp_path / "README.md").write_text(mine)
    quantized.save_pretrained(tmp_path)
    first = (tmp_path / "README.md").read_text()
    # The user's front matter and text are kept; the front matter gains the keys it lacked.
    meta = front_matter(first)
    assert meta["license"] == "apache-2.0" and meta["library_name"] == "transformers" and "hf_aoq" in meta["tags"]
    assert first.split("---\n", 2)[2].startswith("\n# My quantized model\n\nNotes I wrote.\n")
    assert first.count(START) == 1 and first.count(END) == 1
    assert "## Quantization" in first and "# My quantized model" in first

    # Edits outside the section survive a second save; the section is rewritten, not repeated.
    edited = first.replace("Notes I wrote.", "Notes I wrote, then edited.")
    edited = edited.replace("| base model |", "| BASE (hand edit) |")
    (tmp_path / "README.md").write_text(edited + "\nA footer.\n")
    quantized.save_pretrained(tmp_path)
    second = (tmp_path / "README.md").read_text()
    assert "Notes I wrote, then edited." in second and second.endswith("\nA footer.\n")
    assert "BASE (hand edit)" not in second and second.count(START) == 1
    quantized.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == second


def test_quality_figures_go_into_the_card(quantized, tmp_path):
    model_card.set_quality(quantized, {"wikitext-2 perplexity": "12.3 (bf16: 11.9)"})
    try:
        quantized.save_pretrained(tmp_path)
    finally:
        model_card.set_quality(quantized, None)
    card = (tmp_path / "README.md").read_text()
    assert "| wikitext-2 perplexity | 12.3 (bf16: 11.9) |" in card and "Not measured" not in card


def test_a_float_model_gets_no_card(tiny_llama_dir, tmp_path):
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(tmp_path)
    assert not (tmp_path / "README.md").exists()


def test_a_hub_base_model_goes_into_the_front_matter(tmp_path, quantized):
    quantized.save_pretrained(tmp_path)
    (tmp_path / "README.md").unlink()  # else the card there is kept, front matter and all
    path = model_card.write_model_card(tmp_path, base_model="HuggingFaceTB/SmolLM2-135M", load_name="me/smol-aoq")
    card = path.read_text()
    meta = front_matter(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and meta["base_model_relation"] == "quantized"
    assert card.count(START) == 1 and 'from_pretrained("me/smol-aoq")' in card


def test_merge_replaces_transformers_placeholder_card():
    new = model_card.render_card(_info([TensorInfo("a.0.w.weight", "int4 g32 asym", (4, 32), 256, 80, True)]))
    placeholder = "---\ntags: []\n---\n" + model_card._TRANSFORMERS_DEFAULT + "\n"
    assert model_card.merge(placeholder, new) == new
    assert model_card.merge("", new) == new
    once = model_card.merge("# Mine\n", new)
    assert model_card.merge(once, new) == once


def _info(tensors):
    from hf_aoq.checkpoint import CheckpointInfo

    return CheckpointInfo(Path("x"), [], tensors, [1], [hf_aoq.__version__])


def test_layer_groups_collapse_layer_numbers_and_list_partial_ones():
    t = lambda name, scheme, q=True: TensorInfo(name, scheme, (8, 32), 512, 100, q)  # noqa: E731
    tensors = [
        t("model.layers.0.mlp.up_proj.weight", "int4 g32 asym"),
        t("model.layers.1.mlp.up_proj.weight", "int4 g32 asym"),
        t("model.layers.2.mlp.up_proj.weight", "int4 g32 asym"),
        t("model.layers.0.mlp.down_proj.weight", "int8 per-row"),
        t("model.layers.1.mlp.down_proj.weight", "int4 g32 asym"),
        t("model.layers.2.mlp.down_proj.weight", "int4 g32 asym"),
        t("model.layers.3.mlp.down_proj.weight", "bf16", q=False),
        t("lm_head.weight", "fp8 e4m3 per-row"),
    ]
    assert model_card.layer_groups(tensors) == [
        ("model.layers.*.mlp.up_proj", "int4 g32 asym", 3),
        ("model.layers.0.mlp.down_proj", "int8 per-row", 1),
        ("model.layers.{1-2}.mlp.down_proj", "int4 g32 asym", 2),
        ("lm_head", "fp8 e4m3 per-row", 1),
    ]


def test_the_template_ships_as_package_data():
    shipped = resources.files("hf_aoq").joinpath("model_cards", model_card.TEMPLATE_NAME)
    assert shipped.read_text() == (REPO_ROOT / "model_cards" / model_card.TEMPLATE_NAME).read_text()
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert '"model_cards/*.md"' in pyproject
    text = model_card.template()
    assert text.count(START) == 1 and text.count(END) == 1


def test_a_card_that_cannot_be_written_warns_and_keeps_the_checkpoint(quantized, tmp_path):
    (tmp_path / "README.md").mkdir()  # a folder where the card should go
    with pytest.warns(UserWarning, match="could not write the model card"):
        quantized.save_pretrained(tmp_path)
    assert read_checkpoint(tmp_path).loads


# ---------------------------------------------------------------------- front matter (issue 20, item 7)
def test_the_front_matter_is_a_valid_model_card_with_task_and_tags(quantized, tmp_path):
    from huggingface_hub import ModelCard

    quantized.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")  # huggingface_hub parses it back
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"hf_aoq", "quantized", "int4", "int8"} <= set(card.data.tags)


def test_a_local_folder_whose_card_names_a_hub_model_gives_base_model_and_license(tiny_llama_dir, tmp_path):
    local = tmp_path / "my-copy"
    shutil.copytree(tiny_llama_dir, local)
    (local / "README.md").write_text("---\nbase_model: HuggingFaceTB/SmolLM2-135M\nlicense: apache-2.0\n---\n# Mine\n")
    model = AutoModelForCausalLM.from_pretrained(local, quantization_config=hf_aoq.AOQConfig(hf_aoq.Int8WeightOnlyConfig()))
    model.save_pretrained(tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    meta = front_matter(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and meta["base_model_relation"] == "quantized"
    assert meta["license"] == "apache-2.0"
    assert f"(from the local folder `{local}`)" in card


def test_a_hub_cache_snapshot_folder_names_its_repo(tiny_llama_dir, tmp_path):
    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_llama_dir, snapshot)
    model = AutoModelForCausalLM.from_pretrained(snapshot, quantization_config=hf_aoq.AOQConfig(hf_aoq.Int8WeightOnlyConfig()))
    model.save_pretrained(tmp_path / "out")
    meta = front_matter((tmp_path / "out" / "README.md").read_text())
    assert meta["base_model"] == "someone/tiny" and meta["base_model_relation"] == "quantized"
    assert "license" not in meta  # the snapshot has no card: nothing to carry over


def test_merge_adds_missing_keys_keeps_the_users_and_is_idempotent():
    new = model_card.render_card(_info([TensorInfo("a.0.w.weight", "int4 g32 asym", (4, 32), 256, 80, True)]),
                                 base_model="org/base")
    mine = "---\nlicense: mit\ntags:\n- mine\nbase_model: org/other\n---\n\n# Mine\n"
    merged = model_card.merge(mine, new)
    meta = front_matter(merged)
    assert meta["license"] == "mit" and meta["base_model"] == "org/other" and "base_model_relation" not in meta
    assert meta["tags"][:1] == ["mine"] and {"hf_aoq", "int4"} <= set(meta["tags"])
    assert model_card.merge(merged, new) == merged
    # A front matter that is not a mapping only gets the section.
    odd = "---\n- a list\n---\n# Odd\n"
    assert model_card.merge(odd, new).startswith(odd) and START in model_card.merge(odd, new)


# ---------------------------------------------------------------------- no global patch (issue 14)
def test_transformers_classes_are_not_patched_only_quantized_instances(quantized, tiny_llama_dir, tmp_path):
    from transformers import PreTrainedModel
    from transformers.modeling_utils import PreTrainedModel as Original

    # transformers' own functions (a wrapper made by functools.wraps keeps the name, not the code)
    assert PreTrainedModel.save_pretrained.__code__.co_filename.endswith("modeling_utils.py")
    assert PreTrainedModel._upload_modified_files.__code__.co_filename.endswith("hub.py")
    assert "save_pretrained" in vars(quantized) and "_upload_modified_files" in vars(quantized)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert "save_pretrained" not in vars(plain) and Original is PreTrainedModel


def test_without_the_private_upload_method_saving_still_writes_the_card(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    from transformers.utils.hub import PushToHubMixin

    monkeypatch.delattr(PushToHubMixin, "_upload_modified_files")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=hf_aoq.AOQConfig(hf_aoq.Int8WeightOnlyConfig()))
    assert "no PreTrainedModel._upload_modified_files" in caplog.text
    model.save_pretrained(tmp_path)
    assert START in (tmp_path / "README.md").read_text()



def test_the_card_and_the_writers_name_the_version_without_the_package_root():
    # issue 14: serialization and model_card took __version__ from hf_aoq/__init__, which imports
    # the transformers integration, which imports them. They now read hf_aoq/_version.py. (Started
    # as the command line, the root imports nothing, so an upward import would show here.)
    import subprocess
    import sys

    code = ("import sys; sys.argv = ['hf-aoq']\nimport hf_aoq.model_card, hf_aoq.serialization.common as c\n"
            "assert c.reader_version() == hf_aoq._version.__version__\n"
            "print('hf_aoq.integrations.transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "False", result.stderr


def test_an_mx_card_says_what_mxfp4_and_mxfp8_are_and_where_they_run(tiny_llama_dir, tmp_path):
    """Beyond the scheme names: the element formats, the block of 32 with its e8m0 scale, the
    bits per weight, the dynamic activations, and the kernel table's MX rows."""
    from hf_aoq import kernels

    fp4 = torch.float4_e2m1fn_x2
    recipe = hf_aoq.FqnToConfig({
        "_default": hf_aoq.MXFPInferenceConfig(activation_dtype=None, weight_dtype=fp4),
        "re:.*self_attn\\.[qkv]_proj": hf_aoq.MXFPInferenceConfig(),  # mxfp8: e4m3 weights and activations
    })
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16,
                                                 quantization_config=hf_aoq.AOQConfig(recipe))
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    part = model_card.section(card)
    assert "**MX weights** (OCP Microscaling v1.0): every block of 32 consecutive weights" in part
    assert "- `mx e2m1`: MXFP4: 4-bit floats e2m1" in part and "4.25 bits per weight" in part
    assert "- `mx e4m3`: MXFP8: 8-bit floats e4m3 (up to ±448); 8.25 bits per weight." in part
    assert "`dyn-act mx e4m3`: that layer's activations are quantized the same way" in part
    own = [k.name for k in kernels.kernels_for("linear", "MXTensor") if k.backend != "reference"]
    assert own and all(f"`{name}`" in part for name in own)
    assert part.index("**MX weights**") > part.index("stored unquantized") and part.index("**MX weights**") < \
        part.index("<details>")


def test_a_card_without_mx_weights_has_no_mx_text(quantized, tmp_path):
    quantized.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "MX weights" not in card and "Microscaling" not in card
    assert "tensors (embeddings, norms, and any layer the recipe skips) are stored unquantized" in card
