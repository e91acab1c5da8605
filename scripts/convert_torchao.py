"""Convert a checkpoint saved by torchao's safetensors support into an hf_aoq checkpoint.

    python scripts/convert_torchao.py SRC DST [--overwrite] [--max-shard-size SIZE]

The same function as `hf-aoq convert-torchao` (hf_aoq.convert.convert_torchao_checkpoint); torchao
need not be installed. Load the result with `import hf_aoq` and
`AutoModelForCausalLM.from_pretrained(DST)`. SIZE (bytes, or e.g. 500MB, 5GB; default 5GiB) is the
largest weights file; above it the weights are split into shards with an index. docs/torchao.md
lists what converts and how.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_aoq.convert import convert_torchao_checkpoint  # noqa: E402
from hf_aoq.workflows import SIZE_FORM, UsageError, parse_size  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="the torchao checkpoint folder")
    parser.add_argument("dst", help="the hf_aoq checkpoint folder to write (must not exist)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--max-shard-size", metavar="SIZE", help=f"largest weights file: {SIZE_FORM} (default 5GiB)")
    args = parser.parse_args(argv)
    kwargs = {}
    if args.max_shard_size is not None:
        try:
            kwargs["max_shard_size"] = parse_size(args.max_shard_size)
        except UsageError as e:
            parser.error(str(e))
    print(convert_torchao_checkpoint(args.src, args.dst, overwrite=args.overwrite, **kwargs).format())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
