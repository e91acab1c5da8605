"""Per-layer sensitivity: what each candidate scheme costs each weight of a model.

`sensitivity(model, candidates, calibration)` measures, for every weight a recipe can reach
(linears, and embeddings) and every candidate (a scheme name of hf_aoq.configs, or a config):
  - bits per weight: the quantized tensor's own bytes (codes, scales, zeros) x 8 / elements;
  - weight SQNR: 10 log10(|W|^2 / |Q - W|^2), in dB;
  - output SQNR: the same for the layer's output on the calibration activations;
  - the predicted change of the model's mean next-token loss when only that weight is quantized.

The loss change comes from one forward and one backward pass of the float model over the
calibration tokens (no weight gradients: only the gradient g_s of the summed loss with respect
to each layer's output at each position s). For a weight change dW the output at s moves by
dy_s = dW x_s, and the loss by about

    first order     sum_s g_s . dy_s / T
    Fisher          0.5 sum_s (g_s . dy_s)^2 / T            (the empirical Fisher, one sample per position)
    diagonal        0.5 sum_s sum_i g_si^2 dy_si^2 / T

over T predicted tokens. The first-order term has no sign a budget can use (rounding is as likely
to lower the calibration loss as to raise it) and does not carry over to other text; the Fisher
terms are the expected increase. `loss_delta` is the Fisher estimate (ESTIMATOR); the others are
kept in the report. docs/sensitivity.md records how they compare with exact one-weight swaps on
SmolLM2, which `exact=N` measures for the N worst weights (a forward pass per weight and candidate).

Memory: the float model, its activations for one backward pass over a batch, and one
candidate's quantized copy of one weight at a time (it is made, measured and dropped inside the
backward hook of the layer that reads it). A "+gptq" candidate (hf_aoq.candidates) is quantized
by GPTQ from the Gram matrix of the layer's inputs on the float model: with one batch, the inputs
the hook already holds; with several, a forward pre-pass sums them over every batch (one K x K
float32 matrix per linear) and each GPTQ weight is made once and kept. Calibration tokens are processed `batch_windows`
windows at a time; each batch quantizes every weight again, so a single batch is fastest.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .configs import FqnToConfig, recipe_to_dict
from .core.errors import AOQError
from .core.tensor import AOQTensor
from .candidates import (  # noqa: F401  (re-exported: hf_aoq.sensitivity.Candidate, parse_candidate, ...)
    CALIBRATIONS, FLOAT_NAMES, Candidate, input_grams, parse_candidate, parse_candidates, quantize_candidate,
)
from .quantize import Decision, plan, tie_groups

ESTIMATOR = "fisher"
REPORT_VERSION = 1
_CHUNK_ELEMENTS = 1 << 23  # rows of a layer's output change computed at once: about 32 MiB of float32


# ---------------------------------------------------------------------- the report
@dataclass
class Measurement:
    """One weight under one candidate. `loss_delta` is the ESTIMATOR's value; exact_delta is the
    measured change when only this weight is quantized (None unless measured)."""

    bits: float
    nbytes: int
    weight_sqnr_db: float
    output_sqnr_db: float
    loss_delta: float
    first_order: float
    diagonal: float
    exact_delta: float | None = None


@dataclass
class LayerSensitivity:
    name: str  # the weight's first name ("model.layers.0.mlp.down_proj.weight")
    kind: str  # "linear" or "embedding" (the first module that reads it)
    shape: tuple[int, ...]
    tied: tuple[str, ...] = ()  # its other names
    results: dict[str, Measurement | None] = field(default_factory=dict)  # None: the candidate does not fit

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def worst(self) -> float:
        return max((m.loss_delta for m in self.results.values() if m is not None), default=0.0)


@dataclass
class SensitivityReport:
    candidates: list[Candidate]
    layers: list[LayerSensitivity]
    base_loss: float  # the float model's mean next-token loss on the calibration tokens
    tokens: int  # predicted tokens the estimates were made on
    seconds: float = 0.0
    estimator: str = ESTIMATOR

    def layer(self, name: str) -> LayerSensitivity:
        for layer in self.layers:
            if name == layer.name or name in layer.tied:
                return layer
        raise AOQError(f"the sensitivity report has no weight named {name!r}")

    def to_dict(self) -> dict:
        return {
            "version": REPORT_VERSION,
            "estimator": self.estimator,
            "base_loss": self.base_loss,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "candidates": [{"name": c.name, "config": None if c.config is None else recipe_to_dict(c.config),
                            **({"calibration": c.calibration} if c.calibration else {})}
                           for c in self.candidates],
            "layers": [{"name": l.name, "kind": l.kind, "shape": list(l.shape), "tied": list(l.tied),
                        "results": {k: None if m is None else asdict(m) for k, m in l.results.items()}}
                       for l in self.layers],
        }

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "sensitivity report") -> "SensitivityReport":
        from .configs import recipe_from_dict
        from .core.errors import FormatError

        try:
            if data["version"] != REPORT_VERSION:
                raise FormatError(f"{where}: version {data['version']!r}; this hf_aoq reads {REPORT_VERSION}")
            candidates = [Candidate(str(c["name"]), None if c["config"] is None
                                    else recipe_from_dict(c["config"], where=f"{where}.candidates"),
                                    None if c.get("calibration") is None else str(c["calibration"]))
                          for c in data["candidates"]]
            layers = [LayerSensitivity(str(l["name"]), str(l["kind"]), tuple(int(s) for s in l["shape"]),
                                       tuple(str(t) for t in l["tied"]),
                                       {str(k): None if m is None else Measurement(**m) for k, m in l["results"].items()})
                      for l in data["layers"]]
            return cls(candidates, layers, float(data["base_loss"]), int(data["tokens"]),
                       float(data.get("seconds", 0.0)), str(data.get("estimator", ESTIMATOR)))
        except FormatError:
            raise
        except AOQError as e:  # e.g. a calibration method this hf_aoq does not know
            raise FormatError(f"{where}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"{where}: not a sensitivity report written by hf_aoq ({type(e).__name__}: {e})") from None

    def save(self, path: str | os.PathLike) -> None:
        """Write the report as JSON (a temporary file renamed into place)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def table(self, top: int | None = 20) -> str:
        """The worst `top` weights (largest predicted loss change under any candidate) first, one
        row per weight and candidate."""
        header = ["weight", "scheme", "bits", "weight dB", "output dB", "d loss (pred)", "d loss (exact)"]
        rows = []
        ranked = sorted(self.layers, key=lambda l: l.worst(), reverse=True)
        for layer in ranked[:top] if top else ranked:
            for c in self.candidates:
                m = layer.results.get(c.name)
                if m is None:
                    rows.append([layer.name, c.name, "-", "-", "-", "does not fit", ""])
                    continue
                rows.append([layer.name, c.name, f"{m.bits:.2f}", _db(m.weight_sqnr_db), _db(m.output_sqnr_db),
                             f"{m.loss_delta:.2e}", "" if m.exact_delta is None else f"{m.exact_delta:+.2e}"])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                 for r in [header, *rows]]
        return "\n".join(lines)


