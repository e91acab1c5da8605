"""Mixed precision on SmolLM2 with the recipe's GPTQ on more tokens than the report
(quantize_mixed_precision's `gptq_calibration`): GPTQ on the report's few tokens fits them, and
more tokens lower the held-out perplexity of the same recipe."""
import copy

import torch

from hf_aoq import perplexity, smollm2
from hf_aoq.mixed_precision import quantize_mixed_precision


def test_smollm2_recipe_gptq_on_more_tokens_generalises_better():
    """SmolLM2's 30 down_proj weights at 3.6 bits among Int4DQ g32 and asymmetric int3 g128, both
    by act-order GPTQ; the report on 512 tokens from 4,096 on, GPTQ on those 512 or on 4,096
    from the same offset; scored on the first 512 tokens."""
    model, tokenizer = smollm2.load(torch.bfloat16)
    ids = tokenizer(perplexity.read_text(), return_tensors="pt").input_ids[0]
    scored = perplexity.windows(ids, tokenizer.bos_token_id, n_tokens=512, window=512)
    short = perplexity.windows(ids, tokenizer.bos_token_id, n_tokens=512, window=512, offset=4096)
    long = perplexity.windows(ids, tokenizer.bos_token_id, n_tokens=4096, window=512, offset=4096)
    down = lambda m, n: n.endswith("down_proj")  # noqa: E731
    names = "int4+gptq-act,int3-asym:g128+gptq-act"
    base = perplexity.perplexity(model, scored)
    on_short = copy.deepcopy(model)
    chosen, report = quantize_mixed_precision(on_short, 3.6, names, short, filter_fn=down)
    assert chosen.bits_per_weight <= 3.6 and set(chosen.counts) == {"int4+gptq-act", "int3-asym:g128+gptq-act"}
    ppl_short = perplexity.perplexity(on_short, scored)
    del on_short
    again, _ = quantize_mixed_precision(model, 3.6, names, short, filter_fn=down, report=report, gptq_calibration=long)
    assert again.choices == chosen.choices  # the same recipe; only GPTQ's tokens differ
    ppl_long = perplexity.perplexity(model, scored)
    assert ppl_long < ppl_short and ppl_long - base < 0.9 * (ppl_short - base), (base, ppl_short, ppl_long)
