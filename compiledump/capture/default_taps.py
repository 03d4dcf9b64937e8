"""The default taps `instrument(model)` attaches to a decoder-only causal LM: per layer the
residual stream after attention, the router and its ids, the MLP block's and the layer's output
(and the layer's state at each forward's last position); the final norm, the logits, the fed
token and the request row's attention mask. Where a Hugging Face (or vLLM/SGLang) model keeps
each module is capture/hf_layout.py's; what is recorded of a router is capture/router_taps.py's,
of an MoE block's shared expert capture/shared_experts.py's."""

from __future__ import annotations

import warnings

import torch

from ..format import spec
from . import api, hf_configs, hf_ends as ends, hf_layout as layout, indexers, mixers, residual, router_taps, routers
from . import shared_experts
from .state import STATE, warn_once


def add_default_taps(handle, layers_path: str, layers, modules: dict, encoder: str | None) -> None:
    """Attach the default tags (`instrument`'s docstring lists them) to the decoder layers at
    `layers_path` of `handle`'s model (`modules`: its named modules; `encoder`: the path of an
    encoder-decoder's encoder, else None), and warn once per default tag some layers cannot get."""
    unrouted = []  # MoE blocks whose router has none of the ROUTERS names
    no_attn = []  # layers where no module's input is the residual stream after attention
    untapped_moe = []  # layers whose MoE block goes by a name no convention here reads (torchtitan's `moe`)
    moe_outputs = []  # layers whose `layer<i>_mlp` is an MoE block's output
    ran = layout.real_layers(layers)  # a pipeline stage's share; each keeps its index in the whole model
    moe_layers = [i for i, layer in ran if _routes(layer)]
    moe_model = bool(moe_layers)
    kinds = mixers.kinds_of(layers, [None if ends.placeholder(layer) else layout.mixer_for_kind(layer)
                                     for layer in layers])
    handle._first_layer = f"{layers_path}.{ran[0][0]}"
    for i, layer in ran:
        prefix = f"{layers_path}.{i}"
        handle._track_shape(prefix, layer)
        block_name = _block_name(layer)
        mixer_name = layout.part(layer, layout.MIXERS)
        mixer = layer.get_submodule(mixer_name) if mixer_name else None
        heads = getattr(mixer, "experts", None)
        if isinstance(heads, torch.nn.Module) and layout.child(heads, ("router",)) is not None:
            # JetMoE's mixture of attention heads: its router picks each token's heads, so its
            # flips are judged as the MLP's are (layer<i>_attn_router, layer<i>_attn_topk).
            router_taps.tap_router(handle, f"layer{i}_attn", f"{prefix}.{mixer_name}.experts", heads, "router")
        if (indexer_name := layout.indexer_of(mixer) if mixer is not None else None) is not None \
                and not handle.excludes(f"layer{i}_index_router"):
            # A sparse-attention indexer picks each token's keys: judged as the MLP's experts are
            indexer = mixer.get_submodule(indexer_name)
            indexers.tap_indexer(handle, f"layer{i}_index", f"{prefix}.{mixer_name}.{indexer_name}", indexer,
                                 router_taps.router_capture(handle, f"layer{i}_index", mixer, indexer))
            routers.withdraw(f"layer{i}_index_router")  # the plain top-k of its scores
        split = residual.defers_residual(layer)  # vLLM, SGLang: the stream in two parts (residual.py)
        attn_input = layout.residual_after_attention(layer, block_name, cross=encoder is not None)
        if attn_input is not None:
            # Every layer's, whatever COMPILEDUMP_MOE_LAYERS says: attention is no MoE internal
            handle._add_stream(layer.get_submodule(attn_input), f"layer{i}_attn", f"{prefix}.{attn_input}", "input",
                               read=residual.norm_stream if split else None)
        elif block_name not in (None, mixer_name):
            # (not a layer of one mixer, Mamba's or Nemotron-H's MoE `mixer`: `layer<i>` is the stream after it)
            no_attn.append(prefix)
        beside_mlp = block_name is not None
        alone = block_name is None and attn_input is None  # a layer of one mixer (Mamba's)
        if mixer is not None and mixer_name != block_name and (alone or beside_mlp and kinds[i] == mixers.ATTENTION):
            # The token mixer's own output, as the MLP's: a bug there shows undiluted by the residual
            # stream, which `layer<i>_attn` holds (a 5 % attention bug read 0.4-0.96 of the bf16
            # thresholds there, 1.4-1.8 here). Of a layer with an MLP, softmax attention's only (a
            # linear-attention mixer's own bf16 rounding exceeds the defaults: honest Qwen3-Next
            # pairs exited 1 there), and in an MoE model only where COMPILEDUMP_MOE_LAYERS keeps the
            # routing: attention mixes in every token, and a near-tie flip of another token's
            # unrecorded routing moved it past the thresholds (honest PhiMoE pairs exited 1).
            own_name = _own_output(mixer, mixer_name, beside_mlp)
            own, own_path = layer.get_submodule(own_name) if own_name else None, f"{prefix}.{own_name}"
            if own is not None:  # (what it returns, or writes into an `output` argument)
                handle._add_stream(own, f"layer{i}_mixer", own_path, moe_filtered=beside_mlp and moe_model)
        if block_name is None and (unread := layout.child(layer, layout.UNREAD_MOE_BLOCKS)) is not None:
            untapped_moe.append(f"{prefix}.{unread}")
        if block_name is not None:
            block = layer.get_submodule(block_name)
            router_name = layout.child(block, layout.ROUTERS)
            if router_name is not None:
                router_taps.tap_router(handle, f"layer{i}", f"{prefix}.{block_name}", block, router_name)
            elif layout.routes_tokens(block):
                unrouted.append((f"{prefix}.{block_name}", block))
            # A dense MLP's output at every layer; an MoE block's only where its routing is kept
            # (COMPILEDUMP_MOE_LAYERS): a flip the filter hid would read as the block's divergence.
            routed = _block_routes(block)  # (Gemma 4's mlp beside experts: dense)
            mlp, mlp_path = block, f"{prefix}.{block_name}"
            last = None if routed or not residual.defers_residual(block) else layout.last_projection(block)
            if last is not None:
                # Bloom's and MPT's MLP adds the residual stream itself: the MLP's own output is
                # its last projection's (the block's would be the layer's, an MLP bug diluted)
                mlp, mlp_path = getattr(block, last), f"{mlp_path}.{last}"
            # (and its row at each step: a decode-only bug there is named undiluted by the stream)
            handle._add_stream(mlp, f"layer{i}_mlp", mlp_path, moe_filtered=routed)
            if routed and f"layer{i}_mlp" in handle.taps:
                moe_outputs.append(i)
            if (shared := layout.child(layer, layout.SHARED_MLPS)) not in (None, block_name):
                # Granite's dense MLP beside its MoE block, the two outputs summed: its own tag, or a
                # bug there would be missed (the block's output holds none of it)
                handle._add_stream(layer.get_submodule(shared), f"layer{i}_shared_mlp", f"{prefix}.{shared}")
            elif routed:  # its shared expert, undiluted by the routed experts' output (one tag a layer)
                shared_experts.tap_shared_expert(handle, i, mlp_path, block)
        if layout.holds_experts(layer) and (router_name := layout.child(layer, layout.ROUTERS)) is not None:
            router_taps.tap_router(handle, f"layer{i}", prefix, layer, router_name)  # Gemma 4: router and experts beside a dense mlp
        handle._add_stream(layer, f"layer{i}", prefix,
                           read=residual.altup_active(layer) or (residual.layer_stream if split else None))
    if hf_configs.has_tower(handle.model) and encoder is None and not ends.placeholder(layers[0]):
        # A vision-language (or audio) model merges the tower's features into the first layer's
        # input, the image rows, which the layers' one-row tags never see: every prompt row of it.
        # (An encoder-decoder's, Florence-2's, enter its encoder: encoder_output is recorded instead.)
        handle._add(layers[0], spec.INPUT_EMBEDS_TAG, f"{layers_path}.0", "input", capture=embeds_capture(handle),
                    read=residual.hidden_states_reader(layers[0]))
    if encoder is not None:
        # The encoder runs once per request, before the decoder's layers: what its output holds
        # decides every decoder step, and an encoder bug would read as the decoder's first layer
        handle._add(modules[encoder], spec.ENCODER_OUTPUT_TAG, encoder, "output", capture=once_capture(handle))
    _warn_untapped(layers_path, ran[0][1], unrouted, no_attn)
    _warn_moe_filtered(moe_layers, ran[0][0])
    if untapped_moe:
        warnings.warn(f"compiledump.instrument: {len(untapped_moe)} MoE block(s) ({', '.join(untapped_moe[:3])}"
                      f"{', ...' if len(untapped_moe) > 3 else ''}) follow no router convention compiledump reads "
                      "(torchtitan's: its router returns top scores and ids, not logits): no layer<i>_mlp, _router or "
                      f"_topk there. Add the block's output with taps={{'layer{{i}}_mlp': '{layers_path}.{{i}}.moe'}} "
                      "(and its expert ids, an integer output, under a tag of their own)", RuntimeWarning, stacklevel=4)
    mixers.declare_mixers({i: kinds[i] for i, _ in ran}, mixers.routing_fact(handle.taps, bool(unrouted),
                                                                              handle.step_routing, moe_outputs))
    if (norm_path := ends.final_norm_path(layers_path, modules)) is not None:
        handle._add(modules[norm_path], "final_norm", norm_path, "output")
    if (embed_path := ends.token_embedding_path(layers_path, modules)) is not None:
        handle._add(modules[embed_path], "input_token", embed_path, "input", capture=fed_capture(handle))
    if (base_path := ends.base_model_path(layers_path, modules)) in modules:  # "" is the model itself
        def prompt_mask(mask_and_tokens) -> None:
            # The request row of a padded batch's 2-D attention mask (generate pads on the left):
            # the comparator compares the prompt's real positions only (compare/padding.py). Only
            # a mask of the call's own positions, [batch, seq]: one that also covers cached
            # context is wider than the call, and the token gate must not learn its width.
            mask, tokens = mask_and_tokens
            if isinstance(mask, torch.Tensor) and isinstance(tokens, torch.Tensor) and mask.dim() == 2 \
                    and tokens.dim() >= 2 and mask.shape == tokens.shape[:2] and not mask.is_floating_point():
                api.record_ids(spec.PROMPT_MASK_TAG, mask[handle.batch_row].to(torch.int32))
        handle._add(modules[base_path], spec.PROMPT_MASK_TAG, base_path, "input", capture=prompt_mask,
                    read=_mask_and_tokens)
        if spec.PROMPT_MASK_TAG in handle.taps:
            handle.taps[spec.PROMPT_MASK_TAG] = f"{base_path}:attention_mask"
    if (head_path := ends.logits_path(modules, layers_path)) is not None:
        handle._add(modules[head_path], "logits", head_path, "output", capture=logits_capture(handle))


