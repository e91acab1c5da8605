"""The quantization plan (which config each parameter gets) and `quantize_`, which carries it out.

`plan` is the one place that decides, for any nn.Module, which parameters are quantized with
which config: `quantize_` and the transformers quantizer both call it. Its precedence, for a
parameter `P` of module `M` (docs/transformers.md says the same for users):

  1. `skip(M, P)` (the quantizer's modules_to_not_convert): left as it is.
  2. an exact FqnToConfig key naming `P` or `M` (for `M`: its `weight`) wins over step 3.
  3. `default_skip(M, P)` (transformers' default skips): left as it is.
  4. the recipe: an FqnToConfig resolves with its own precedence (hf_aoq.configs); a weight of an
     `embeddings` module that no key matches takes "_default". A single config takes the 2-D
     `weight` of every module `filter_fn(M, name)` accepts (default: nn.Linear, and `embeddings`).
     With an FqnToConfig, `filter_fn` (when given) further restricts the modules it reaches.
Fused MoE experts (`is_fused_experts`: a 3-D float parameter of a module that is not a
convolution, e.g. transformers' `mlp.experts.gate_up_proj`) count as weights in step 4: a single
config takes them, FqnToConfig's regexes and "_default" reach them. Routers stay float unless
named (they are 2-D weights of modules that are not nn.Linear).
Experts stored [E, in, out] (`stored_in_by_out`: gpt-oss's, which compute x @ w[e]) are quantized
as their transpose [E, out, in], groups along "in" as for every linear weight, and held as its
`TransposedExperts` view (the module sees its own layout; x @ w[e], grouped_mm and bmm run the
kernels): `Decision.transposed`.
A parameter that is already quantized is left as it is. Parameters that are one tensor (tied
weights) are planned once: they must all resolve to the same config (or all be left as they
are), otherwise it is an AOQError; they are never silently untied.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from torch import nn

from .configs import AOQBaseConfig, FqnToConfig
from .core.errors import AOQError
from .core.tensor import AOQTensor
from .decode_attention import route_decode_attention
from .dense_linear import route_dense_linears
from .tensors.experts import TransposedExperts

Predicate = Callable[[str, str], bool]  # (module name, parameter name) -> bool


@dataclass(frozen=True)
class Decision:
    """What the plan decided for one tensor, keyed by its first name."""

    config: AOQBaseConfig
    shape: tuple[int, ...]  # the parameter's shape when planned: a value of another shape is not it
    place: bool  # repack (place()) for the kernels: see placed_for_kernels
    tied: tuple[str, ...] = ()  # the tensor's other names, which get the same quantized tensor
    transposed: bool = False  # quantize the [E, in, out] parameter's transpose: see stored_in_by_out


def _parent(name: str) -> tuple[str, str]:
    module_name, _, leaf = name.rpartition(".")
    return module_name, leaf


def tie_groups(model: nn.Module, ties: Mapping[str, str] | None = None) -> dict[str, tuple[str, ...]]:
    """{parameter name: every name of its tensor, the first (the source) first} for the names
    that share a tensor. `ties` ({name: name it is tied to}, e.g. transformers'
    `all_tied_weights_keys`) declares them; by default, parameters that are one object are."""
    if ties is None:
        by_id: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), []).append(name)
        lists = [names for names in by_id.values() if len(names) > 1]
    else:
        # Union the declared pairs; a group lists its source (the name not tied to another) first.
        root: dict[str, str] = {}

        def find(n: str) -> str:
            while root.setdefault(n, n) != n:
                n = root[n]
            return n

        for target, source in ties.items():
            root[find(target)] = find(source)
        members: dict[str, list[str]] = {}
        for n in root:
            members.setdefault(find(n), []).append(n)
        lists = [sorted(names, key=lambda n: n in ties) for names in members.values()]
    groups: dict[str, tuple[str, ...]] = {}
    for names in lists:
        unique = tuple(dict.fromkeys(names))
        for n in unique:
            groups[n] = unique
    return groups


def reads_only_by_linear(model: nn.Module, names: Iterable[str]) -> bool:
    """Whether every module owning one of `names` is an nn.Linear (placement is for F.linear)."""
    return all(isinstance(model.get_submodule(_parent(n)[0]), nn.Linear) for n in names)


def is_fused_experts(module: nn.Module, param) -> bool:
    """Whether `param` of `module` is a fused MoE experts weight [E, N, K]: 3-D, floating point,
    and not a convolution's kernel."""
    return param.ndim == 3 and param.is_floating_point() and not isinstance(module, nn.modules.conv._ConvNd)


