"""`hf-aoq export --format gguf`: hf_aoq checkpoints of a tiny Llama (with a byte-level BPE
tokenizer) go to one GGUF file whose tensors the `gguf` package decodes to hf_aoq's dequantized
weights bit for bit (q/k rows in llama.cpp's order), which transformers' GGUF loader turns back
into the same model, whose tokenizer transformers rebuilds from the file, and which `convert`
turns back into the identical hf_aoq tensors; weights with no exact GGUF form are refused by name
with nothing written, or re-quantized with --requantize."""
import json
import os
from pathlib import Path

import pytest
import torch

from hf_aoq import AOQConfig, FqnToConfig, Int4DQWeightOnlyConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig
from hf_aoq.cli import main as cli_main
from hf_aoq.core.tensor import AOQTensor
from hf_aoq.serialization import load_checkpoint
from hf_aoq.workflows import ExportError, convert_checkpoint, export_checkpoint

gguf = pytest.importorskip("gguf")

IDS = torch.tensor([[1, 5, 9, 33, 100, 7, 250, 3]])
TEXT = "the lazy fox, hello world"
RECIPES = {
    "q4_0": Int4WeightOnlyConfig(group_size=32, symmetric=True),
    "q8_0": Int8WeightOnlyConfig(group_size=32, scale_dtype=torch.float16),
    "mixed": FqnToConfig({"re:.*self_attn.*": Int4WeightOnlyConfig(group_size=32, symmetric=True),
                          "_default": Int8WeightOnlyConfig(group_size=32, scale_dtype=torch.float16)}),
}


def bpe_tokenizer(path: Path, vocab: int = 300):
    """A byte-level BPE tokenizer (what GGUF calls "gpt2") trained on a few sentences, saved to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "hello world, quantized models run anywhere"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    from models import tiny_llama_checkpoint

    path = tmp_path_factory.mktemp("float")
    tiny_llama_checkpoint(path, tokenizer=False)
    bpe_tokenizer(path)
    return path


def quantized(float_dir, root: Path, recipe, **kwargs) -> Path:
    """An hf_aoq checkpoint folder as `hf-aoq quantize` writes it (weights, config, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = root / "aoq"
    model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=AOQConfig(recipe, **kwargs))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(float_dir).save_pretrained(out)
    return out


def gguf_to_hf_order(name: str, values, config):
    """The gguf package's decoded tensor in transformers' row order: transformers' own llama
    processor undoes llama.cpp's q/k permutation."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": config.num_attention_heads,
                                        "num_key_value_heads": config.num_key_value_heads})
    return torch.from_numpy(proc.process(values, name).weights.copy())


def float_model_with(float_dir, weights, dtype):
    """The float model with every quantized weight replaced by hf_aoq's dequantization."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=dtype).eval()
    with torch.no_grad():
        for name, t in weights.items():
            if isinstance(t, AOQTensor):
                model.get_parameter(name).copy_(t.dequantize(dtype))
    with torch.inference_mode():
        return model(IDS).logits.float()


