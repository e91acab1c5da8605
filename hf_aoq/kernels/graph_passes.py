"""A rewrite of torch.compile's graphs for hf_aoq's compiled step: the quantized linears that read
one input (a layer's q, k and v projections; gate and up) become one call of the kernel for
several weights.

At batch 1 a small layer's GEMV is a few microseconds of fixed cost (the op's dispatch, the input's
conversion, a parallel region the threads meet in) beside its weight's read: a [256, 2048] int4
k_proj takes 12 us where its bytes alone would take 8. One call for q, k and v converts the input
once and gives the threads all their rows in one region; each output is the same, bit for bit, as
the call for its weight alone gives (the multi-weight kernels' tests check it). The rewrite runs on
Inductor's post-grad graph (`post_grad_custom_post_pass`), which `workflows.generation.compiled_step`
passes to torch.compile; eager calls are unchanged.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import cpu


@dataclass(frozen=True)
class Fusible:
    """`single(x, *weight_args, *shared_args, bias)` calls with one x, equal shared arguments and
    no bias become `multi(x, [weight_arg] per weight..., *shared_args)`, which returns a list."""
    single: Any  # OpOverload
    multi: Any
    weight_args: tuple[int, ...]  # positions in single's args of each weight's tensors
    shared_args: tuple[int, ...]  # positions of the arguments all calls must share (passed once)
    bias_arg: int  # position of the bias, which must be None


FUSIBLE = (
    Fusible(cpu.int4_linear_io.op, cpu.int4_linear_io_multi.op, weight_args=(1, 2), shared_args=(3, 4), bias_arg=5),
)
_BY_SINGLE = {f.single: f for f in FUSIBLE}


def fuse_shared_input_linears(graph: torch.fx.Graph) -> int:
    """Rewrites `graph` in place; returns how many calls were replaced."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        spec = _BY_SINGLE.get(node.target) if node.op == "call_function" else None
        if spec is None or node.kwargs or len(node.args) <= spec.bias_arg or node.args[spec.bias_arg] is not None:
            continue
        shared = tuple(node.args[i] for i in spec.shared_args)
        if any(isinstance(a, torch.fx.Node) for a in shared):  # only constants compare as equal here
            continue
        groups[(spec, node.args[0], shared)].append(node)
    replaced = 0
    for (spec, x, shared), nodes in groups.items():
        if len(nodes) < 2:
            continue
        first = nodes[0]
        # Every weight tensor must exist where the fused call goes (they are graph inputs).
        weight_nodes = [n.args[i] for n in nodes for i in spec.weight_args]
        if any(isinstance(a, torch.fx.Node) and order[a] > order[first] for a in weight_nodes):
            continue
        with graph.inserting_before(first):
            lists = [[n.args[i] for n in nodes] for i in spec.weight_args]
            multi = graph.call_function(spec.multi, (x, *lists, *shared))
            multi.meta["val"] = [n.meta.get("val") for n in nodes]
            for j, node in enumerate(nodes):
                item = graph.call_function(operator.getitem, (multi, j))
                item.meta.update(node.meta)
                node.replace_all_uses_with(item)
        for node in nodes:
            graph.erase_node(node)
        replaced += len(nodes)
    return replaced


class SharedInputLinears(CustomGraphPass):
    """`fuse_shared_input_linears` as Inductor's post-grad pass, then `then` (a pass the user had
    configured there) if any. Its uuid keys Inductor's cache of compiled graphs."""

    def __init__(self, then: Optional[CustomGraphPass] = None):
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_shared_input_linears(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> Any:
        mine = get_hash_for_files((__file__,))
        if self.then is None:
            return mine
        theirs = self.then.uuid() if hasattr(self.then, "uuid") else None
        return None if theirs is None else (mine, theirs)  # None: not cacheable


def compile_options() -> dict:
    """Inductor options that put the rewrite into a torch.compile call, after any post-grad pass
    already configured."""
    from torch._inductor import config

    return {"post_grad_custom_post_pass": SharedInputLinears(config.post_grad_custom_post_pass)}
