"""Mixed precision under a size budget: one candidate scheme per weight, chosen from a
sensitivity report (hf_aoq.sensitivity) to minimise the predicted loss increase at an average
size of at most `target_bits` bits per weight.

The predicted increases add up over weights (each was measured with only that weight
quantized), so the choice is a multiple-choice knapsack: for each weight, one of its candidates
(bytes b, predicted loss change d). `choose_recipe` solves its Lagrangian relaxation (for a price
lam per byte, every weight takes the candidate of least d + lam b; lam is the smallest price at
which the total fits), then spends what is left of the budget greedily on the upgrades that
buy the most predicted loss per byte. The result is an ordinary FqnToConfig of exact weight
names (None for a weight kept in float), which config.json stores like any recipe, so the
checkpoint loads with no special code. Weights whose candidate carries "+gptq" are listed in
`calibrated`: `apply_plan` chooses their values by GPTQ on the calibration tokens, block by block
(hf_aoq.calibration.quantize_planned), in act order for "+gptq-act" candidates; GPTQ changes
the values only, never the recipe.

The report measures each weight alone, in the float model; the chosen weights are quantized
together. `refine_recipe` measures the report again in context: the model runs with the recipe
applied (dequantized), each candidate still quantizes the float weight, and its loss change is
taken with the gradients and inputs the recipe's model has; the knapsack is solved again on that
report (`refine=N` rounds in quantize_mixed_precision, `hf-aoq quantize --bits B --refine N`).
On SmolLM2 at 3.5 bits most of the recipe's optimism was GPTQ fitting the report's 4,096
tokens, which `gptq_calibration` (the recipe's GPTQ on more tokens) addresses; docs/sensitivity.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .configs import FqnToConfig
from .core.errors import AOQError
from .quantize import Decision, carry_out
from .sensitivity import SensitivityReport, sensitivity


@dataclass
class MixedPrecisionPlan:
    """What `choose_recipe` chose: {weight name: candidate name}, the recipe, and its cost."""

    choices: dict[str, str]
    recipe: FqnToConfig
    target_bits: float
    bits_per_weight: float  # the chosen average, over the weights of the report
    predicted_loss_delta: float  # sum of the chosen candidates' predicted loss changes
    base_loss: float  # the float model's loss on the calibration tokens
    counts: dict[str, int] = field(default_factory=dict)  # candidate name -> weights that took it
    calibrated: tuple[str, ...] = ()  # the weights whose candidate is chosen by GPTQ
    act_order: tuple[str, ...] = ()  # those of them whose GPTQ takes the columns in act order ("+gptq-act")

    def predicted_perplexity(self, float_perplexity: float | None = None) -> float:
        """The float model's perplexity (default: on the calibration tokens) x exp(predicted change)."""
        base = math.exp(self.base_loss) if float_perplexity is None else float_perplexity
        return base * math.exp(self.predicted_loss_delta)

    def summary(self) -> str:
        mix = ", ".join(f"{n} x{k}" for n, k in sorted(self.counts.items(), key=lambda kv: -kv[1]))
        return (f"mixed precision: {self.bits_per_weight:.3f} bits/weight (budget {self.target_bits:g}); {mix}; "
                f"predicted loss change {self.predicted_loss_delta:+.4f} (perplexity x{math.exp(self.predicted_loss_delta):.4f})")


def _options(report: SensitivityReport, allowed: set[str] | None):
    """Per weight, its Pareto options (bytes, loss change, candidate name), fewest bytes first."""
    per_layer = []
    for layer in report.layers:
        opts = sorted((m.nbytes, max(m.loss_delta, 0.0), name) for name, m in layer.results.items()
                      if m is not None and (allowed is None or name in allowed))
        if not opts:
            raise AOQError(f"{layer.name}: no candidate fits this weight; add one that does (e.g. int8 or bf16)")
        pareto = []
        for opt in opts:
            if not pareto or opt[1] < pareto[-1][1]:
                pareto.append(opt)
        per_layer.append(pareto)
    return per_layer