def assert_same_tensor(a, b, name):
    assert type(a) is type(b), name
    if not isinstance(a, AOQTensor):
        assert a.dtype == b.dtype and torch.equal(a, b), name
        return
    fa, fb = a.to_canonical().fields(), b.to_canonical().fields()
    assert fa.keys() == fb.keys(), name
    for f in fa:
        x, y = fa[f], fb[f]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y), (name, f)
        else:
            assert x == y, (name, f)


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------------- export, read back, load, convert back
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_export_reads_back_loads_and_converts_back(float_dir, tmp_path, recipe):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = quantized(float_dir, tmp_path, RECIPES[recipe])
    out = tmp_path / "gguf"
    summary = export_checkpoint(src, out, format="gguf")
    assert sum(summary.groups.values()) == 14 and not summary.requantized and not summary.notes
    card = (out / "README.md").read_text()
    assert "llama-cli -m" in card and 'gguf_file="model.gguf"' in card and "bit-exactly" in card
    ours = load_checkpoint(src)
    config = AutoConfig.from_pretrained(src)

    # the gguf package decodes every tensor to hf_aoq's dequantization (float32), bit for bit
    reader = gguf.GGUFReader(out / "model.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] in ("Q4_0", "Q8_0") and types["blk.0.attn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == "BF16" and "output.weight" in types
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == config.vocab_size  # padded to the embedding
    from hf_aoq.convert.gguf_meta import hf_name

    for t in reader.tensors:
        name = hf_name(t.name)
        got = gguf_to_hf_order(t.name, gguf.dequantize(t.data, t.tensor_type), config)
        want = ours[name].dequantize(torch.float32) if isinstance(ours[name], AOQTensor) else ours[name].float()
        assert got.shape == want.shape and torch.equal(got, want), name

    # transformers' GGUF loader builds the same model: in float32 the dequantized weights bit for
    # bit (so the logits equal those of the float model holding hf_aoq's dequantized weights)
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32).eval()
    state = model.state_dict()
    for name, t in ours.items():
        assert torch.equal(state[name], t.dequantize(torch.float32) if isinstance(t, AOQTensor) else t.float()), name
    with torch.inference_mode():
        got = model(IDS).logits.float()
    assert torch.equal(got, float_model_with(float_dir, ours, torch.float32))
    # and in bfloat16 too: its float32 values rounded once, as hf_aoq's dequantize(bfloat16) rounds them
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        got = model(IDS).logits.float()
    assert torch.equal(got, float_model_with(float_dir, ours, torch.bfloat16))

    # hf_aoq's own model (its CPU kernels) computes the same up to the kernels' rounding: int4 and
    # int8 kernels quantize activations per group (int16 / int8 codes, README "kernels"), and the
    # bf16 outputs differ by a few bf16 ulps of the largest logit; 5% of it bounds both.
    aoq = AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.inference_mode():
        mine = aoq(IDS).logits.float()
    assert float((got - mine).abs().max()) <= 0.05 * float(mine.abs().max())

    # the tokenizer transformers rebuilds from the file encodes as the source's
    ref = AutoTokenizer.from_pretrained(src)
    rebuilt = AutoTokenizer.from_pretrained(out, gguf_file="model.gguf")
    assert rebuilt(TEXT).input_ids == ref(TEXT).input_ids

    # and back: the identical hf_aoq tensors and the source's config
    back = tmp_path / "back"
    text = convert_checkpoint(out / "model.gguf", back).format_text()
    assert "-> Int" in text
    again = load_checkpoint(back)
    assert again.keys() == ours.keys()
    for name, t in ours.items():
        assert_same_tensor(t, again[name], name)
    back_config = json.loads((back / "config.json").read_text())
    assert back_config["hidden_size"] == config.hidden_size and back_config["quantization_config"]["quant_method"] == "aoq"
    reloaded = AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.inference_mode():
        assert torch.equal(reloaded(IDS).logits.float(), mine)


def test_asymmetric_int4_with_fp16_minimum_goes_as_q4_1(float_dir, tmp_path):
    """An asymmetric Int4Tensor whose scale and minimum (zero - 8 * scale) fp16 holds (what
    converting a Q4_1 file gives) exports as Q4_1, exactly; a bf16 zero that does not is refused."""
    from hf_aoq.serialization import save_file

    src = quantized(float_dir, tmp_path, Int4WeightOnlyConfig(group_size=32, symmetric=True))
    state = load_checkpoint(src)
    name = "model.layers.1.self_attn.k_proj.weight"  # permuted rows too
    t = state[name].to_canonical()
    scale = t.scale.float()
    m = (torch.randn(scale.shape, generator=torch.Generator().manual_seed(0)) * 0.05).half().float()
    state[name] = t.replace(scale=scale, zero=m + 8 * scale)
    os.remove(src / "model.safetensors")
    save_file(state, src / "model.safetensors")
    out = tmp_path / "m.gguf"
    summary = export_checkpoint(src, out, format="gguf")
    assert summary.groups == {"Q4_0 (int4 symmetric, groups of 32)": 13, "Q4_1 (int4 asymmetric, groups of 32)": 1}
    assert any("no model card" in n for n in summary.notes) and not (tmp_path / "README.md").exists()
    reader = gguf.GGUFReader(out)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.attn_k.weight")
    assert tensor.tensor_type.name == "Q4_1"
    from transformers import AutoConfig

    got = gguf_to_hf_order(tensor.name, gguf.dequantize(tensor.data, tensor.tensor_type), AutoConfig.from_pretrained(src))
    assert torch.equal(got, state[name].dequantize(torch.float32))
    convert_checkpoint(out, tmp_path / "back")
    assert_same_tensor(state[name], load_checkpoint(tmp_path / "back")[name], name)

    state[name] = t.replace(scale=scale, zero=scale / 3)  # float32 zeros: the minimum is no fp16 value
    os.remove(src / "model.safetensors")
    save_file(state, src / "model.safetensors")
    with pytest.raises(ExportError, match=rf"{name} .*minimum .* is not an fp16 value"):
        export_checkpoint(src, tmp_path / "x.gguf", format="gguf")
    assert not (tmp_path / "x.gguf").exists() and not _leftovers(tmp_path)