# Fused-experts modules that store their 3-D weights [E, in, out] and compute x @ w[e] (not
# F.linear(x, w[e]) on [E, out, in]), by the qualified name of the class (or of a base class), with
# the parameters stored that way. The layout cannot be told from the shapes (gpt-oss-20b's
# down_proj is 2880 x 2880), so it is declared here per architecture; a module not listed keeps
# its stored layout (quantized along its last dimension, run on the reference path).
IN_BY_OUT_EXPERTS: dict[str, tuple[str, ...]] = {
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts": ("gate_up_proj", "down_proj"),
}


def stored_in_by_out(module: nn.Module, pname: str) -> bool:
    """Whether parameter `pname` of `module` is fused experts stored [E, in, out] (IN_BY_OUT_EXPERTS)."""
    for cls in type(module).__mro__:
        names = IN_BY_OUT_EXPERTS.get(f"{cls.__module__}.{cls.__qualname__}")
        if names is not None:
            return pname in names
    return False


def placed_for_kernels(model: nn.Module, names: Iterable[str]) -> bool:
    """Whether the tensor under `names` is repacked (place()) for the kernels: when linears
    alone read it, or when it is fused experts [E, out, in] (each expert packed as a linear's
    weight; an experts module that says `is_transposed`, e.g. gpt-oss's [E, in, out] as a
    checkpoint without `stored_transposed` holds them, runs x @ w[e] on the reference path
    instead, which reads the canonical layout as fast). The planner places the transposed
    experts it makes itself (`Decision.transposed`)."""
    names = tuple(names)
    if reads_only_by_linear(model, names):
        return True
    first = names[0]
    module = model.get_submodule(_parent(first)[0])
    return is_fused_experts(module, model.get_parameter(first)) and not getattr(module, "is_transposed", False)


def _config_for(recipe, fqn, module_fqn, module, pname, param, filter_fn, embeddings):
    """Step 4 of the precedence for one parameter."""
    experts = is_fused_experts(module, param)
    if isinstance(recipe, FqnToConfig):
        hit, cfg = recipe.resolve(fqn, module_fqn, module, pname, experts=experts)
        if not hit and pname == "weight" and module_fqn in embeddings:
            cfg = recipe.mapping.get("_default")
        if filter_fn is not None and not filter_fn(module, module_fqn):
            return None
        return cfg
    if not experts and (pname != "weight" or param.ndim != 2):
        return None
    if filter_fn is not None:
        wanted = filter_fn(module, module_fqn)
    else:
        wanted = experts or isinstance(module, nn.Linear) or module_fqn in embeddings
    return recipe if wanted else None


def plan(
    model: nn.Module,
    recipe: AOQBaseConfig | FqnToConfig,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    skip: Predicate | None = None,
    default_skip: Predicate | None = None,
    embeddings: Iterable[str] = (),
    ties: Mapping[str, str] | None = None,
) -> dict[str, Decision]:
    """{parameter name: Decision} for every tensor of `model` that `recipe` quantizes, by the
    precedence in this module's docstring. `embeddings` names the embedding modules a recipe
    may reach (the quantizer's include_embeddings); `ties` as in `tie_groups`. Warns about
    exact FqnToConfig keys that name nothing; raises AOQError for tied names that disagree."""
    if not isinstance(recipe, (AOQBaseConfig, FqnToConfig)):
        raise AOQError(f"expected a quantization config or FqnToConfig, got {type(recipe).__name__}")
    embeddings = set(embeddings)
    exact = recipe.exact_keys() if isinstance(recipe, FqnToConfig) else set()
    seen: set[str] = set()
    chosen: dict[str, AOQBaseConfig | None] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    frozen: set[str] = set()  # already quantized
    # With declared ties, a module reached under two names is planned under its first (as
    # transformers names it); otherwise every name of a shared tensor is seen.
    for module_fqn, module in model.named_modules(remove_duplicate=ties is not None):
        for pname, param in module.named_parameters(recurse=False, remove_duplicate=False):
            fqn = f"{module_fqn}.{pname}" if module_fqn else pname
            named = fqn in exact or (pname == "weight" and module_fqn in exact)
            if named:
                seen.update({fqn, module_fqn} & exact)
            shapes[fqn] = tuple(param.shape)
            if isinstance(param, AOQTensor):
                frozen.add(fqn)
                cfg = None
            elif skip is not None and skip(module_fqn, fqn):
                cfg = None  # the caller's skips win over everything
            elif not named and default_skip is not None and default_skip(module_fqn, fqn):
                cfg = None  # default skips give way to an exact name only
            else:
                cfg = _config_for(recipe, fqn, module_fqn, module, pname, param, filter_fn, embeddings)
            chosen[fqn] = cfg

    unused = exact - seen
    if unused:
        warnings.warn(f"FqnToConfig names that match no parameter or module: {sorted(unused)}", stacklevel=3)

    groups = tie_groups(model, ties)
    decisions: dict[str, Decision] = {}
    done: set[str] = set()
    for fqn, cfg in chosen.items():
        if fqn in done:
            continue
        names = tuple(n for n in groups.get(fqn, (fqn,)) if n in chosen)
        done.update(names)
        source = names[0]
        for other in names[1:]:
            if chosen[other] != chosen[source]:
                raise AOQError(
                    f"{other} is tied to {source} (one tensor, shared with another module), but they resolve to "
                    f"different configs ({chosen[other]} and {chosen[source]}); give both the same config or leave "
                    f"both as they are, or give them separate weights first (when loading with transformers: "
                    f"AOQConfig(untie_embedding_weights=True))"
                )
        if chosen[source] is None or frozen & set(names):
            continue
        module_name, pname = _parent(source)
        transposed = len(shapes[source]) == 3 and stored_in_by_out(model.get_submodule(module_name), pname)
        decisions[source] = Decision(
            chosen[source], shapes[source], transposed or placed_for_kernels(model, names), tuple(names[1:]),
            transposed,
        )
    return decisions