def _warn_moe_filtered(moe_layers: list[int], first_layer: int) -> None:
    """Warn when COMPILEDUMP_MOE_LAYERS, which keeps the MoE internals of layers below it, keeps
    none of this model's MoE layers (DeepSeek-V3's and GLM-4.5's first three layers are dense):
    nothing of its routing would be recorded, silently. Not on a pipeline stage that does not
    hold the model's first layer (another stage's filter keeps them), nor with the setting 0."""
    limit = STATE.config.moe_layers
    if moe_layers and first_layer == 0 and 0 < limit <= moe_layers[0]:
        keep = moe_layers[0] + limit
        warnings.warn(f"compiledump.instrument: the model's first MoE layer is layer {moe_layers[0]}, at or past "
                      f"COMPILEDUMP_MOE_LAYERS={limit} (MoE internals are kept for layers below it): no router "
                      "logits, expert ids, MoE block or shared-expert outputs are recorded, and the comparator "
                      f"cannot tell a routing flip from a bug. Set COMPILEDUMP_MOE_LAYERS={keep} (or "
                      f"compiledump.configure(moe_layers={keep})) to keep its first {limit} MoE layers",
                      RuntimeWarning, stacklevel=4)


def _block_name(layer) -> str | None:
    """The path, relative to `layer`, of its MLP block (hf_layout.mlp_block), or Nemotron-H's
    `mixer`, one block per layer, an MoE one in its MoE layers."""
    name = layout.mlp_block(layer)
    return "mixer" if name is None and layout.holds_experts(getattr(layer, "mixer", None)) else name


