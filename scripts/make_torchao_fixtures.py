"""Write the torchao checkpoints under tests/fixtures/torchao/ with REAL torchao (run once, by hand).

torchao must not be a dependency of hf_aoq, so this runs in a separate environment:

    /work/main/.venv/bin/python -m venv /tmp/taovenv
    /tmp/taovenv/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl transformers==5.24.0 \
        safetensors accelerate torchao==0.18.0
    /tmp/taovenv/bin/python scripts/make_torchao_fixtures.py [--out tests/fixtures/torchao]

Each fixture is a tiny random bf16 Llama (hidden 64, 2 layers, vocab 256) quantized by torchao
through transformers (`TorchAoConfig`, the same path as `from_pretrained(...,
quantization_config=TorchAoConfig(...))`) and written by `save_pretrained`, i.e. by torchao's
safetensors support (`flatten_tensor_state_dict`). Next to each checkpoint folder NAME,
`NAME.reference.safetensors` holds plain tensors: `input_ids`, `logits` computed by torchao's own
quantized model at fixture time, and `dequantized.<name>`: torchao's dequantization of each
quantized weight of layer 0 (for int4_plain see below). The random weights are drawn with a
large initializer_range (0.15) so that every quantized layer moves the logits.

What could be made on a CPU-only machine, and why the rest could not:
  int8_weight_only          Int8WeightOnlyConfig()                       -> Int8Tensor, per row
  int8_dynamic              Int8DynamicActivationInt8WeightConfig()      -> Int8Tensor + act. kwargs
  float8_weight_only        Float8WeightOnlyConfig()                     -> Float8Tensor, per row
  float8_dynamic_row        Float8DynamicActivationFloat8WeightConfig(PerRow())     -> Float8Tensor
  float8_dynamic_tensor     Float8DynamicActivationFloat8WeightConfig(PerTensor())  + act. kwargs
                            torchao refuses these configs up front without a CUDA GPU of compute
                            capability 8.9+, MI300 or XPU (`_check_hardware_support`), yet the
                            tensors it then builds run on CPU (torch._scaled_mm has a CPU kernel):
                            the script switches that one check off, nothing else.
  intx_int4_g32_sym         IntxWeightOnlyConfig(torch.int4, PerGroup(32))          symmetric
  intx_int4_g64_asym        IntxWeightOnlyConfig(torch.int4, PerGroup(64), ASYMMETRIC)
  intx_int8_per_row         IntxWeightOnlyConfig(torch.int8, PerAxis(0))
  intx_int8_embeddings      the same, with TorchAoConfig(include_input_output_embeddings=True):
                            lm_head is quantized too (torchao 0.18 leaves the input embedding
                            plain with this config)
  intx_int4_g16_unsupported IntxWeightOnlyConfig(torch.int4, PerGroup(16)): a real checkpoint that
                            hf_aoq must refuse (group 16 is not one of its int4 group sizes)
  int4_plain                Int4Tensor (Int4WeightOnlyConfig(int4_packing_format="plain")): see below

Int4Tensor: torchao 0.18 quantizes it with `mslk` (`int4_row_quantize_zp` and `pack_int4`) and
runs it only through mslk's CUDA kernels; mslk has no CPU build (PyPI has a 0.0.0 placeholder),
so `Int4WeightOnlyConfig` fails here for every packing format that saves as Int4Tensor. This
script therefore builds real torchao `Int4Tensor` objects itself, with the fields mslk would
produce (the arithmetic of mslk's `int4_row_quantize_zp`, re-implemented below: codes in
[-8, 7], w = q * scale + zero_point, scale and zero_point of shape (K/g, N); qdata int8 [N, K/2],
two's-complement nibbles, even column in the low nibble), puts them in a model loaded through
transformers' torchao quantizer and lets torchao's safetensors support write them. The
reference logits come from the model with each weight replaced by torchao's own float-zero
dequantization `_dequantize_affine_tinygemm` of the same codes (mslk's kernel cannot run on CPU).
Other int4 layouts (Int4TilePackedTo4dTensor: CUDA tinygemm packing; Int4PlainInt32Tensor:
XPU/NPU; Int4OpaqueTensor: not in torchao's safetensors allow-list) are not made.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 1234
GROUP_INT4_PLAIN = 32


def tiny_llama(tmp: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.15,  # large enough that every quantized layer moves the logits
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    path = tmp / "float"
    model.save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, 256):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(path)
    return path


def quantized(float_path: Path, quant_type, **torchao_config):
    import torchao.quantization.quant_api as quant_api
    from transformers import AutoModelForCausalLM, TorchAoConfig

    quant_api._check_hardware_support = lambda granularity: None  # see the top of this file
    return AutoModelForCausalLM.from_pretrained(
        float_path, dtype=torch.bfloat16, quantization_config=TorchAoConfig(quant_type=quant_type, **torchao_config)
    ).eval()


def mslk_style_int4(w: torch.Tensor, group: int):
    """Int4Tensor fields as mslk's int4_row_quantize_zp + pack_int4 would make them (see top)."""
    n, k = w.shape
    x = w.float().reshape(n, k // group, group)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-6) / 15
    zero = lo + 8 * scale
    codes = ((x - lo) / scale).round().clamp(0, 15).reshape(n, k)  # unsigned, 0..15
    q = (codes - 8).to(torch.int8)  # mslk recentres to [-8, 7]
    packed = (q[:, 0::2] & 0xF) | (q[:, 1::2] << 4)  # int8; even column in the low nibble
    scale = scale.reshape(n, k // group).to(w.dtype)
    zero = zero.reshape(n, k // group).to(w.dtype)
    return packed.contiguous(), scale.t().contiguous(), zero.t().contiguous(), codes.to(torch.int32)


def int4_plain(float_path: Path):
    """A model whose Linear weights are torchao Int4Tensors, and the float model to run instead."""
    from torchao.quantization import Int4Tensor, Int4WeightOnlyConfig, Int8WeightOnlyConfig
    from torchao.quantization.quant_primitives import _dequantize_affine_tinygemm
    from transformers import AutoModelForCausalLM, TorchAoConfig

    try:
        quantized(float_path, Int4WeightOnlyConfig(group_size=GROUP_INT4_PLAIN, int4_packing_format="plain"))
        print("  note: Int4WeightOnlyConfig(plain) worked on this machine; the manual path is still used")
    except Exception as e:  # the expected outcome on CPU: mslk is missing
        print(f"  Int4WeightOnlyConfig(plain) on CPU: {type(e).__name__}: {str(e)[:120]}")
    # Load through transformers' torchao quantizer (so save_pretrained takes torchao's safetensors
    # path), then put Int4Tensors in place of the Linear weights.
    model = quantized(float_path, Int8WeightOnlyConfig())
    ref = AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.bfloat16).eval()
    float_model = AutoModelForCausalLM.from_pretrained(float_path, dtype=torch.bfloat16).eval()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        w = float_model.get_submodule(name).weight.detach()
        packed, scale, zero, codes = mslk_style_int4(w, GROUP_INT4_PLAIN)
        t = Int4Tensor(packed, scale, zero, [1, GROUP_INT4_PLAIN], w.shape)
        module.weight = torch.nn.Parameter(t, requires_grad=False)
        deq = _dequantize_affine_tinygemm(
            codes, [1, GROUP_INT4_PLAIN], scale.t(), zero.t(), torch.uint4, 0, 15, output_dtype=w.dtype
        )
        ref.get_submodule(name).weight.data.copy_(deq)
    model.config.quantization_config = TorchAoConfig(
        quant_type=Int4WeightOnlyConfig(group_size=GROUP_INT4_PLAIN, int4_packing_format="plain")
    )
    return model, ref


def fixtures():
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        MappingType,
        PerAxis,
        PerGroup,
        PerRow,
        PerTensor,
    )

    return {
        "int8_weight_only": Int8WeightOnlyConfig(),
        "int8_dynamic": Int8DynamicActivationInt8WeightConfig(),
        "float8_weight_only": Float8WeightOnlyConfig(),
        "float8_dynamic_row": Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        "float8_dynamic_tensor": Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
        "intx_int4_g32_sym": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
        "intx_int4_g64_asym": IntxWeightOnlyConfig(
            weight_dtype=torch.int4, granularity=PerGroup(64), mapping_type=MappingType.ASYMMETRIC
        ),
        "intx_int8_per_row": IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
        "intx_int4_g16_unsupported": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16)),
        # The output embedding (lm_head) quantized too.
        "intx_int8_embeddings": (
            IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
            {"include_input_output_embeddings": True},
        ),
        "int4_plain": None,
    }


