"""What a GGUF file says besides its tensors, for the architectures hf_aoq exports (llama; mistral
is llama to llama.cpp): transformers' tensor names <-> llama.cpp's, config.json <-> the
`llama.*` keys, and the tokenizer (tokenizer.json) <-> the `tokenizer.ggml.*` keys.

An exported file also carries `hf_aoq.config` (the source's config.json without its
quantization_config), so that `convert` gives back the same config; llama.cpp and transformers
ignore keys they do not know.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..core.errors import AOQError
from .gguf_file import ARRAY, BOOL, FLOAT32, INT32, KV, STRING, UINT32

ARCHITECTURES = {"llama": "llama", "mistral": "llama"}  # transformers model_type -> GGUF architecture
HF_CONFIG_KEY = "hf_aoq.config"

# transformers module path (after "model.layers.N.") -> llama.cpp tensor name (after "blk.N.").
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}


class MetadataError(AOQError):
    """A model or tokenizer GGUF cannot describe (the message names the field)."""


def _rename(name: str, top: dict, layer_re: str, layer: dict, layer_prefix: str) -> str | None:
    module, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "bias"):
        return None
    if module in top:
        return f"{top[module]}.{leaf}"
    m = re.fullmatch(layer_re, module)
    if m and m[2] in layer:
        return f"{layer_prefix}.{m[1]}.{layer[m[2]]}.{leaf}"
    return None


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's name for a transformers parameter ("model.layers.3.mlp.up_proj.weight" ->
    "blk.3.ffn_up.weight"), or None when llama's GGUF architecture has no such tensor."""
    return _rename(hf_name, _TOP, r"model\.layers\.(\d+)\.(.+)", _LAYER, "blk")


def hf_name(name: str) -> str | None:
    """The inverse of `gguf_name`."""
    return _rename(name, _TOP_BACK, r"blk\.(\d+)\.(.+)", _LAYER_BACK, "model.layers")


def permuted_heads(hf: str, config: dict) -> int | None:
    """The head count llama.cpp's q/k row permutation uses for this parameter, or None."""
    if ".self_attn.q_proj." in hf:
        return config["num_attention_heads"]
    if ".self_attn.k_proj." in hf:
        return config.get("num_key_value_heads") or config["num_attention_heads"]
    return None


# ---------------------------------------------------------------------- config.json -> llama.*
def _need(config: dict, key: str, where: str):
    value = config.get(key)
    if value is None:
        raise MetadataError(f"{where}: config.json has no {key!r}, which GGUF's llama metadata needs")
    return value