def _pick(per_layer, lam: float) -> list[int]:
    return [min(range(len(opts)), key=lambda i: opts[i][1] + lam * opts[i][0]) for opts in per_layer]


def choose_recipe(report: SensitivityReport, target_bits: float, *, candidates=None) -> MixedPrecisionPlan:
    """The recipe of least predicted loss increase whose average size over the report's weights
    is at most `target_bits` bits per weight; `candidates` (names) limits the choice."""
    if isinstance(target_bits, bool) or not isinstance(target_bits, (int, float)) or not target_bits > 0:
        raise AOQError(f"target bits per weight must be a positive number, got {target_bits!r}")
    allowed = None if candidates is None else set(candidates)
    per_layer = _options(report, allowed)
    numel = sum(l.numel for l in report.layers)
    budget = target_bits * numel / 8
    smallest = sum(opts[0][0] for opts in per_layer)
    if smallest > budget:
        raise AOQError(f"a budget of {target_bits:g} bits per weight is below the smallest candidates' "
                       f"{8 * smallest / numel:.3f}; raise it or add a smaller candidate scheme")

    def total(choice):
        return sum(opts[i][0] for opts, i in zip(per_layer, choice))

    # The smallest price per byte at which every weight's cheapest d + lam b fits the budget.
    lo, hi = 0.0, 1.0
    while total(_pick(per_layer, hi)) > budget:
        hi *= 4
        if hi > 1e30:
            break
    choice = _pick(per_layer, lo)
    if total(choice) > budget:
        for _ in range(60):
            mid = (lo + hi) / 2
            if total(_pick(per_layer, mid)) > budget:
                lo = mid
            else:
                hi = mid
        choice = _pick(per_layer, hi)
        if total(choice) > budget:  # ties at the price: fall back to every weight's smallest
            choice = [0] * len(per_layer)
    # Spend what is left on the best predicted loss per byte, one upgrade at a time.
    used = total(choice)
    while True:
        best = None
        for li, (opts, i) in enumerate(zip(per_layer, choice)):
            for j in range(i + 1, len(opts)):
                extra, gain = opts[j][0] - opts[i][0], opts[i][1] - opts[j][1]
                if used + extra <= budget and gain > 0:
                    rate = gain / max(extra, 1)
                    if best is None or rate > best[0]:
                        best = (rate, li, j, extra)
        if best is None:
            break
        _, li, j, extra = best
        choice[li] = j
        used += extra

    by_name = {c.name: c for c in report.candidates}
    choices, mapping, counts, calibrated, act_order = {}, {}, {}, [], []
    delta = 0.0
    for layer, opts, i in zip(report.layers, per_layer, choice):
        _, d, name = opts[i]
        choices[layer.name] = name
        counts[name] = counts.get(name, 0) + 1
        delta += d
        if by_name[name].calibration is not None:
            calibrated.append(layer.name)
            if by_name[name].act_order:
                act_order.append(layer.name)
        for n in (layer.name, *layer.tied):
            mapping[n] = by_name[name].config
    return MixedPrecisionPlan(choices, FqnToConfig(mapping), float(target_bits), 8 * used / numel, delta,
                              report.base_loss, counts, tuple(calibrated), tuple(act_order))