def test_tied_embeddings_write_no_output_tensor(tmp_path):
    from models import tiny_llama_checkpoint
    from transformers import AutoModelForCausalLM

    tiny_llama_checkpoint(tmp_path / "float", tie=True)
    src = quantized(tmp_path / "float", tmp_path, RECIPES["q4_0"])
    export_checkpoint(src, tmp_path / "t.gguf", format="gguf")
    names = [t.name for t in gguf.GGUFReader(tmp_path / "t.gguf").tensors]
    assert "output.weight" not in names and "token_embd.weight" in names
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="t.gguf", dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    with torch.inference_mode():
        got = model(IDS).logits
    assert torch.equal(got, float_model_with(tmp_path / "float", load_checkpoint(src), torch.float32))


# ---------------------------------------------------------------------- refusals and --requantize
@pytest.mark.parametrize("recipe, why", [
    (Int4DQWeightOnlyConfig(), "Int4DQTensor has no GGUF form"),
    (Int4WeightOnlyConfig(group_size=128, symmetric=True), "int4 in groups of 128"),
    (Int8WeightOnlyConfig(), r"int8 block_size \(1, \d+\)"),
    (Int8WeightOnlyConfig(group_size=32), "not an fp16 value"),  # float32 scales
    (Int4WeightOnlyConfig(group_size=32), "minimum .* is not an fp16 value"),  # asymmetric, bf16 zeros
])
@pytest.mark.parametrize("target", ["m.gguf", "folder"])
def test_not_exact_is_refused_by_name_and_nothing_written(float_dir, tmp_path, capsys, recipe, why, target):
    src = quantized(float_dir, tmp_path, recipe)
    out = tmp_path / "out" / target
    out.parent.mkdir()
    with pytest.raises(ExportError, match=rf"model\.layers\.\d\.\w+\.\w+_proj\.weight .*{why}"):
        export_checkpoint(src, out, format="gguf")
    assert not out.exists() and not _leftovers(out.parent)
    assert cli_main(["export", str(src), str(out), "--format", "gguf"]) == 2
    err = capsys.readouterr().err
    assert "Nothing was written" in err and "--requantize" in err
    assert not out.exists() and not _leftovers(out.parent)


def test_requantize_says_so_and_loads(float_dir, tmp_path, capsys):
    from conftest import sqnr
    from transformers import AutoModelForCausalLM

    src = quantized(float_dir, tmp_path, Int4DQWeightOnlyConfig())
    out = tmp_path / "g"
    assert cli_main(["export", str(src), str(out), "--format", "gguf", "--requantize"]) == 0
    text = capsys.readouterr().out
    assert "14 weights were NOT exact" in text and "re-quantized to Q4_0" in text
    card = (out / "README.md").read_text()
    assert "re-quantized" in card and "model.layers.0.self_attn.q_proj.weight" in card
    convert_checkpoint(out / "model.gguf", tmp_path / "back")
    requantized, ours = load_checkpoint(tmp_path / "back"), load_checkpoint(src)
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32).eval()
    with torch.inference_mode():
        assert torch.equal(model(IDS).logits, float_model_with(float_dir, requantized, torch.float32))
    for name, t in ours.items():
        if isinstance(t, AOQTensor):
            assert requantized[name].zero is None and requantized[name].group_size == 32
            assert 15 < sqnr(t.dequantize(), requantized[name].dequantize()) < float("inf"), name


def test_existing_out_is_refused_unless_overwrite(float_dir, tmp_path):
    src = quantized(float_dir, tmp_path, RECIPES["q4_0"])
    (tmp_path / "taken.gguf").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_checkpoint(src, tmp_path / "taken.gguf", format="gguf")
    assert (tmp_path / "taken.gguf").read_text() == "mine"
    export_checkpoint(src, tmp_path / "taken.gguf", format="gguf", overwrite=True)
    assert (tmp_path / "taken.gguf").read_bytes()[:4] == b"GGUF"


