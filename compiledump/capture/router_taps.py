"""The hooks on a model's routers: what a router's output holds, and what `instrument` records of it.

`<name>_router` (the router logits of every prompt row by default), `<name>_topk` (the expert
ids), and each forward's step row of both (`<name>_step_router`, `<name>_step_topk`), for the
conventions of Hugging Face routers, vLLM's and SGLang's gates and SGLang's TopK module; the
router's selection rule declared for the comparator (capture/hf_routers.py). `handle` is
instrument's `Instrumented`, whose row readers and tap list these share (as capture/indexers.py
does).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from . import api, residual, routers
from .hf_routers import EXPERTS_PICKED_ROUTERS, ONE_HOT_ROUTERS, PROBABILITY_ROUTERS, int_attr, selection_of
from .state import warn_once


def tap_router(handle, name: str, block_path: str, block: torch.nn.Module, router_name: str) -> None:
    """The router tags `<name>_router`, `<name>_topk` (and steps) on `block`'s child `router_name`,
    and its selection declared (or any earlier declaration of the tag withdrawn: another model's)."""
    if handle.excludes(f"{name}_router"):  # its picks and steps go with it
        routers.withdraw(f"{name}_router")
        return
    router = getattr(block, router_name)
    picked = experts_picking(block, router)
    handle._add(router, f"{name}_router", f"{block_path}.{router_name}", "output",
                capture=router_capture(handle, name, block, router, ids_from_experts=picked is not None))
    selection = selection_of(block, router)
    if selection is not None:
        routers.declare_router(f"{name}_router", **selection)
    else:
        routers.withdraw(f"{name}_router")
    handle._list_routing(name, f"{block_path}.{router_name}")
    if picked is not None:
        # DBRX: the ids its block picked, as its experts receive them (`top_k_index`), listed there
        # (and not at all where `exclude` leaves them out)
        for tag in (f"{name}_topk", f"{name}_step_topk"):
            handle.taps.pop(tag, None)
        handle._add(picked, f"{name}_topk", f"{block_path}.experts", "input", capture=ids_capture(handle, name),
                    read=_top_k_index)
        if handle.step_routing and f"{name}_topk" in handle.taps:
            handle.taps[f"{name}_step_topk"] = handle.taps[f"{name}_topk"]
    if isinstance(picker := getattr(block, "topk", None), torch.nn.Module):
        # SGLang's TopK module picks the experts from its gate's logits: its topk_ids are the engine's own
        handle._add(picker, f"{name}_topk", f"{block_path}.topk", "output", read=lambda out: getattr(out, "topk_ids", None))


def experts_picking(block: torch.nn.Module, router: torch.nn.Module) -> torch.nn.Module | None:
    """`block`'s experts module where the ids are read from its `top_k_index` input (the router
    returns bare logits and the block picks from their rounded softmax: EXPERTS_PICKED_ROUTERS),
    else None."""
    experts = getattr(block, "experts", None)
    if type(router).__name__ not in EXPERTS_PICKED_ROUTERS or not isinstance(experts, torch.nn.Module):
        return None
    try:
        takes_ids = "top_k_index" in inspect.signature(experts.forward).parameters
    except (TypeError, ValueError):
        return None
    return experts if takes_ids else None


def _dispatched(mask, logits, router) -> torch.Tensor | None:
    """The expert each token is routed to, `[..., 1]`, from a one-hot dispatch mask `[..., experts]`
    (ONE_HOT_ROUTERS); where the expert's capacity dropped the token (an all-zero row), the one it
    was routed to all the same, by the router's own rule (the argmax of its float32 softmax cast to
    the dtype of its input): the comparator judges a flip by the logits, and reads a drop from a
    flip's reach (capacity, format/routers.py)."""
    if not isinstance(mask, torch.Tensor) or mask.is_floating_point() or not residual.is_float(logits):
        return None
    dtype = getattr(router, "input_dtype", logits.dtype)
    chosen = torch.softmax(logits.float(), dim=-1).to(dtype).argmax(dim=-1)
    return torch.where(mask.any(dim=-1), mask.argmax(dim=-1), chosen).unsqueeze(-1)


def _top_k_index(args: tuple, kwargs: dict):
    """The expert ids an experts module is called with: `(hidden_states, top_k_index, top_k_weights)`."""
    return args[1] if len(args) > 1 else kwargs.get("top_k_index")


def ids_capture(handle, name: str) -> Callable:
    """The capture of a block's expert ids, `<name>_topk` and its step row."""
    def capture(ids, whole: bool = True) -> None:
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
            rows = handle._rows(ids)
            if whole:
                api.record_ids(f"{name}_topk", rows)
            if handle.step_routing:
                api.record_step(f"{name}_step_topk", handle._step_row(rows), moe_filtered=True)
    return capture


def router_capture(handle, name: str, block: torch.nn.Module, router: torch.nn.Module,
                   ids_from_experts: bool = False) -> Callable:
    """The capture of a router whose tags are `<name>_router`, `<name>_topk` and their steps (the
    ids read elsewhere, `ids_from_experts`: the router's logits and their step row only)."""
    top_k = int_attr((block, router), ("top_k", "num_experts_per_tok"))
    record_ids = ids_capture(handle, name)
    one_hot, probabilities = (type(router).__name__ in rule for rule in (ONE_HOT_ROUTERS, PROBABILITY_ROUTERS))

    def capture(output, step_logits: torch.Tensor | None = None, whole: bool = True) -> None:
        # `step_logits`: the step row to record instead of the last row of the logits (an
        # indexer's, padded to one width for every step: capture/indexers.py); `whole` False:
        # the step tags only (an indexer's prompt rows too large for the arena).
        # Hugging Face 5.x routers return (logits, scores, top-k ids, ...); Llama 4's (scores,
        # logits); JetMoE's (sorted expert ids, ..., logits); older ones bare logits; vLLM's and
        # SGLang's gates (linear layers) return (logits, None), the None their unused output
        # bias. The checks below are on types and dtypes only, so dynamo resolves them while
        # tracing (no graph break).
        engine_gate = isinstance(output, (tuple, list)) and len(output) == 2 and output[1] is None
        if one_hot and isinstance(output, (tuple, list)) and len(output) == 3:
            logits, ids = output[2], _dispatched(output[0], output[2], router)
        elif isinstance(output, (tuple, list)) and len(output) >= 3 and not residual.is_float(output[0]) \
                and residual.is_float(output[-1]):
            logits, ids = output[-1], None  # JetMoE: its ids are sorted for dispatch, not per token
        elif isinstance(output, (tuple, list)):
            logits = output[0] if engine_gate or len(output) != 2 else output[1]
            ids = output[2] if len(output) >= 3 else None
        else:
            logits, ids = output, None
        handle.fired = True
        if probabilities and isinstance(logits, torch.Tensor):
            # softmax probabilities: their log is the logits up to a per-row constant, which no
            # top-k or logit gap sees (the floor keeps an underflowed probability finite)
            logits = torch.log(logits.float().clamp_min(1e-30))
        if not residual.is_float(logits):
            if not torch.compiler.is_compiling():  # a constant while tracing: no graph break
                handle._unlist_routing(name)
                warn_once(f"instrument: {type(router).__name__} (a router) returns no "
                          "floating-point logits where Hugging Face routers do (first, second of two, or last after ids), "
                          "so no layer<i>_router/_topk is recorded (nor listed in handle.taps); add them with taps=")
            return  # not a router of these conventions (its taps are the user's to add)
        rows = handle._rows(logits)
        # Every prompt row by default: a routing flip in any row can then be judged by its own
        # router logits (ids are recorded whole), which one row cannot do for the others.
        if whole:
            api.record(f"{name}_router", rows, rows=handle.router_rows)
        if engine_gate:
            # The engine's fused MoE picks the experts, by a rule (a bias, groups) not visible
            # here: no ids, and no step routing (a step's logits are read to judge its ids).
            return
        # Each step's routing of the token whose logits `logits_<n>` holds (the same row), so
        # that the comparator can tell a decode step's routing flip from a bug.
        if handle.step_routing:
            api.record_step(f"{name}_step_router", handle._step_row(rows) if step_logits is None else step_logits,
                            moe_filtered=True)
        if ids_from_experts:
            return
        if ids is None and top_k is not None:
            ids = torch.topk(logits, top_k, dim=-1).indices
        record_ids(ids, whole)

    return capture