def _db(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.1f}"


def _sqnr_db(signal: float, noise: float) -> float:
    if noise <= 0:
        return math.inf
    return 10 * math.log10(max(signal, 1e-30) / noise)


# ---------------------------------------------------------------------- calibration tokens
def calibration_batches(calibration, tokenizer=None, *, tokens: int = 2048, window: int = 512,
                        batch_windows: int | None = None) -> list[torch.Tensor]:
    """[B, 1 + window] id batches of BOS-prefixed windows (hf_aoq.perplexity's protocol) from a
    text file (a Path), a text (a str, with `tokenizer`), or id tensors (used as they are)."""
    from . import perplexity

    if isinstance(calibration, (list, tuple)) and all(isinstance(b, torch.Tensor) for b in calibration):
        batches = [b if b.ndim == 2 else b.unsqueeze(0) for b in calibration]
        if not batches:
            raise AOQError("calibration: no batches of token ids")
        return batches
    if isinstance(calibration, torch.Tensor):
        return [calibration if calibration.ndim == 2 else calibration.unsqueeze(0)]
    if isinstance(calibration, os.PathLike):
        calibration = perplexity.read_text(calibration)
    if not isinstance(calibration, str):
        raise AOQError(f"calibration must be a text file (Path), a text (str) or token id tensors, got {type(calibration).__name__}")
    if tokenizer is None:
        raise AOQError("calibration text needs the model's tokenizer (tokenizer=...)")
    ids = tokenizer(calibration, return_tensors="pt").input_ids[0]
    if ids.numel() < 2:
        raise AOQError("calibration: the text is empty")
    tokens = min(tokens, ids.numel())
    window = min(window, tokens)
    tokens -= tokens % window
    windows = perplexity.windows(ids, tokenizer.bos_token_id, n_tokens=tokens, window=window)
    step = batch_windows or len(windows)
    return [torch.cat(windows[i:i + step]) for i in range(0, len(windows), step)]


