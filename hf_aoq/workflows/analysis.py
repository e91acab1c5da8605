"""`hf-aoq analyze`: load a float model and its tokenizer, run hf_aoq.sensitivity on a text
file, and write the report as JSON."""
from __future__ import annotations

import re
from pathlib import Path

from ..core.errors import AOQError
from .common import UsageError, check_model_source, log


def analyze_model(model: str, calibration, schemes: str, *, tokens: int = 2048, exact: int = 0,
                  include_embeddings: bool = True, skip=(), json_path=None, load=None):
    """The sensitivity report of `model` (a folder or Hub id) for `schemes` on the text file
    `calibration`; written to `json_path` when given. `skip`: module names or regexes left out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..sensitivity import parse_candidates, sensitivity
    from .quantization import LoadOptions

    calibration = Path(calibration)
    if not calibration.is_file():
        raise UsageError(f"--calibration {calibration}: no such text file")
    try:
        candidates = parse_candidates(schemes)
    except AOQError as e:
        raise UsageError(f"--schemes {schemes}: {e}") from None
    for s in skip:
        try:
            re.compile(s)
        except re.error as e:
            raise UsageError(f"--skip {s!r} is not a valid regex: {e}") from None
    load = load or LoadOptions()
    check_model_source(model, revision=load.revision, token=load.token)
    log(f"loading {model}")
    try:
        float_model = AutoModelForCausalLM.from_pretrained(model, **load.kwargs())
        tokenizer = AutoTokenizer.from_pretrained(model, revision=load.revision, token=load.token,
                                                  trust_remote_code=load.trust_remote_code)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot load {model}: {first}") from e

    def wanted(module, name):  # --skip as `hf-aoq quantize --skip` (transformers' modules_to_not_convert) reads it
        from transformers.quantizers.quantizers_utils import should_convert_module

        return should_convert_module(name, list(skip))

    report = sensitivity(float_model.eval(), candidates, calibration, tokenizer=tokenizer, tokens=tokens, exact=exact,
                         filter_fn=wanted if skip else None, include_embeddings=include_embeddings, log=log)
    if json_path is not None:
        report.save(json_path)
    return report