def main(argv=None) -> int:
    import torchao
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/fixtures/torchao"))
    parser.add_argument("--only", nargs="*", help="fixture names to (re)make")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    made, failed = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        float_path = tiny_llama(Path(tmp))
        gen = torch.Generator().manual_seed(SEED)
        input_ids = torch.randint(4, 256, (2, 12), generator=gen)
        for name, quant_type in fixtures().items():
            if args.only and name not in args.only:
                continue
            print(name)
            try:
                if quant_type is None:
                    model, runner = int4_plain(float_path)
                else:
                    config, options = quant_type if isinstance(quant_type, tuple) else (quant_type, {})
                    model = runner = quantized(float_path, config, **options)
                with torch.inference_mode():
                    logits = runner(input_ids).logits.float()
            except Exception as e:  # a config this CPU build cannot run: recorded, not made
                failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  FAILED: {failed[name]}")
                continue
            target = out / name
            if target.exists():
                shutil.rmtree(target)
            model.save_pretrained(target)
            shutil.copy(float_path / "tokenizer.json", target)
            shutil.copy(float_path / "tokenizer_config.json", target)
            reference = {"input_ids": input_ids, "logits": logits.contiguous()}
            # torchao's own dequantization of layer 0's weights (for Int4Tensor, which has no
            # dequantize(), the float weights the reference model ran with).
            for pname, p in model.named_parameters():
                if pname.startswith("model.layers.0.") and type(p).__name__ != "Parameter":
                    w = runner.get_parameter(pname) if quant_type is None else p.dequantize()
                    reference[f"dequantized.{pname}"] = w.detach().contiguous()
            if "unsupported" not in name:  # hf_aoq refuses it: nothing to compare with
                save_file(reference, str(out / f"{name}.reference.safetensors"))
            types = sorted({type(p).__name__ for p in model.parameters()} - {"Parameter"})
            made[name] = {"config": repr(quant_type) if quant_type is not None else "Int4Tensor (manual, see script)",
                          "tensor_types": types}
            size = sum(f.stat().st_size for f in target.iterdir())
            print(f"  {types} {size / 1024:.0f} KiB")
    info_path = out / "torchao_versions.json"
    info = json.loads(info_path.read_text()) if info_path.exists() and args.only else {}
    info.update({
        "torchao": torchao.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "script": "scripts/make_torchao_fixtures.py",
    })
    info.setdefault("fixtures", {}).update(made)
    info.setdefault("not_made", {}).update(failed)
    for name in made:
        info["not_made"].pop(name, None)
    info_path.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