def quantize_(
    model: nn.Module,
    config: AOQBaseConfig | FqnToConfig,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Replace weights of `model` with quantized tensors, in place; returns `model`.

    A single config applies to the 2-D `weight` of every module for which
    `filter_fn(module, fqn)` is true (default: every nn.Linear), and to fused MoE experts. An FqnToConfig decides per parameter (see
    hf_aoq.configs); `filter_fn`, when given, further restricts which modules it touches.
    A tensor shared by several modules (tied weights) is quantized once and stays shared; if
    its names resolve to different configs (one of them None included), it is an AOQError.
    """
    if not isinstance(config, (AOQBaseConfig, FqnToConfig)):
        raise AOQError(f"quantize_ needs a quantization config or FqnToConfig, got {type(config).__name__}")
    return carry_out(model, plan(model, config, filter_fn=filter_fn))


COMPILED_STEP = "_hf_aoq_compiled_step"  # where workflows.generation.compiled_step keeps a model's step


def carry_out(model: nn.Module, decisions: Mapping[str, Decision]) -> nn.Module:
    """Quantize each tensor of `decisions` (from `plan`) with its config, in place; the nn.Linear
    modules left with bf16 weights (the lm_head, skipped layers) then run hf_aoq's GEMV at few rows
    on CPU (dense_linear.route_dense_linears: their class, not their state, changes), and a
    transformers model's "sdpa" attention hf_aoq's kernel at one query token on CPU
    (decode_attention.route_decode_attention: only the config's runtime choice changes). A compiled
    step the model holds is dropped: workflows.generation.compiled_step's would run the old model."""
    for attribute in ("_compiled_call", COMPILED_STEP):  # transformers' and compiled_step's
        model.__dict__.pop(attribute, None)
    for name, decision in decisions.items():
        weight = model.get_parameter(name).detach()
        q = decision.config.quantize_weight(transposed_weight(weight) if decision.transposed else weight, name=name)
        set_quantized(model, name, decision, q)
    route_dense_linears(model)
    route_decode_attention(model)
    return model


def transposed_weight(weight):
    """The [E, out, in] matrix a `Decision.transposed` parameter [E, in, out] is quantized as."""
    return weight.transpose(-2, -1).contiguous()


def set_quantized(model: nn.Module, name: str, decision: Decision, q: AOQTensor) -> None:
    """Put `q`, the quantized value of the planned tensor `name`, under every name of that tensor
    (one parameter, so ties stay tied), placed for F.linear's kernels when linears alone read it;
    a `Decision.transposed` one ([E, out, in]) as its transposed view, the module's layout."""
    q = q.place() if decision.place else q
    new_param = nn.Parameter(TransposedExperts(q) if decision.transposed else q, requires_grad=False)
    for n in (name, *decision.tied):
        module_name, leaf = _parent(n)
        setattr(model.get_submodule(module_name), leaf, new_param)