def apply_plan(model: nn.Module, chosen: MixedPrecisionPlan, decisions: dict[str, Decision],
               calibration: list[torch.Tensor] | None = None) -> nn.Module:
    """Quantize `model` in place as `chosen` says, for the weights of `decisions` (the plan the
    report was made over: its ties and placement are kept). Weights of `chosen.calibrated` are
    chosen by GPTQ on `calibration` (token id batches [B, T]), which they need."""
    from dataclasses import replace

    todo = {}
    for name, d in decisions.items():
        cfg = chosen.recipe.mapping.get(name)
        if name not in chosen.choices:
            raise AOQError(f"{name} is in the plan but not in the mixed-precision choice")
        if cfg is not None:
            todo[name] = replace(d, config=cfg)
    if chosen.calibrated:
        if not calibration:
            raise AOQError(f"the mixed-precision recipe calibrates {len(chosen.calibrated)} weights by GPTQ "
                           f"(e.g. {chosen.calibrated[0]}); pass the calibration token batches")
        from .calibration import quantize_planned

        done = quantize_planned(model, todo, calibration, calibrate=chosen.calibrated, act_order=chosen.act_order)
        missed = sorted(set(chosen.calibrated) - {f"{n}.weight" for n in done.calibrated})
        if missed:  # never a silent fallback to plain rounding
            raise AOQError(f"GPTQ could not calibrate {missed[:3]} (only weights that one linear reads); "
                           f"choose a candidate without +gptq for them")
        return model
    return carry_out(model, todo)


def _dequantize_in_place(model: nn.Module, decisions: dict[str, Decision], dtypes: dict[str, torch.dtype]) -> None:
    """Replace each quantized weight of `decisions` (every module that reads it) by its float values."""
    from .core.tensor import AOQTensor

    for name, d in decisions.items():
        w = model.get_parameter(name)
        if not isinstance(w, AOQTensor):
            continue
        value = nn.Parameter(w.dequantize(dtypes[name]).detach(), requires_grad=False)
        for n in (name, *d.tied):
            module_name, _, attr = n.rpartition(".")
            setattr(model.get_submodule(module_name), attr, value)


def refine_recipe(model: nn.Module, chosen: MixedPrecisionPlan, report: SensitivityReport,
                  decisions: dict[str, Decision], batches: list[torch.Tensor], *, rounds: int = 1,
                  candidates=None, gptq_batches: list[torch.Tensor] | None = None,
                  log: Callable[[str], None] | None = None,
                  ) -> tuple[MixedPrecisionPlan, SensitivityReport]:
    """Choose again with each weight's loss change measured in context: `rounds` times, a copy of
    the float `model` gets `chosen` applied (GPTQ as apply_plan does it, on `batches`), its weights
    are dequantized, and hf_aoq.sensitivity measures every candidate of `report` on each float
    weight with that copy's gradients and inputs (GPTQ candidates with its Gram matrices); the
    knapsack is solved on that report at the same budget. Each recipe's loss on `batches` is
    measured on the way (the in-context report's own forward pass; one more for the last), and
    the recipe of least measured loss is returned: the choices can oscillate, since a weight
    moved down in one round makes its neighbours look dearer in the next. Stops early when a
    choice repeats. Returns (that recipe, the last in-context report; its base_loss is the
    float model's, as in `report`). `gptq_batches`: what the recipe's GPTQ runs on, if not
    `batches` (as the final apply_plan will: the context is the model the recipe makes).
    Memory: a second copy of the model."""
    import copy

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise AOQError(f"refine rounds must be a non-negative integer, got {rounds!r}")
    from .sensitivity import mean_loss

    names = [c.name for c in report.candidates] if candidates is None else list(candidates)
    reference = {n: model.get_parameter(n).detach() for n in decisions}
    dtypes = {n: w.dtype for n, w in reference.items()}

    def in_place(plan):
        ctx = copy.deepcopy(model)
        apply_plan(ctx, plan, decisions, gptq_batches or batches)
        _dequantize_in_place(ctx, decisions, dtypes)
        return ctx

    measured: list[tuple[float, MixedPrecisionPlan]] = []  # (the recipe's calibration loss, the recipe)
    for r in range(rounds):
        ctx = in_place(chosen)
        in_context = sensitivity(ctx, report.candidates, batches, decisions=decisions, reference=reference)
        del ctx
        measured.append((in_context.base_loss, chosen))
        in_context.base_loss = report.base_loss
        report = in_context
        new = choose_recipe(in_context, chosen.target_bits, candidates=names)
        if log is not None:
            log(f"refine round {r + 1}: the recipe's calibration loss {measured[-1][0]:.4f} (float "
                f"{report.base_loss:.4f}, predicted {report.base_loss + chosen.predicted_loss_delta:.4f}); "
                f"{sum(new.choices[n] != chosen.choices[n] for n in new.choices)} weights change; {new.summary()}")
        if any(new.choices == plan.choices for _, plan in measured):  # settled, or back to an earlier choice
            break
        chosen = new
    else:
        if rounds:  # the last choice has not been measured yet
            ctx = in_place(chosen)
            measured.append((mean_loss(ctx, batches), chosen))
            del ctx
            if log is not None:
                log(f"refine: the last recipe's calibration loss {measured[-1][0]:.4f}")
    if measured:
        chosen = min(measured, key=lambda lp: lp[0])[1]
    return chosen, report


