"""Perplexity of a causal LM on English prose: the yardstick of quantization quality.

The protocol (issue 7; the peers' figures were measured the same way): the text is tokenized
once, its first `n_tokens` tokens are cut into windows of `window` tokens, each window is fed
with the tokenizer's BOS token in front, and the perplexity is exp of the mean next-token loss
over every predicted token of every window.

The text is gensim's `lee_background.cor` (LGPL, English news prose), a copy of which is in the
repository at tests/data/.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

LEE_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "lee_background.cor"


def read_text(path: str | Path | None = None) -> str:
    path = Path(path) if path is not None else LEE_TEXT
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such text file (the default is tests/data/lee_background.cor "
                                "in a checkout of hf_aoq)") from None


def windows(token_ids: torch.Tensor, bos: int | None, *, n_tokens: int, window: int, offset: int = 0) -> list[torch.Tensor]:
    """[1, (1 +) window] id tensors covering tokens [offset, offset + n_tokens) of a 1-D id tensor."""
    ids = token_ids.reshape(-1)[offset:offset + n_tokens]
    if ids.numel() < n_tokens:
        raise ValueError(f"the text has {token_ids.numel()} tokens; {offset + n_tokens} are needed")
    prefix = [] if bos is None else [torch.tensor([bos], dtype=ids.dtype)]
    return [torch.cat(prefix + [ids[i:i + window]]).unsqueeze(0) for i in range(0, n_tokens, window)]


def perplexity(model, batches: list[torch.Tensor]) -> float:
    """exp(mean next-token cross entropy) over every predicted token of every batch."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in batches:
            logits = model(ids).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return math.exp(total / count)