def _block_routes(block) -> bool:
    """Whether an MLP block routes tokens to experts: it has a router, or holds experts."""
    return layout.child(block, layout.ROUTERS) is not None or layout.routes_tokens(block)


def _routes(layer) -> bool:
    """Whether `layer` routes tokens to experts: its MLP block does, or it holds experts beside a
    dense `mlp` (Gemma 4)."""
    name = _block_name(layer)
    return layout.holds_experts(layer) or (name is not None and _block_routes(layer.get_submodule(name)))


def _own_output(mixer, name: str, beside_mlp: bool) -> str | None:
    """The path, relative to the layer, of the module whose output is the token mixer `name`'s own,
    before the residual add: of Zamba's hybrid layers, whose `mamba_decoder` returns the stream
    itself, its `mamba`; beside an MLP, attention's (`_attention_output`); else the mixer."""
    if name == "mamba_decoder":
        return f"{name}.mamba" if layout.child(mixer, ("mamba",)) else None
    return _attention_output(mixer, name) if beside_mlp else name


def _attention_output(mixer, name: str) -> str | None:
    """The path, relative to the layer, of the module whose output is attention's own, before the
    residual add: `name` (the mixer), or inside a mixer that adds the residual itself."""
    if layout.child(mixer, ("self",)) is not None and isinstance(getattr(getattr(mixer, "output", None), "dense", None),
                                                               torch.nn.Module):
        return f"{name}.output.dense"  # BERT's family: its `output` adds the residual and normalises
    if name.endswith("norm_attn_norm") and layout.child(mixer, ("attn",)) is not None:
        return f"{name}.attn"  # DBRX's norms around attention: it returns the residual first
    if layout.child(mixer, ("attention",)) is not None and layout.child(mixer, ("layer_norm",)) is not None:
        return f"{name}.attention"  # Pix2Struct's sublayer: norm, attention, residual add
    if residual.defers_residual(mixer):  # Bloom's: takes the residual and adds it after its projection
        last = layout.last_projection(mixer)
        return f"{name}.{last}" if last is not None else None
    return name


