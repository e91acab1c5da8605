"""`hf-aoq convert FILE.gguf OUT`: hf_aoq's own GGUF reader turns llama GGUF files into hf_aoq
checkpoints. SmolLM2-135M (a real Q4_1 file) becomes int4 g32 asymmetric tensors whose
dequantization is transformers' own GGUF dequantization bit for bit; K-quant blocks (written by
the `gguf` package) decode as the `gguf` package decodes them; a malformed file is a FormatError
naming the file and the field, with nothing written."""
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_aoq.convert.gguf_file import F32, KV, STRING, UINT32, read_gguf, write_gguf
from hf_aoq.core.errors import FormatError
from hf_aoq.core.tensor import AOQTensor
from hf_aoq.serialization import load_checkpoint
from hf_aoq.tensors import Int4Tensor, Int8Tensor
from hf_aoq.workflows import ExportError, convert_checkpoint

gguf = pytest.importorskip("gguf")


def test_smollm2_q4_1_converts_to_transformers_dequantization_exactly(tmp_path):
    """The whole real model: 210 Q4_1 linear weights -> Int4Tensor g32 asymmetric, the Q8_0
    embedding -> Int8Tensor g32, the F32 norms as they are; each dequantizes (float32) to exactly
    what transformers' GGUF loader makes of the file (its dequantization, q/k rows un-permuted)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from hf_aoq import smollm2

    try:
        path = smollm2.gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path / "smol"
    summary = convert_checkpoint(path, out)
    assert summary.groups == {"Q4_1 -> Int4Tensor Int4WeightOnlyConfig(group 32)": 210,
                              "Q8_0 -> Int8Tensor Int8WeightOnlyConfig(group 32)": 1}
    assert not any("differ" in n for n in summary.notes)
    ours = load_checkpoint(out)
    config = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)["tensors"]
    assert set(theirs) == set(ours)
    for name, want in theirs.items():
        t = ours[name]
        if name.endswith("_proj.weight"):
            assert isinstance(t, Int4Tensor) and t.zero is not None and t.group_size == 32, name
        got = t.dequantize(torch.float32) if isinstance(t, AOQTensor) else t.float()
        assert torch.equal(got, want.float()), name
    assert isinstance(ours["model.embed_tokens.weight"], Int8Tensor)
    assert (out / "tokenizer.json").is_file()


def _k_quant_file(path: Path):
    """A GGUF file (written by the gguf package) with random Q4_K and Q6_K blocks whose fp16
    super-block scales are small finite numbers, and an F32 norm."""
    from gguf import GGMLQuantizationType as T

    g = torch.Generator().manual_seed(0)
    n, k = 16, 512

    def blocks(block_bytes, scale_at):
        raw = torch.randint(0, 256, (n, k // 256, block_bytes), dtype=torch.uint8, generator=g)
        for at in scale_at:
            d = (torch.rand(n, k // 256, generator=g) * 0.01 + 1e-4).half()
            raw[..., at:at + 2] = d.view(torch.uint8).reshape(n, k // 256, 2)
        return raw.reshape(n, -1).numpy()

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("embedding_length", k), ("feed_forward_length", n), ("block_count", 1),
                       ("attention.head_count", 4), ("context_length", 64)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.vocab_size", 32)
    w.add_tensor("blk.0.ffn_gate.weight", blocks(144, (0, 2)), raw_dtype=T.Q4_K)
    w.add_tensor("blk.0.ffn_down.weight", blocks(210, (208,)), raw_dtype=T.Q6_K)
    w.add_tensor("blk.0.ffn_norm.weight", np.linspace(0.5, 1.5, k, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_k_quants_convert_to_the_nearest_types(tmp_path):
    """Q4_K -> Int4Tensor g32 asymmetric (scale d * sc, zero 8 * scale - dmin * m) and Q6_K ->
    Int8Tensor g16 (6-bit codes, scale d * sc), each dequantizing to what the gguf package
    decodes, bit for bit."""
    path = tmp_path / "k.gguf"
    _k_quant_file(path)
    summary = convert_checkpoint(path, tmp_path / "out")
    assert summary.groups == {"Q4_K -> Int4Tensor Int4WeightOnlyConfig(group 32)": 1,
                              "Q6_K -> Int8Tensor Int8WeightOnlyConfig(group 16)": 1}
    ours = load_checkpoint(tmp_path / "out")
    reader = gguf.GGUFReader(path)
    names = {"blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight"}
    for t in reader.tensors:
        want = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy())
        mine = ours[names[t.name]]
        got = mine.dequantize(torch.float32) if isinstance(mine, AOQTensor) else mine.float()
        assert torch.equal(got, want), t.name
    assert isinstance(ours["model.layers.0.mlp.down_proj.weight"], Int8Tensor)
    assert bool((ours["model.layers.0.mlp.down_proj.weight"].scale >= 0).all())


# ---------------------------------------------------------------------- malformed input
def _small_file(path: Path):
    meta = {"general.architecture": KV(STRING, "llama"), "llama.embedding_length": KV(UINT32, 64)}
    write_gguf(path, meta, [("blk.0.attn_norm.weight", F32, (64,), torch.ones(64).view(torch.uint8).reshape(1, -1))])
    return path.read_bytes()


def _patch_type(raw: bytes, ggml_type: int, offset: int = 0) -> bytes:
    """`raw` with the one tensor info's type and offset fields set (they follow its name, n_dims
    and its one ne)."""
    at = raw.index(b"blk.0.attn_norm.weight") + len("blk.0.attn_norm.weight") + 4 + 8
    return raw[:at] + struct.pack("<IQ", ggml_type, offset) + raw[at + 12:]


@pytest.mark.parametrize("damage, field", [
    (lambda b: b"GGUL" + b[4:], "magic"),
    (lambda b: b[:4] + struct.pack("<I", 7) + b[8:], "version 7"),
    (lambda b: b[:60], "metadata"),
    (lambda b: b[:-100], r"tensor 'blk\.0\.attn_norm\.weight'.*truncated"),
    (lambda b: _patch_type(b, 99), r"tensor 'blk\.0\.attn_norm\.weight': ggml type 99 \(not a ggml type\)"),
    (lambda b: _patch_type(b, 0, offset=4), r"tensor 'blk\.0\.attn_norm\.weight': offset 4 is not a multiple"),
])
def test_malformed_gguf_is_a_format_error_naming_file_and_field(tmp_path, damage, field):
    raw = _small_file(tmp_path / "ok.gguf")
    assert read_gguf(tmp_path / "ok.gguf").tensors["blk.0.attn_norm.weight"].shape == (64,)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(raw))
    with pytest.raises(FormatError, match=rf"bad\.gguf: .*{field}"):
        read_gguf(bad)
    with pytest.raises(ExportError, match=rf"bad\.gguf: .*{field}.*nothing was written"):
        convert_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_unknown_tensor_names_and_architectures_are_refused(tmp_path):
    path = tmp_path / "m.gguf"
    meta = {"general.architecture": KV(STRING, "mamba")}
    write_gguf(path, meta, [("blk.0.attn_norm.weight", F32, (64,), torch.ones(64).view(torch.uint8).reshape(1, -1))])
    with pytest.raises(ExportError, match=r"m\.gguf: metadata 'general\.architecture' 'mamba'"):
        convert_checkpoint(path, tmp_path / "out")
    _k_quant_file(path)
    raw = path.read_bytes().replace(b"blk.0.ffn_norm.weight", b"blk.0.ffn_nrom.weight")
    path.write_bytes(raw)
    with pytest.raises(ExportError, match=r"tensor 'blk\.0\.ffn_nrom\.weight' has no transformers name"):
        convert_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