def architecture_metadata(config: dict, where: str, name: str) -> dict[str, KV]:
    """general.* and llama.* keys for this config.json (MetadataError for what GGUF's llama
    architecture cannot say: rope scaling, sliding windows, biases on the MLP...)."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise MetadataError(f"{where}: model_type {model_type!r}: GGUF export knows {', '.join(ARCHITECTURES)} "
                            f"(llama.cpp's 'llama' architecture)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    if rope_type not in (None, "default"):
        raise MetadataError(f"{where}: rope_parameters.rope_type {rope_type!r}: hf_aoq writes GGUF for the default "
                            f"rotary embedding only")
    if config.get("mlp_bias"):
        raise MetadataError(f"{where}: mlp_bias: llama.cpp's llama architecture has no MLP biases")
    if model_type == "mistral" and config.get("sliding_window"):
        raise MetadataError(f"{where}: sliding_window {config['sliding_window']}: llama.cpp's llama architecture "
                            f"has no sliding window")
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta if theta is not None else config.get("rope_theta", 10000.0)
    heads = _need(config, "num_attention_heads", where)
    hidden = _need(config, "hidden_size", where)
    head_dim = config.get("head_dim") or hidden // heads
    u32 = lambda v: KV(UINT32, int(v))  # noqa: E731
    return {
        "general.architecture": KV(STRING, "llama"),
        "general.name": KV(STRING, name),
        "general.quantization_version": u32(2),
        "llama.context_length": u32(config.get("max_position_embeddings", 2048)),
        "llama.embedding_length": u32(hidden),
        "llama.block_count": u32(_need(config, "num_hidden_layers", where)),
        "llama.feed_forward_length": u32(_need(config, "intermediate_size", where)),
        "llama.attention.head_count": u32(heads),
        "llama.attention.head_count_kv": u32(config.get("num_key_value_heads") or heads),
        "llama.attention.layer_norm_rms_epsilon": KV(FLOAT32, float(config.get("rms_norm_eps", 1e-6))),
        "llama.rope.freq_base": KV(FLOAT32, float(theta)),
        "llama.rope.dimension_count": u32(head_dim),
        "llama.attention.key_length": u32(head_dim),
        "llama.attention.value_length": u32(head_dim),
        "llama.vocab_size": u32(_need(config, "vocab_size", where)),
    }


def config_from_metadata(metadata: dict, has_output: bool, where: str) -> dict:
    """A transformers config.json for a GGUF file: the one an hf_aoq export carried, or one
    rebuilt from its llama.* keys."""
    if isinstance(metadata.get(HF_CONFIG_KEY), str):
        try:
            config = json.loads(metadata[HF_CONFIG_KEY])
        except ValueError as e:
            raise MetadataError(f"{where}: metadata {HF_CONFIG_KEY!r} is not JSON ({e})") from None
        if isinstance(config, dict):
            return config
        raise MetadataError(f"{where}: metadata {HF_CONFIG_KEY!r} is not a JSON object")
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise MetadataError(f"{where}: metadata 'general.architecture' {arch!r}: hf_aoq converts llama GGUF files")

    def get(key, kind=int, default=None):
        value = metadata.get(f"llama.{key}", default)
        if value is None or (kind is int and type(value) is not int) or (kind is float and not isinstance(value, (int, float))):
            raise MetadataError(f"{where}: metadata 'llama.{key}' {value!r}: expected {kind.__name__}")
        return value

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = metadata.get("llama.vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    if type(vocab) is not int:
        raise MetadataError(f"{where}: metadata 'llama.vocab_size' is missing and there are no tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", int, heads),
        "head_dim": get("rope.dimension_count", int, hidden // heads),
        "max_position_embeddings": get("context_length", int, 2048),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", float)),
        "rope_theta": float(get("rope.freq_base", float, 10000.0)),
        "vocab_size": vocab, "tie_word_embeddings": not has_output, "dtype": "bfloat16",
    }
    for key, token in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("pad_token_id", "padding_token_id")):
        value = metadata.get(f"tokenizer.ggml.{token}")
        if type(value) is int:
            config[key] = value
    return config


# ---------------------------------------------------------------------- tokenizer.json -> tokenizer.ggml.*
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def tokenizer_metadata(src: Path, config: dict, vocab_size: int) -> tuple[dict[str, KV], str | None]:
    """(tokenizer.ggml.* keys, None) from SRC's tokenizer.json, or ({}, why not) when it has no
    GGUF form. Byte-level BPE becomes "gpt2" (tokens, types, merges); BPE with byte fallback
    (SentencePiece-style, Llama 2) becomes "llama" with score -id per token (tokenizer.json
    keeps no SentencePiece scores; the merge ranks follow the ids). The vocabulary is padded to
    the embedding's rows with unused tokens, as llama.cpp's converters do."""
    path = src / "tokenizer.json"
    if not path.is_file():
        return {}, "no tokenizer.json in the source folder"
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
        model = tok["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {}, f"{path} does not parse ({type(e).__name__})"
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return {}, f"{path}: a {model.get('type') if isinstance(model, dict) else '?'} tokenizer; GGUF holds BPE ones"
    kind = "llama" if model.get("byte_fallback") else "gpt2"
    ids = {int(i): t for t, i in model["vocab"].items()}
    added = {int(a["id"]): a for a in tok.get("added_tokens") or [] if isinstance(a, dict) and "id" in a}
    for i, a in added.items():
        ids[i] = a.get("content", ids.get(i))
    n = max(vocab_size, max(ids) + 1 if ids else 0)
    tokens, types = [], []
    unk = model.get("unk_token")
    for i in range(n):
        t = ids.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif kind == "llama" and re.fullmatch(r"<0x[0-9A-F]{2}>", t):
            tokens.append(t)
            types.append(BYTE)  # byte-fallback pieces, whether in the vocab or added
        elif i in added:
            tokens.append(t)
            types.append(UNKNOWN if t == unk else CONTROL if added[i].get("special") else USER_DEFINED)
        else:
            tokens.append(t)
            types.append(UNKNOWN if t == unk else NORMAL)
    out = {"tokenizer.ggml.model": KV(STRING, kind), "tokenizer.ggml.pre": KV(STRING, "default"),
           "tokenizer.ggml.tokens": KV(ARRAY, tokens, STRING), "tokenizer.ggml.token_type": KV(ARRAY, types, INT32)}
    if kind == "llama":
        out["tokenizer.ggml.scores"] = KV(ARRAY, [float(-i) for i in range(n)], FLOAT32)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if merges:
        out["tokenizer.ggml.merges"] = KV(ARRAY, merges, STRING)
    special = _special_ids(src, config, {t: i for i, t in enumerate(tokens)})
    for key, value in special.items():
        out[f"tokenizer.ggml.{key}"] = KV(UINT32, value)
    tc = _read_json(src / "tokenizer_config.json")
    for key in ("add_bos_token", "add_eos_token"):
        if isinstance(tc.get(key), bool):
            out[f"tokenizer.ggml.{key}"] = KV(BOOL, tc[key])
    template = tc.get("chat_template")
    if not isinstance(template, str) and (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, str):
        out["tokenizer.chat_template"] = KV(STRING, template)
    return out, None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _special_ids(src: Path, config: dict, ids: dict[str, int]) -> dict[str, int]:
    tc = _read_json(src / "tokenizer_config.json")
    out = {}
    for key, cfg_key, tc_key in (("bos_token_id", "bos_token_id", "bos_token"), ("eos_token_id", "eos_token_id", "eos_token"),
                                 ("unknown_token_id", None, "unk_token"), ("padding_token_id", "pad_token_id", "pad_token")):
        value = config.get(cfg_key) if cfg_key else None
        if isinstance(value, list) and value:
            value = value[0]
        if type(value) is not int:
            token = tc.get(tc_key)
            token = token.get("content") if isinstance(token, dict) else token
            value = ids.get(token) if isinstance(token, str) else None
        if type(value) is int and value >= 0:
            out[key] = value
    return out
