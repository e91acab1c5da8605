"""Convert a checkpoint saved by torchao's safetensors support into an hf_aoq checkpoint.

    python scripts/convert_torchao.py SRC DST [--overwrite]

The same function as `hf-aoq convert-torchao` (hf_aoq.convert.convert_torchao_checkpoint); torchao
need not be installed. Load the result with `import hf_aoq` and
`AutoModelForCausalLM.from_pretrained(DST)`. docs/torchao.md lists what converts and how.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_aoq.convert import convert_torchao_checkpoint  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="the torchao checkpoint folder")
    parser.add_argument("dst", help="the hf_aoq checkpoint folder to write (must not exist)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    args = parser.parse_args(argv)
    print(convert_torchao_checkpoint(args.src, args.dst, overwrite=args.overwrite).format())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