def test_unsupported_architecture_is_refused(float_dir, tmp_path):
    src = quantized(float_dir, tmp_path, RECIPES["q4_0"])
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                                             "rope_theta": 10000.0})))
    with pytest.raises(ExportError, match=r"config\.json: rope_parameters\.rope_type 'llama3'"):
        export_checkpoint(src, tmp_path / "x.gguf", format="gguf")
    assert not (tmp_path / "x.gguf").exists()


# ---------------------------------------------------------------------- quantize --target gguf
@pytest.mark.parametrize("scheme, kind", [("int4", "Q4_0 (int4 symmetric, groups of 32)"),
                                          ("int8", "Q8_0 (int8, groups of 32, fp16 scales)")])
def test_quantize_target_gguf_exports_without_loss(float_dir, tmp_path, capsys, scheme, kind):
    """`--scheme int4|int8 --target gguf` makes what Q4_0 / Q8_0 hold exactly (while plain `--scheme
    int4`, Int4DQ, and `--scheme int8`, per row, would be refused)."""
    src = tmp_path / "aoq"
    assert cli_main(["quantize", str(float_dir), "--scheme", scheme, "--target", "gguf", "--out", str(src),
                     "--no-measure"]) == 0
    capsys.readouterr()
    summary = export_checkpoint(src, tmp_path / "m.gguf", format="gguf")
    assert summary.groups == {kind: 14} and not summary.requantized
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    assert "scale_dtype" in json.dumps(qc) if scheme == "int8" else "Int4WeightOnlyConfig" in json.dumps(qc)
    assert cli_main(["quantize", str(float_dir), "--scheme", "fp8", "--target", "gguf", "--out",
                     str(tmp_path / "x")]) == 2
    assert "--target gguf needs --scheme int4, int4-plain or int8" in capsys.readouterr().err


def test_int8_fp16_scales_round_to_fp16_and_stay_close():
    """Int8WeightOnlyConfig(scale_dtype=float16): every scale is an fp16 value; the weight is as
    accurate as with exact float32 scales (the rounding moves a scale by under 2^-11 of itself)."""
    from conftest import sqnr

    torch.manual_seed(0)
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    fp16 = Int8WeightOnlyConfig(group_size=32, scale_dtype=torch.float16).quantize_weight(w)
    exact = Int8WeightOnlyConfig(group_size=32).quantize_weight(w)
    assert fp16.scale.dtype == torch.float32 and torch.equal(fp16.scale.half().float(), fp16.scale)
    assert not torch.equal(exact.scale.half().float(), exact.scale)
    assert abs(sqnr(w, fp16.dequantize()) - sqnr(w, exact.dequantize())) < 0.5
    with pytest.raises(ValueError, match="scale_dtype"):
        Int8WeightOnlyConfig(scale_dtype=torch.bfloat16)


def test_sentencepiece_style_tokenizer_goes_as_llama(float_dir, tmp_path, capsys):
    """A BPE tokenizer with byte fallback (Llama 2's kind) becomes tokenizer.ggml.model "llama"
    (scores -id, byte tokens typed 6), which transformers rebuilds to the same encoding; and the
    command line's `convert` takes the .gguf file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src = quantized(float_dir, tmp_path, RECIPES["q4_0"])
    for p in src.glob("tokenizer*"):
        p.unlink()
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    text = ["the quick brown fox jumps over the lazy dog", "hello world, quantized models run anywhere"] * 20
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    ref = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ref.save_pretrained(src)
    out = tmp_path / "m.gguf"
    export_checkpoint(src, out, format="gguf")
    reader = gguf.GGUFReader(out)
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert types[tokens.index("<0x41>")] == 6 and types[tokens.index("<s>")] == 3
    rebuilt = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert rebuilt(TEXT, add_special_tokens=False).input_ids == ref(TEXT, add_special_tokens=False).input_ids
    assert cli_main(["convert", str(out), str(tmp_path / "back")]) == 0
    assert "14 x Q4_0 -> Int4Tensor" in capsys.readouterr().out
    assert (tmp_path / "back" / "tokenizer.json").is_file()
