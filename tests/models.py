"""The tiny models the tests build, in one place: random Llamas from transformers' own classes
(in memory, or saved as a checkpoint with an optional word-level tokenizer) and a two-block
nn.Module for quantize_ without transformers. Test modules import these (tests/ is on sys.path
through conftest.py); subprocess tests put tests/ on PYTHONPATH."""
import torch
import torch.nn.functional as F
from torch import nn


def tiny_llama_config(*, hidden: int = 128, intermediate: int = 256, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, vocab: int = 512, tie: bool = False, bias: bool = False):
    """A LlamaConfig of the given size; `bias` gives every attention and MLP linear a bias."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        attention_bias=bias,
        mlp_bias=bias,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_llama(*, seed: int = 0, **config):
    """A random bf16 LlamaForCausalLM, seeded; `config` as tiny_llama_config takes it."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**config)).to(torch.bfloat16)


def tiny_llama_checkpoint(path, *, seed: int = 0, tokenizer: bool = True, **config):
    """Save tiny_llama(seed, **config) to `path` and return it; with `tokenizer`, also a
    word-level tokenizer over the vocabulary ("<unk>", "<s>", "</s>", then "w3 w4 ...")."""
    model = tiny_llama(seed=seed, **config)
    model.save_pretrained(path)
    if tokenizer:
        save_word_tokenizer(path, model.config.vocab_size)
    return model


def save_word_tokenizer(path, vocab: int) -> None:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.q_proj = nn.Linear(d, d)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x)))) + self.q_proj(x)


class TinyModel(nn.Module):
    """An embedding (vocabulary 128), two residual blocks and a head: linears with and without
    biases, a layer norm, and optionally a head tied to the embedding."""

    def __init__(self, vocab=128, d=64, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tiny_model(dtype=torch.bfloat16, tied=False) -> TinyModel:
    """A seeded TinyModel in `dtype`, in eval mode."""
    torch.manual_seed(0)
    return TinyModel(tied=tied).to(dtype).eval()


def markov_tokens(n_seq: int, length: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    """[n_seq, length] ids from a fixed random Markov chain (each token has four likely successors):
    text a bigram model can learn, so that a trained model's loss is far below log(vocab)."""
    g = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(n_seq, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (n_seq,), generator=g)
    for t in range(1, length):
        ids[:, t] = successors[ids[:, t - 1], torch.randint(0, 4, (n_seq,), generator=g)]
    return ids


def trained_tiny_model(steps: int = 150) -> TinyModel:
    """A float32 TinyModel trained (seeded, a few seconds) on markov_tokens: a model whose loss
    quantization measurably raises, for sensitivity and mixed-precision tests."""
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = markov_tokens(64, 33, seed=1)
    for step in range(steps):
        ids = data[(step * 16) % 64:(step * 16) % 64 + 16]
        logits = model(ids)[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()
