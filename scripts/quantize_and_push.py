#!/usr/bin/env python
"""Quantize a model and push it to the Hub: `hf-aoq quantize MODEL ... --push-to-hub REPO` as a
script to keep next to a model's release notes or to edit. It takes the options of `hf-aoq
quantize` and runs that command (hf_aoq.cli), whose job is the library's
hf_aoq.workflows.quantize_checkpoint: no copy of either.

    .venv/bin/python scripts/quantize_and_push.py HuggingFaceTB/SmolLM2-135M me/SmolLM2-135M-aoq-int4 \\
        --scheme int4 --skip lm_head --private

The checkpoint is saved to --out (default: a folder named after the repo), with its tokenizer and
model card, then uploaded in one commit; set HF_TOKEN (or run `hf auth login`) first: the token
and the repo are checked before quantizing. --no-push stops after saving.
"""
from __future__ import annotations

import argparse
import sys

from hf_aoq import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_quantize_arguments(parser, out_required=False)  # MODEL, --scheme, ..., as `hf-aoq quantize`
    parser.add_argument("repo", help="Hub repo to push to (owner/name)")
    parser.add_argument("--no-push", action="store_true", help="quantize and save only")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = args.repo.rstrip("/").split("/")[-1]
    args.push_to_hub = None if args.no_push else args.repo
    args.func = cli.quantize_command
    args.command = "quantize_and_push"
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