def _logits(model, ids):
    kwargs = {"use_cache": False} if hasattr(model, "config") else {}
    out = model(ids, **kwargs)
    return out.logits if hasattr(out, "logits") else out


def _summed_loss(model, ids) -> torch.Tensor:
    logits = _logits(model, ids)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")


def mean_loss(model, batches: list[torch.Tensor]) -> float:
    """Mean next-token cross entropy over every predicted token of every batch."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in batches:
            total += _summed_loss(model, ids).item()
            count += ids[:, 1:].numel()
    return total / count


# ---------------------------------------------------------------------- the scope
def analysis_plan(model: nn.Module, candidates: list[Candidate], *, filter_fn=None, include_embeddings: bool = True,
                  skip: Callable[[str, str], bool] | None = None) -> dict[str, Decision]:
    """The weights a sensitivity analysis covers, as hf_aoq.quantize.plan sees them: every
    nn.Linear weight and (with `include_embeddings`) every nn.Embedding weight that `filter_fn`
    accepts, tied tensors once. A weight tied to an embedding is left out with it."""
    probe = next((c.config for c in candidates if c.config is not None), None)
    if probe is None:
        raise AOQError("sensitivity needs at least one candidate that quantizes (not only bf16)")
    embeddings = {n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    groups = tie_groups(model)
    with_embedding = {n for n, names in groups.items() if any(x.rpartition(".")[0] in embeddings for x in names)}

    def skipped(module_name, name):
        if skip is not None and skip(module_name, name):
            return True
        return not include_embeddings and name in with_embedding

    return plan(model, FqnToConfig({"_default": probe}), filter_fn=filter_fn, skip=skipped,
                embeddings=embeddings if include_embeddings else ())


# ---------------------------------------------------------------------- measuring
class _Accumulator:
    """Sums over positions for one weight under one candidate."""

    __slots__ = ("err2", "out2", "first", "fisher", "diag")

    def __init__(self):
        self.err2 = self.out2 = self.first = self.fisher = self.diag = 0.0


class _Analysis:
    """The hooks of one analysis: forward hooks keep each reading module's input and output
    size; a hook on its output's gradient measures every candidate for the weight it reads."""

    def __init__(self, model, decisions: dict[str, Decision], candidates: list[Candidate],
                 reference: dict[str, torch.Tensor] | None = None):
        self.model = model
        self.reference = reference or {}  # {weight name: the float weight the candidates quantize}
        self.candidates = [c for c in candidates if c.config is not None]
        self.decisions = decisions
        self.sums = {(n, c.name): _Accumulator() for n in decisions for c in self.candidates}
        self.static: dict[tuple[str, str], tuple[int, float] | None] = {}  # (bytes, weight SQNR) or None
        self.readers: dict[str, list[str]] = {n: [x.rpartition(".")[0] for x in (n, *d.tied)] for n, d in decisions.items()}
        # GPTQ candidates: with several batches, the Gram matrices over all of them (a pre-pass)
        # and each calibrated tensor, made once; with one, the batch's own inputs.
        self.grams: dict[str, torch.Tensor] | None = None
        self.calibrated: dict[tuple[str, str], AOQTensor] = {}

    def hooks(self):
        handles = []
        owner = {m: n for n, mods in self.readers.items() for m in mods}
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            if isinstance(module, nn.Embedding):
                handles.append(module.register_forward_hook(self._start_graph))
            if module_name in owner:
                handles.append(module.register_forward_hook(self._reader(owner[module_name])))
        return handles

    @staticmethod
    def _start_graph(module, args, output):
        # No parameter takes a gradient; the embedding's output is where the graph starts.
        if not output.requires_grad:
            return output.detach().requires_grad_(True)
        return None

    def _reader(self, name):
        def hook(module, args, output):
            x = args[0].detach()
            out2 = output.detach().float().square().sum().item()
            if output.requires_grad:
                output.register_hook(lambda g: self._measure(name, module, x, out2, g.detach()))
        return hook

    def _measure(self, name, module, x, out2, g):
        w = self.reference.get(name)
        if w is None:
            w = self.model.get_parameter(name).detach()
        wf = w.float()
        embedding = isinstance(module, nn.Embedding)
        g = g.reshape(-1, g.shape[-1]).float()
        x = x.reshape(-1) if embedding else x.reshape(-1, x.shape[-1]).float()
        rows = max(1, _CHUNK_ELEMENTS // max(g.shape[1], 1))
        for c in self.candidates:
            key = (name, c.name)
            if self.static.get(key, ()) is None:
                continue
            try:
                q = self._quantize(c, name, w, None if embedding else x)
            except AOQError:
                self.static[key] = None  # e.g. a group size that does not divide this weight
                continue
            dw = q.dequantize(torch.float32) - wf
            if key not in self.static:
                nbytes = sum(t.numel() * t.element_size() for t in q.to_canonical().tensor_fields().values())
                self.static[key] = (nbytes, _sqnr_db(wf.square().sum().item(), dw.square().sum().item()))
            del q
            acc = self.sums[key]
            acc.out2 += out2
            for start in range(0, g.shape[0], rows):
                gc = g[start:start + rows]
                dy = dw[x[start:start + rows]] if embedding else x[start:start + rows] @ dw.t()
                along = (gc * dy).sum(dim=1)
                acc.err2 += dy.square().sum().item()
                acc.first += along.sum().item()
                acc.fisher += along.square().sum().item()
                acc.diag += (gc.square() * dy.square()).sum().item()

    def _quantize(self, c: Candidate, name: str, w: torch.Tensor, x: torch.Tensor | None) -> AOQTensor:
        if c.calibration is None:
            return quantize_candidate(c, w, name=name)
        key = (name, c.name)
        if key in self.calibrated:
            return self.calibrated[key]
        if self.grams is not None:
            gram = self.grams.get(name)
        else:
            gram = None if x is None or len(self.readers[name]) > 1 else x.t() @ x
        if gram is None:
            raise AOQError(f"{name}: GPTQ calibrates weights that one linear reads")  # this candidate does not fit
        q = quantize_candidate(c, w, gram=gram, name=name)
        if self.grams is not None:
            self.calibrated[key] = q
        return q

    def layers(self, tokens: int, all_candidates: list[Candidate]) -> list[LayerSensitivity]:
        out = []
        for name, d in self.decisions.items():
            module = self.model.get_submodule(name.rpartition(".")[0])
            layer = LayerSensitivity(name, "embedding" if isinstance(module, nn.Embedding) else "linear",
                                     tuple(d.shape), tuple(d.tied))
            for c in all_candidates:
                if c.config is None:
                    bits = 8 * self.model.get_parameter(name).element_size()
                    layer.results[c.name] = Measurement(bits, layer.numel * bits // 8, math.inf, math.inf, 0.0, 0.0, 0.0)
                    continue
                static = self.static.get((name, c.name))
                if static is None:
                    layer.results[c.name] = None
                    continue
                nbytes, wdb = static
                acc = self.sums[(name, c.name)]
                layer.results[c.name] = Measurement(
                    bits=8 * nbytes / layer.numel, nbytes=nbytes, weight_sqnr_db=wdb,
                    output_sqnr_db=_sqnr_db(acc.out2, acc.err2), loss_delta=0.5 * acc.fisher / tokens,
                    first_order=acc.first / tokens, diagonal=0.5 * acc.diag / tokens)
            out.append(layer)
        return out


def sensitivity(
    model: nn.Module,
    candidates,
    calibration,
    *,
    tokenizer=None,
    tokens: int = 2048,
    window: int = 512,
    batch_windows: int | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    include_embeddings: bool = True,
    decisions: dict[str, Decision] | None = None,
    exact: int = 0,
    reference: dict[str, torch.Tensor] | None = None,
    log: Callable[[str], None] | None = None,
) -> SensitivityReport:
    """Measure every candidate on every weight of `model` in scope (see the module docstring).

    `candidates`: scheme names ("int4,int8,int4-plain:g32,bf16") or configs. `calibration`: a
    text file (Path), a text (str; needs `tokenizer`) or token id tensors [B, T]; the first
    `tokens` tokens in BOS-prefixed windows of `window`. The scope is `decisions` (a plan from
    hf_aoq.quantize.plan) or every linear and embedding weight `filter_fn` accepts. `exact`:
    also measure the exact loss change of quantizing only that weight, for the `exact` weights
    with the largest predicted change (one forward pass over the calibration tokens each).
    `reference` ({weight name: float weight}): the candidates quantize these weights instead of
    the model's own, and each change is measured from them, while the model runs with its own
    values: the measurement in context of hf_aoq.mixed_precision.refine_recipe, whose model
    holds a recipe's dequantized weights and whose reference is the float model's."""
    start = time.perf_counter()
    candidates = parse_candidates(candidates)
    batches = calibration_batches(calibration, tokenizer, tokens=tokens, window=window, batch_windows=batch_windows)
    device = next(model.parameters()).device
    batches = [b.to(device) for b in batches]
    if decisions is None:
        decisions = analysis_plan(model, candidates, filter_fn=filter_fn, include_embeddings=include_embeddings)
    for name, d in decisions.items():
        if isinstance(model.get_parameter(name), AOQTensor) or len(d.shape) != 2:
            raise AOQError(f"{name}: sensitivity measures 2-D float weights; this one is {tuple(d.shape)} "
                           f"{type(model.get_parameter(name)).__name__}")
    if not decisions:
        raise AOQError("sensitivity: no weight in scope (no linear or embedding the filter accepts)")
    if reference:
        for name, w in reference.items():
            if name not in decisions or tuple(w.shape) != tuple(decisions[name].shape):
                raise AOQError(f"sensitivity reference {name!r}: not a weight in scope of shape "
                               f"{tuple(decisions[name].shape) if name in decisions else '(none)'}, got {tuple(w.shape)}")
    analysis = _Analysis(model, decisions, candidates, reference)
    if len(batches) > 1 and any(c.calibration for c in candidates):
        analysis.grams = input_grams(model, decisions, batches)
    grad_flags = {n: p.requires_grad for n, p in model.named_parameters()}
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    handles = analysis.hooks()
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        with torch.enable_grad():
            for i, ids in enumerate(batches):
                loss = _summed_loss(model, ids)
                if not loss.requires_grad:
                    raise AOQError("sensitivity: the model's loss does not depend on any measured layer "
                                   "(it needs an nn.Embedding input and nn.Linear/nn.Embedding weights)")
                loss.backward()
                total += loss.item()
                count += ids[:, 1:].numel()
                if log is not None:
                    log(f"sensitivity: batch {i + 1}/{len(batches)} measured")
    finally:
        for h in handles:
            h.remove()
        for n, p in model.named_parameters():
            p.requires_grad_(grad_flags.get(n, False))
        model.train(was_training)
    report = SensitivityReport(candidates, analysis.layers(count, candidates), total / count, count)
    if exact:
        worst = sorted(report.layers, key=lambda l: l.worst(), reverse=True)[:exact]
        exact_loss_deltas(model, report, [l.name for l in worst], batches, log=log)
    report.seconds = time.perf_counter() - start
    return report


def exact_loss_deltas(model, report: SensitivityReport, names: list[str], batches: list[torch.Tensor], *,
                      log: Callable[[str], None] | None = None) -> None:
    """Fill `exact_delta` for each named weight and candidate: the model's mean loss on `batches`
    with only that weight quantized (dequantized in place, then restored), minus the float loss."""
    base = mean_loss(model, batches)
    grams = input_grams(model, names, batches) if any(c.calibration for c in report.candidates) else {}
    for name in names:
        layer = report.layer(name)
        param = model.get_parameter(layer.name)
        original = param.data
        try:
            for c in report.candidates:
                m = layer.results.get(c.name)
                if m is None or c.config is None:
                    if m is not None:
                        m.exact_delta = 0.0
                    continue
                if c.calibration is not None and name not in grams:
                    m.exact_delta = None
                    continue
                q = quantize_candidate(c, original, gram=grams.get(name), name=name)
                param.data = q.dequantize(original.dtype)
                m.exact_delta = mean_loss(model, batches) - base
        finally:
            param.data = original
        if log is not None:
            log(f"sensitivity: exact swaps of {name} measured")