# The model-level tags a verdict needs, where they were looked for and what is lost without each. (A
# missing final norm is not warned: post-norm decoders have none, and its bug shows in the logits.)
_UNFOUND = {
    "logits": ("no head for the logits (lm_head, embed_out, get_output_embeddings()): a bug after the last "
               "layer reads as no divergence, and decode steps are judged by the layers' states alone"),
    "input_token": (f"no token embedding beside the layers ({', '.join(ends.TOKEN_EMBEDDINGS)}): a step the two "
                    "sides fed different tokens (after an argmax flip) reads as a divergence"),
}


def warn_unfound(handle, layers_path: str, modules: dict) -> None:
    """One warning naming the model-level default tags (logits, fed token) that neither the defaults
    nor an explicit tap attached, what is lost without each, and the taps that would (not where a
    pipeline stage holds a placeholder for that module: another stage records it)."""
    elsewhere = ends.held_elsewhere(layers_path, modules)
    unfound = [tag for tag in _UNFOUND if tag not in handle.taps and not handle.excludes(tag) and tag not in elsewhere]
    if unfound:
        said = "; ".join(f"`{tag}`: {_UNFOUND[tag]}" for tag in unfound)
        example = ", ".join(f"'{tag}': '<{tag} module>{':input' if tag == 'input_token' else ''}'" for tag in unfound)
        warnings.warn(f"compiledump.instrument: not recorded beside the layers at {layers_path}: {said}. Tap "
                      f"them by name: taps={{{example}}}", RuntimeWarning, stacklevel=4)


def embeds_capture(handle):
    """The `input_embeds` capture: every prompt row of the first layer's input hidden states (its
    region at most an eighth of the arena, decided when the kernel runs: over it, the capture is
    counted as arena_full and the flush warns, with no shape tested while tracing)."""
    def embeds(value) -> None:
        tensor = value[0] if isinstance(value, (tuple, list)) else value
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            handle.fired = True
            api.record(spec.INPUT_EMBEDS_TAG, handle._rows(tensor), rows="all")
    return embeds


def once_capture(handle, tag: str = spec.ENCODER_OUTPUT_TAG):
    """The capture of a module inside an encoder-decoder's encoder (`encoder_output`: the encoder
    itself): the request's first source row of its floating-point output (a `last_hidden_state`, or
    the first of a tuple), the first call's. The first row: a batch pads its sources on the right,
    so it is a real token of every row (the encoder attends both ways: it sees the whole source).
    Once: not token-gated, so the source's length teaches the gate nothing (as a plain record
    would: the encoder runs before the decoder's prompt)."""
    def once(output) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None and isinstance(output, (tuple, list)) and output:
            hidden = output[0]
        if hidden is None:
            hidden = output
        if not isinstance(hidden, torch.Tensor):
            return
        if not hidden.is_floating_point():
            if not torch.compiler.is_compiling():
                warn_once(f"instrument: tap {tag!r} inside an encoder-decoder's encoder holds integers: not "
                          "recorded (recorded as ids, the source's length would be taken for the prompt's by the "
                          "token gate); record them yourself with compiledump.record(tag, ids.float(), once=True)")
            return
        handle.fired = True
        rows = handle._rows(hidden)
        api.record(tag, rows[:1] if rows.dim() >= 2 else rows, once=True)
    return once