def quantize_mixed_precision(
    model: nn.Module,
    target_bits: float,
    candidates,
    calibration,
    *,
    tokenizer=None,
    tokens: int = 2048,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    include_embeddings: bool = False,
    decisions: dict[str, Decision] | None = None,
    report: SensitivityReport | None = None,
    refine: int = 0,
    gptq_calibration=None,
    log: Callable[[str], None] | None = None,
) -> tuple[MixedPrecisionPlan, SensitivityReport]:
    """Measure (or take `report`), choose a recipe at `target_bits`, quantize `model` in place by
    it; returns (the choice, the report). Arguments as hf_aoq.sensitivity.sensitivity takes them;
    embeddings are left out unless `include_embeddings`. `refine`: rounds of refine_recipe
    (each measures the report again, in context), 0 for none; the report returned is then the
    last in-context one. `gptq_calibration`: what GPTQ chooses the "+gptq" weights of the
    recipe on (as `calibration` is given; all of it is used), if not the report's tokens: more
    tokens than a report can afford pay here (SmolLM2 at 3.5 bits: 38.53 with GPTQ on the
    report's 4,096 tokens, 36.78 on 16,384)."""
    from .sensitivity import analysis_plan, calibration_batches, parse_candidates

    cands = parse_candidates(candidates)
    if decisions is None:
        decisions = analysis_plan(model, cands, filter_fn=filter_fn, include_embeddings=include_embeddings)
    if report is None:
        report = sensitivity(model, cands, calibration, tokenizer=tokenizer, tokens=tokens, decisions=decisions, log=log)
    missing = sorted(set(decisions) - {l.name for l in report.layers})
    if missing:
        raise AOQError(f"the sensitivity report does not cover {missing[:3]}; measure it on the same model and scope")
    report_scope = SensitivityReport(report.candidates, [l for l in report.layers if l.name in decisions],
                                     report.base_loss, report.tokens, report.seconds, report.estimator)
    chosen = choose_recipe(report_scope, target_bits, candidates=[c.name for c in cands])
    batches = None
    if chosen.calibrated or refine:  # GPTQ and refinement on the same tokens the report measured
        batches = calibration_batches(calibration, tokenizer, tokens=tokens)
        device = next(model.parameters()).device
        batches = [b.to(device) for b in batches]
    gptq_batches = None
    if gptq_calibration is not None:
        gptq_batches = calibration_batches(gptq_calibration, tokenizer, tokens=1 << 62)
        device = next(model.parameters()).device
        gptq_batches = [b.to(device) for b in gptq_batches]
    if refine:
        chosen, report = refine_recipe(model, chosen, report_scope, decisions, batches, rounds=refine,
                                       candidates=[c.name for c in cands], gptq_batches=gptq_batches, log=log)
    apply_plan(model, chosen, decisions, gptq_batches if chosen.calibrated and gptq_batches else batches)
    if log is not None:
        log(chosen.summary())
    return chosen, report
