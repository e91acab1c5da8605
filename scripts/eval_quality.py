#!/usr/bin/env python
"""Perplexity table for SmolLM2-135M: bf16, int8 and each 4-bit option of hf_aoq, and the peers
(torchao, optimum-quanto, bitsandbytes) when they are installed.

Protocol (hf_aoq.perplexity): the first 2,048 tokens of gensim's lee_background.cor in windows
of 512, each starting with BOS, bf16 activations. Calibrated options calibrate on a different
part of the same text (tokens 4,096 onwards), never on the tokens they are scored on.

SmolLM2's weights come from a Q4_1 GGUF with groups of 32, so int4 g32 asymmetric reproduces
them exactly: 4-bit options are judged at the g128 size budget (4.25 bits per weight with a
bf16 scale and zero per group of 128).

    .venv/bin/python scripts/eval_quality.py [--only NAME ...] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hf_aoq  # noqa: E402
from hf_aoq import perplexity as P  # noqa: E402
from hf_aoq import smollm2  # noqa: E402
from hf_aoq.calibration import quantize_with_calibration  # noqa: E402

N_TOKENS, WINDOW = 2048, 512
CALIBRATION_OFFSET, CALIBRATION_TOKENS = 4096, 4096


def not_lm_head(module, fqn):
    return isinstance(module, nn.Linear) and "lm_head" not in fqn


def weight_bits(model) -> float:
    """Bits per weight of the quantized linears (codes, scales and zeros), lm_head excluded."""
    bits = elements = 0
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and "lm_head" not in fqn:
            w = module.weight
            elements += w.numel()
            if isinstance(w, hf_aoq.AOQTensor):
                bits += 8 * sum(t.numel() * t.element_size() for t in w.to_canonical().tensor_fields().values())
            else:
                bits += 8 * w.numel() * w.element_size()
    return bits / elements


def hf_aoq_options(calibration):
    I4 = hf_aoq.Int4WeightOnlyConfig
    yield "hf_aoq int8", lambda m: hf_aoq.quantize_(m, hf_aoq.Int8WeightOnlyConfig(), not_lm_head)
    yield "hf_aoq int8 mse row scales", lambda m: hf_aoq.quantize_(m, hf_aoq.Int8WeightOnlyConfig(qparams="mse"), not_lm_head)
    for g in (128, 64, 32):
        yield f"hf_aoq int4 g{g} minmax", lambda m, g=g: hf_aoq.quantize_(m, I4(g, qparams="minmax"), not_lm_head)
    yield "hf_aoq int4 g128 mse (default)", lambda m: hf_aoq.quantize_(m, I4(128), not_lm_head)
    for g in (32, 64):
        yield f"hf_aoq int4dq g{g}", lambda m, g=g: hf_aoq.quantize_(m, hf_aoq.Int4DQWeightOnlyConfig(g), not_lm_head)
    # What torchao's int4 g128 quantizes on this model: it skips weights whose input size 128
    # does not divide (all 576-wide ones), leaving only down_proj.
    yield "hf_aoq int4 g128 mse, down_proj only (torchao's coverage)", lambda m: hf_aoq.quantize_(
        m, hf_aoq.FqnToConfig({"re:.*down_proj": I4(128)}), not_lm_head
    )
    MX, FP4, E4M3 = hf_aoq.MXFPInferenceConfig, torch.float4_e2m1fn_x2, torch.float8_e4m3fn
    yield "hf_aoq mxfp8 (e4m3 weights and activations)", lambda m: hf_aoq.quantize_(m, MX(), not_lm_head)
    yield "hf_aoq mxfp4 (e2m1 weights, e4m3 activations)", lambda m: hf_aoq.quantize_(
        m, MX(activation_dtype=E4M3, weight_dtype=FP4), not_lm_head
    )
    yield "hf_aoq mxfp4 weight-only", lambda m: hf_aoq.quantize_(m, MX(activation_dtype=None, weight_dtype=FP4), not_lm_head)
    for qparams in ("minmax", "mse"):
        yield f"hf_aoq int4 g128 {qparams} + calibration (GPTQ)", lambda m, q=qparams: quantize_with_calibration(
            m, I4(128, qparams=q), calibration, filter_fn=not_lm_head
        )
    # Activation-aware scales (hf_aoq.awq), folded into the blocks: the same tensors and sizes.
    for label, cfg in (("int4 g128 mse", I4(128)), ("int4dq g32", hf_aoq.Int4DQWeightOnlyConfig(32))):
        yield f"hf_aoq {label} + calibration (AWQ)", lambda m, c=cfg: quantize_with_calibration(
            m, c, calibration, filter_fn=not_lm_head, method="awq"
        )
    yield "hf_aoq int8-dyn", lambda m: hf_aoq.quantize_(m, hf_aoq.Int8DynamicActivationInt8WeightConfig(), not_lm_head)
    yield "hf_aoq int8-dyn + calibration (SmoothQuant)", lambda m: quantize_with_calibration(
        m, hf_aoq.Int8DynamicActivationInt8WeightConfig(), calibration, filter_fn=not_lm_head, method="smoothquant"
    )


def peer_options():
    if importlib.util.find_spec("torchao"):
        def torchao_int4(m):
            from torchao.quantization import Int4WeightOnlyConfig, quantize_
            quantize_(m, Int4WeightOnlyConfig(group_size=128), lambda mod, fqn: not_lm_head(mod, fqn))
        yield "torchao int4 g128", torchao_int4
    if importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.quanto"):
        def quanto_int4(m):
            from optimum.quanto import freeze, qint4, quantize
            quantize(m, weights=qint4, exclude="lm_head")
            freeze(m)
        yield "optimum-quanto int4", quanto_int4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="run only the options whose name contains one of these")
    parser.add_argument("--json", help="also write the table as JSON here")
    args = parser.parse_args()

    base, tokenizer = smollm2.load(torch.bfloat16)
    ids = tokenizer(P.read_text(), return_tensors="pt").input_ids[0]
    scored = P.windows(ids, tokenizer.bos_token_id, n_tokens=N_TOKENS, window=WINDOW)
    calibration = P.windows(ids, tokenizer.bos_token_id, n_tokens=CALIBRATION_TOKENS, window=WINDOW,
                            offset=CALIBRATION_OFFSET)
    baseline = P.perplexity(base, scored)
    rows = [{"option": "bf16", "ppl": baseline, "bits_per_weight": 16.0, "quantize_s": 0.0}]
    print(f"| option | bits/weight | perplexity | vs bf16 | quantize (s) |\n|---|---|---|---|---|")
    print(f"| bf16 | 16 | {baseline:.2f} | | |", flush=True)
    for name, apply in [*hf_aoq_options(calibration), *peer_options()]:
        if args.only and not any(s in name for s in args.only):
            continue
        model = copy.deepcopy(base)
        start = time.perf_counter()
        apply(model)
        seconds = time.perf_counter() - start
        ppl = P.perplexity(model, scored)
        bits = weight_bits(model)
        rows.append({"option": name, "ppl": ppl, "bits_per_weight": bits, "quantize_s": seconds})
        print(f"| {name} | {bits:.2f} | {ppl:.2f} | {100 * (ppl / baseline - 1):+.1f}% | {seconds:.1f} |", flush=True)
        del model
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"protocol": f"first {N_TOKENS} tokens of lee_background.cor, windows of {WINDOW} with BOS",
                       "rows": rows}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
