#!/usr/bin/env python
"""How much slower is loading a pre-quantized hf_aoq checkpoint than loading the same bytes as a
plain safetensors file?

Writes one hf_aoq checkpoint of N quantized weights (Int4, Int8 and Float8 in turn, plus a plain
norm weight per three) and a plain safetensors file holding exactly the same tensors under the
same keys, without hf_aoq metadata. Then, alternating and repeating, it times

  plain       safetensors.torch.load_file(plain file)
  hf_aoq      what load_file does before placing: hf_aoq's reader (read_safetensors), parsing
              the metadata and building every quantized tensor (unflatten_state_dict)
  via safe_open   the same, but reading with safetensors.safe_open: the path of a loader (such
              as transformers) that reads the files itself and calls unflatten_state_dict

and prints each one's ratio to plain (target: hf_aoq <= 1.2x) and its cost per quantized tensor
beyond the plain load. Every read here is lazy (the file is mapped, nothing is copied), so the
figures are dominated by per-tensor costs and are the worst case: a real load then touches the
bytes, which costs the same on every side. Placing on a device is left out because it is
compute, not format (on CPU it repacks Int4 weights for aten's kernel); --placed times one full
load_file(device="cpu") as well.

    .venv/bin/python scripts/benchmark_load.py [--tensors 2100] [--rows 256] [--cols 512]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import safetensors
import safetensors.torch
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_aoq import Float8Tensor, Int4Tensor, Int8Tensor  # noqa: E402
from hf_aoq import serialization  # noqa: E402


def make_state_dict(n: int, rows: int, cols: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(rows, cols, dtype=torch.bfloat16)
    seeds = [
        Int4Tensor.from_float(w, group_size=128),
        Int8Tensor.from_float(w),
        Float8Tensor.from_float(w),
    ]
    sd: dict[str, torch.Tensor] = {}
    for i in range(n):
        layer, kind = divmod(i, len(seeds))
        # Distinct storage per tensor, as in a real checkpoint (the bytes themselves don't matter).
        sd[f"model.layers.{layer}.mlp.proj_{kind}.weight"] = seeds[kind].apply_to_tensors(torch.clone)
        if kind == 0:
            sd[f"model.layers.{layer}.norm.weight"] = torch.ones(cols, dtype=torch.bfloat16)
    return sd


def load_hf_aoq(path: str) -> dict[str, torch.Tensor]:
    tensors, metadata = serialization.read_safetensors(path)
    return serialization.unflatten_state_dict(tensors, metadata, source=path)


def load_hf_aoq_via_safe_open(path: str) -> dict[str, torch.Tensor]:
    with safetensors.safe_open(path, framework="pt") as f:
        metadata = f.metadata()
        tensors = f.get_tensors()
    return serialization.unflatten_state_dict(tensors, metadata, source=path)


def timed(fn, path: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process). On a shared machine the CPU time is the
    steadier of the two: it does not count time spent waiting for a core."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(path)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    del out
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=2100, help="quantized tensors (default 2100)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=512, help="a multiple of 128")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--placed", action="store_true", help="also time one load_file(device='cpu')")
    parser.add_argument("--dir", default=None, help="where to write the two files (default: a temp dir)")
    args = parser.parse_args()

    sd = make_state_dict(args.tensors, args.rows, args.cols)
    tensors, metadata = serialization.flatten_state_dict(sd)
    nbytes = sum(t.nbytes for t in tensors.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        aoq_path = os.path.join(tmp, "hf_aoq.safetensors")
        plain_path = os.path.join(tmp, "plain.safetensors")
        serialization.save_file(sd, aoq_path)
        safetensors.torch.save_file(tensors, plain_path, metadata={"format": "pt"})
        print(
            f"{args.tensors} quantized tensors of {args.rows}x{args.cols} (Int4 g128, Int8, Float8 in turn) and "
            f"{len(sd) - args.tensors} plain ones, {len(tensors)} tensors in each file, "
            f"{nbytes / 1e9:.2f} GB, {len(metadata[serialization.METADATA_KEY]) / 1e6:.2f} MB of hf_aoq metadata"
        )
        del sd, tensors
        loads = {
            "plain": (safetensors.torch.load_file, plain_path),
            "hf_aoq": (load_hf_aoq, aoq_path),
            "via safe_open": (load_hf_aoq_via_safe_open, aoq_path),
        }
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in loads}
        for repeat in range(args.repeats + 1):  # the first round warms the page cache
            for name, (fn, path) in loads.items():
                t = timed(fn, path)
                if repeat:
                    times[name].append(t)
        for clock, i in (("CPU", 1), ("wall", 0)):
            plain = statistics.median(t[i] for t in times["plain"])
            print(f"{clock} time, median of {args.repeats}: plain {plain * 1e3:.1f} ms")
            for name in ("hf_aoq", "via safe_open"):
                took = statistics.median(t[i] for t in times[name])
                print(
                    f"  {name:>13} {took * 1e3:7.1f} ms  ratio {took / plain:.2f}x  "
                    f"({(took - plain) / args.tensors * 1e6:+.1f} us per quantized tensor)"
                )
        print("target: hf_aoq <= 1.2x plain")
        if args.placed:
            placed, _ = timed(lambda path: serialization.load_file(path, device="cpu"), aoq_path)
            print(f"load_file(device='cpu'), placed for the CPU kernels: {placed * 1e3:.1f} ms wall "
                  f"(Int4 repacking is compute, not format overhead)")


if __name__ == "__main__":
    main()