def fed_capture(handle):
    """The `input_token` capture of a token embedding's input ids."""
    def fed(input_ids) -> None:
        # The token each forward feeds at the position whose logits `logits_<n>` hold: the
        # comparator sees where greedy decoding fed the two sides different tokens (after an
        # argmax flip), from which on their steps cannot be compared.
        if residual.batched_ids(input_ids):
            api.record_step("input_token", input_ids[handle.batch_row, -1:])
    return fed


def logits_capture(handle):
    """The `logits` capture of a head's output: each forward's as a step."""
    def logits(output) -> None:
        output = getattr(output, "next_token_logits", output)  # SGLang's LogitsProcessorOutput
        if not isinstance(output, torch.Tensor):  # vLLM's on a pipeline stage without logits
            return
        handle.fired = True
        # [batch, seq, vocab]: the request's last position; flat [tokens, vocab] (vLLM-style):
        # the row set_gather_rows(step=...) names.
        api.record_step("logits", output[handle.batch_row, -1] if output.dim() == 3 else output)
    return logits


def add_named_as_default(handle, tag_pattern: str, tag: str, path: str, module, side: str) -> bool:
    """Attach an explicit tap named as a default tag the defaults did not attach (`taps={"layer{i}":
    "transformer.blocks.{i}", "logits": "lm_head", "input_token": "...:input"}`) as that tag is:
    each forward's step recorded (a decoder layer's state at each step, the logits, the fed token),
    so that decode steps are judged. False for any other tap, which the caller attaches plainly."""
    if tag in handle.taps or handle.excludes(tag):
        return False
    if tag_pattern == "layer{i}" and side == "output":
        handle._first_layer = handle._first_layer or path  # where a forward starts (a looped layer's warning)
        handle._track_shape(path, module)  # the request's last position, for the step
        handle._add_stream(module, tag, path)
        return True
    capture = (logits_capture(handle) if (tag, side) == ("logits", "output")
               else fed_capture(handle) if (tag, side) == ("input_token", "input") else None)
    if capture is not None:
        handle._add(module, tag, path, side, capture=capture)
    return capture is not None


def _mask_and_tokens(args, kwargs) -> tuple:
    """A base model's `attention_mask` and the ids (or embeddings) of its call's positions."""
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds", args[0] if args else None)
    return kwargs.get("attention_mask"), tokens


def _warn_untapped(layers_path: str, first, unrouted: list, no_attn: list[str]) -> None:
    """One warning per default tag that some layers could not get, naming them and the fix."""
    def named(paths: list[str]) -> str:
        return ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")

    if unrouted:
        # Without ids, a routing flip would show only as a divergent MLP output, with no root cause.
        candidates = sorted({name for _, block in unrouted for name in layout.router_like_children(block)})
        hint = f" (a router under another name: {', '.join(candidates)}?)" if candidates else ""
        warnings.warn(f"compiledump.instrument: {len(unrouted)} MoE block(s) ({named([p for p, _ in unrouted])}) "
                      f"route tokens to experts but have no router submodule named {' or '.join(layout.ROUTERS)}"
                      f"{hint}: no layer<i>_router/_topk tags, so a routing flip shows only as a divergent "
                      f"layer<i>_mlp. Add them with taps={{'layer{{i}}_router': '{layers_path}.{{i}}.<block>.<router>'}} "
                      "(integer outputs are recorded as ids).", RuntimeWarning, stacklevel=5)
    if no_attn:
        kind = type(first).__name__
        warnings.warn(f"compiledump.instrument: {len(no_attn)} decoder layer(s) ({named(no_attn)}, {kind}) have no "
                      "module whose input is the residual stream after attention (its norms under other names, attention "
                      "and MLP in parallel, or the norm kept in a ModuleList): no layer<i>_attn tags, so a divergence "
                      "in attention shows first at layer<i>_mlp or layer<i>. Add one with "
                      f"taps={{'layer{{i}}_attn': '{layers_path}.{{i}}.<module>:input'}} where such a module exists.",
                      RuntimeWarning, stacklevel=5)


__all__ = ["add_default_taps"]
