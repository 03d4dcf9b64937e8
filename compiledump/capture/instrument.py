"""`compiledump.instrument(model)`: capture points on a model's modules, without editing its code.

Forward hooks call the capture API (capture/api.py), so they behave like hand-written calls:
traced into `torch.compile(fullgraph=True)` graphs with no break or recompile, recorded into
CUDA graphs, and no-ops that add nothing to a graph while capture is off. Dynamo does not see
hooks added after it traced a module (it skips hook guards), so on a compiled module `instrument`
hooks the original module, warns, and clears dynamo's caches so that the next call re-traces it
with the hooks; the flush at exit says so when instrumented modules never ran (e.g. a function
compiled before `instrument`).

Default taps follow the names Hugging Face (and vLLM/SGLang) give a decoder-only causal LM
(capture/hf_layout.py finds the modules); a default tag some layers cannot get is warned about.
Hidden states `[batch, seq, hidden]` keep batch row `batch_row` (the request of a padded batch),
so each position is a token row; `[batch, seq, hc_mult, hidden]` (hyper-connections) likewise,
stored as the mean over hc_mult.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable

import torch

from ..format import spec
from . import api, default_taps, hf_configs, hf_ends as ends, hf_layout as layout, mixers, residual
from .state import STATE, warn_once

_PATH_SIDE = re.compile(r"^(?P<path>[^:]*)(?::(?P<side>input|output))?$")


@dataclasses.dataclass
class _Shape:
    """Batch and sequence length of the hidden states the current decoder layer received (set by
    its pre-hook, read by the router hook, whose input is already flattened)."""

    batch: int | None = None
    seq: int | None = None


class Instrumented:
    """What `instrument` attached: `taps` ({tag: "module.path[:input]"}), `fired` (a hook ran
    with capture on), and `remove()` to detach every hook."""

    def __init__(self, model: torch.nn.Module, batch_row: int, step_routing: bool = True,
                 router_rows: str | None = "all", step_states: bool = True, exclude=()):
        self.model = model
        # exclude's patterns, "{i}" standing for any layer index; each must match a tag attached
        self._exclude = {pattern: spec.tag_pattern(pattern) for pattern in exclude}
        self._left_out: set[str] = set()  # the tags they matched
        self.batch_row = batch_row
        self.step_routing = step_routing
        self.step_states = step_states
        self.router_rows = router_rows
        self.taps: dict[str, str] = {}
        self.fired = False
        self._handles: list = []
        self._shape = _Shape()
        self._ran: set[str] = set()  # the decoder layers this forward of the model ran (eager)
        self._first_layer: str | None = None  # its path: a forward starts there

    def remove(self) -> None:
        """Detach every hook (compiled code traced with them keeps them until re-traced). Router
        declarations stay: a flush after this still describes the routers captured."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self in STATE.instruments:
            STATE.instruments.remove(self)

    def excludes(self, tag: str) -> bool:
        """Whether `tag` was left out by `instrument(exclude=...)` (its hook is not attached)."""
        if any(regex.fullmatch(tag) for regex in self._exclude.values()):
            self._left_out.add(tag)
            return True
        return False

    # -- hooks -------------------------------------------------------------------------------

    def _rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[batch, seq, ...]` -> the `[seq, ...]` rows of the request; a flattened
        `[batch * seq, ...]` (router) likewise; anything else as it is. A hyper-connection
        residual `[batch, seq, hc_mult, hidden]` (DeepSeek-V4) gives `[seq, hc_mult, hidden]`,
        which `record` stores as the mean over hc_mult."""
        shape = self._shape
        if tensor.dim() == 3 or (tensor.dim() == 4 and tuple(tensor.shape[:2]) == (shape.batch, shape.seq)):
            return tensor[self.batch_row]
        # Only a tensor of batch x seq rows is the layer's tokens flattened: a tap that runs before
        # the first layer still sees the previous forward's shape
        if tensor.dim() == 2 and shape.batch is not None and tensor.shape[0] == shape.batch * shape.seq:
            return tensor.reshape(shape.batch, shape.seq, tensor.shape[-1])[self.batch_row]
        return tensor

    def _step_row(self, rows: torch.Tensor) -> torch.Tensor:
        """The row a step tag keeps of a call, as the `logits` step does: the request's last
        position when the hidden states were `[batch, seq, ...]`, else the flat tensor (the row
        `set_gather_rows(step=...)` names)."""
        return rows[-1] if self._shape.batch is not None and rows.dim() == 2 else rows

    def _capture(self, tag: str, value, moe_filtered: bool = True) -> None:
        tensor = value[0] if isinstance(value, (tuple, list)) else value
        if not isinstance(tensor, torch.Tensor):
            return
        self.fired = True
        if tensor.is_floating_point():
            rows = self._rows(tensor)
            # Still 3-D after the request's rows were taken: [seq, hc_mult, hidden] (a decode
            # step's [1, hc, hidden] too, which record would otherwise doubt).
            layout = "tokens_hc_dim" if tensor.dim() == 4 and rows.dim() == 3 else None
            (api.record if moe_filtered else api.record_unfiltered)(tag, rows, layout=layout)
        else:
            api.record_ids(tag, self._rows(tensor))

    def _stream_capture(self, tag: str, moe_filtered: bool = False) -> Callable:
        """A decoder layer's output (or the stream after its attention, `layer<i>_attn`, or a
        sublayer's own output, `layer<i>_mlp`, `layer<i>_mixer`): the prompt's rows as `tag`, and
        the row of each forward's step (the token whose logits `logits_<n>` hold) as
        `<tag>_step_<n>`, so that a decode-only bug is named at its layer and sublayer, as a
        prompt's is (an MLP's undiluted by the residual stream). `[batch, seq, hidden]` or flat
        `[tokens, hidden]` states only (not hyper-connections'); COMPILEDUMP_LAYER_STEPS of them,
        none when it is 0. `moe_filtered`: whether COMPILEDUMP_MOE_LAYERS applies (an MoE block's)."""
        def capture(value) -> None:
            self._capture(tag, value, moe_filtered)
            tensor = value[0] if isinstance(value, (tuple, list)) else value
            if self.step_states and STATE.config.layer_steps and isinstance(tensor, torch.Tensor) \
                    and tensor.is_floating_point() and tensor.dim() in (2, 3):
                api.record_step(f"{tag}_step", self._step_row(self._rows(tensor)), moe_filtered=moe_filtered)
        return capture

    def _add(self, module: torch.nn.Module, tag: str, path: str, side: str, capture: Callable | None = None,
             read: Callable | None = None, moe_filtered: bool = True):
        """Hook `module`'s output, or its first input (side "input"); or what `read` makes of them
        (side "call": `read(args, kwargs, output)`, the whole call's). `moe_filtered`: whether
        COMPILEDUMP_MOE_LAYERS applies to `tag` (api.record_unfiltered)."""
        if self.excludes(tag):
            return
        if capture is None and side == "input" and isinstance(module, torch.nn.Embedding):
            # A token embedding's input is the forward's ids, [batch, seq] (or flat [tokens]): the
            # request's row, so that a prompt's [1, seq] does not teach the token gate 1 token
            capture = lambda ids: self._capture(tag, ids[self.batch_row] if residual.batched_ids(ids) else ids)  # noqa: E731
        capture = capture or (lambda value: self._capture(tag, value, moe_filtered))
        if side == "input":
            read = read or residual.first_input

            def pre_hook(_module, args, kwargs):
                if STATE.config.active:  # off: nothing at all reaches the graph
                    capture(read(args, kwargs))
            self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        else:
            written = residual.output_argument(module)

            def hook(_module, args, kwargs, output):
                if STATE.config.active:
                    if output is None and written is not None:  # it wrote its result into `output`
                        output = written(args, kwargs)
                    capture(read(args, kwargs, output) if side == "call" else read(output) if read else output)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        self.taps[tag] = f"{path}:input" if side == "input" else path

    def _add_stream(self, module: torch.nn.Module, tag: str, path: str, side: str = "output",
                    read: Callable | None = None, moe_filtered: bool = False) -> None:
        """Hook `module`'s output (or first input) as `tag` and its step rows as `<tag>_step`
        (`_stream_capture`), unless `exclude` leaves the steps out (`layer{i}_mlp_step`)."""
        if self.excludes(f"{tag}_step"):
            self._add(module, tag, path, side, read=read, moe_filtered=moe_filtered)
            return
        self._add(module, tag, path, side, capture=self._stream_capture(tag, moe_filtered), read=read)
        if self.step_states and STATE.config.layer_steps and tag in self.taps:  # (listed where `tag` is)
            self.taps[f"{tag}_step"] = self.taps[tag]

    def _track_shape(self, path: str, layer: torch.nn.Module) -> None:
        hidden_of = residual.hidden_states_reader(layer)  # vLLM's and SGLang's layers take positions first
        if (active := residual.altup_active(layer)) is not None:  # Gemma 3n: its active AltUp stream
            hidden_of = (lambda read: lambda args, kwargs: active(read(args, kwargs)))(hidden_of)

        def pre_hook(_module, args, kwargs):
            if STATE.config.active:
                hidden = hidden_of(args, kwargs)
                # [batch, seq, hidden], or [batch, seq, hc_mult, hidden] with hyper-connections
                batched = isinstance(hidden, torch.Tensor) and hidden.dim() in (3, 4)
                self._shape.batch, self._shape.seq = (hidden.shape[0], hidden.shape[1]) if batched else (None, None)
                if not torch.compiler.is_compiling():  # eager only: a constant while tracing
                    self._count_pass(path)
        self._handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def _count_pass(self, path: str) -> None:
        """Warn once when a decoder layer runs twice in one forward of the model (a looped layer,
        as in Inkling 2 Loop): its tags keep the last pass only, and its step tags gain a step per
        pass, which would pair the wrong values with the reference's. A forward starts at the
        first layer (however the model is called), so its pass starts the count again."""
        if path == self._first_layer:
            self._ran.clear()
        if path in self._ran:
            warn_once(f"instrument: decoder layer {path} ran more than once in one forward (a looped or shared "
                      "layer): its layer<i> tags keep the last pass and its step tags count a step per pass. "
                      "Tap each pass with record()/record_step() under tags of its own, or compare with "
                      "--map to pair them")
        self._ran.add(path)

    def _list_routing(self, name: str, path: str) -> None:
        """List `<name>_router`, `<name>_topk` (and their steps) in `taps`, all at `path`."""
        for tag in self._routing_tags(name):
            self.taps[tag] = path

    def _unlist_routing(self, name: str) -> None:
        """Take them out of `taps` again: nothing of them will be recorded."""
        for tag in self._routing_tags(name):
            self.taps.pop(tag, None)

    def _routing_tags(self, name: str) -> tuple[str, ...]:
        steps = (f"{name}_step_router", f"{name}_step_topk") if self.step_routing else ()
        return (f"{name}_router", f"{name}_topk", *steps)


def instrument(model: torch.nn.Module, taps: dict[str, str] | None = None, *, defaults: bool = True,
               batch_row: int = 0, step_routing: bool = True, router_rows: str | None = "all",
               step_states: bool = True, exclude: tuple[str, ...] | list[str] = ()) -> Instrumented:
    """Attach capture points to `model`'s modules; returns a handle with `.remove()`.

    With `defaults`, a decoder-only causal LM gets, per layer i, `layer<i>_mixer` (attention's own
    output; a Mamba layer's mixer's), `layer<i>_attn` (the residual stream after attention),
    `layer<i>_router` and `layer<i>_topk` (MoE layers), `layer<i>_mlp` and `layer<i>`
    (COMPILEDUMP_MOE_LAYERS keeps an MoE layer's router, ids and `_mlp`, and an MoE model's
    `_mixer`, only below it; `_attn`, a dense layer's `_mlp` and `layer<i>` at every layer); then
    `final_norm`, and the logits of the last position as steps (`logits_<n>`: one per forward,
    prefill included), with the routing of that position in each MoE layer the MoE layer filter keeps
    (`layer<i>_step_router_<n>`, `layer<i>_step_topk_<n>`: two captures per such layer and forward,
    which `step_routing=False` leaves out; without them the comparator cannot tell a decode step's
    routing flip from a bug), and each layer's output, the stream after its attention, attention's
    own output and its MLP's output at that position (`layer<i>_step_<n>`, `layer<i>_attn_step_<n>`,
    `layer<i>_mixer_step_<n>`, `layer<i>_mlp_step_<n>`, and `layer<i>_shared_mlp_step_<n>` where a
    shared MLP or expert is recorded, of the first COMPILEDUMP_LAYER_STEPS forwards; four or five
    more captures per layer and forward, which `step_states=False` leaves out), so that a decode-only
    bug is named at its layer and sublayer. `exclude`
    leaves tags out, `{i}` standing for every layer: `exclude=("layer{i}_mlp",)` (a tag takes its
    steps along: `layer{i}` its `layer<i>_step_<n>`, `layer{i}_router` its picks and step routing);
    a pattern that matches no tag raises `ValueError`. In compiled bf16 code a capture can move a
    rounding (docs/compiling.md: the MoE block's output is the measured case). `taps` adds more:
    `{"layer{i}_q": "model.layers.{i}.self_attn.q_proj"}` (a `{i}` in both expands over the layers;
    paths are relative to `model`; append `:input` for the module's first input instead of its
    output). Integer tensors are captured with `record_ids`, others with `record` (the prompt's
    call); a tap named `layer{i}` (a layer's output), `logits` or `input_token` (`:input`) that the
    defaults did not attach records each forward's step as the default tag does. `layer<i>_router`
    keeps every prompt row (`router_rows="all"`, the default; the ids are recorded whole), so that
    the comparator can judge a routing flip in any row by that row's router logits: with one row, a
    flip in an earlier row is "not judged" (exit 3). It costs tokens x experts x 4 bytes of arena
    per MoE layer kept; `router_rows="one"` keeps the last row, None follows COMPILEDUMP_ROWS like
    the other taps. Hidden states `[batch, seq, hidden]` keep batch row `batch_row` (default 0, the
    first request of a padded batch): every position is a token row, and the token gate compares
    `seq` with the prompt; the row of the 2-D `attention_mask` the base model gets is recorded as
    `prompt_mask`, so that the comparator compares a padded row (`generate` on a batch) on its real
    positions.

    Call it before `torch.compile`; on a compiled model it clears dynamo's caches (a warning
    says so) so that the hooks take effect.
    """
    inner = _uncompiled(model)
    if router_rows not in ("all", "one", None):
        raise ValueError(f"compiledump.instrument: router_rows must be 'all', 'one' or None, got {router_rows!r}")
    if isinstance(exclude, str):
        raise TypeError(f"compiledump.instrument: exclude takes a sequence of tag patterns, got the string {exclude!r} "
                        f"(write exclude=({exclude!r},))")
    handle = Instrumented(inner, batch_row, step_routing, router_rows, step_states, exclude)
    mixers.declare_exclude([])  # another model's patterns: gone, whether or not this call succeeds
    try:
        _attach(handle, inner, taps, defaults)
    except BaseException:
        handle.remove()  # nothing of a failed call stays attached (a retry would record twice)
        raise
    mixers.declare_exclude(list(handle._exclude))
    STATE.instruments.append(handle)
    return handle


def _attach(handle: Instrumented, inner: torch.nn.Module, taps: dict[str, str] | None, defaults: bool) -> None:
    """`instrument`'s work: the default taps, then the explicit ones, then the checks of both."""
    modules = dict(inner.named_modules())
    layers_path, layers = layout.find_layers(modules)
    # An encoder-decoder's encoder runs once per request, on a source of its own length
    encoder_decoder = hf_configs.is_encoder_decoder(inner)
    encoder = layout.encoder_path(layers_path, modules) if encoder_decoder else None
    if defaults:
        if layers is None:
            raise ValueError("compiledump.instrument: no decoder layers found (a ModuleList named "
                             f"{' or '.join(map(repr, layout.LAYER_LISTS))} whose modules each have one of "
                             f"{', '.join(layout.MIXERS)}); pass defaults=False and taps={{'layer{{i}}': "
                             "'<path of the layers>.{i}', 'logits': '<head>', 'input_token': '<token embedding>:input'}"
                             " (so named, they record each decode step as the default tags do)")
        if ends.token_embedding_path(layers_path, modules) is None \
                and "input_token" not in ends.held_elsewhere(layers_path, modules):  # (a later pipeline stage)
            warnings.warn(f"compiledump.instrument: tapped the layers at {layers_path}, which have no token embedding "
                          f"({', '.join(ends.TOKEN_EMBEDDINGS)}) beside them. If they are an encoder's (a vision or "
                          "audio tower), the decoder's layers were not recognised: to compare the decoder, pass "
                          "defaults=False and taps={'layer{i}': '<path of its layers>.{i}', 'logits': '<head>', "
                          "'input_token': '<token embedding>:input'}", RuntimeWarning, stacklevel=3)
        default_taps.add_default_taps(handle, layers_path, layers, modules, encoder)
        if (others := layout.other_token_stacks(modules, layers_path, encoder)) and encoder_decoder:
            warnings.warn(f"compiledump.instrument: tapped the decoder's layers at {layers_path} (they run at every "
                          f"decode step) and recorded the encoder's output (`encoder_output`, its first source row); "
                          f"the encoder's layers at {', '.join(others)} get no default taps. To find which of them "
                          f"first differs, add taps={{'encoder{{i}}': '{others[0]}.{{i}}'}} (recorded once, the first "
                          "source row, as `encoder_output` is)", RuntimeWarning, stacklevel=3)
        elif others:
            warnings.warn(f"compiledump.instrument: tapped the layers at {layers_path}; {', '.join(others)} also "
                          "hold layers beside a token embedding (an encoder and a decoder?), which get no default "
                          "taps. If those are the ones to compare, pass defaults=False and taps={'layer{i}': "
                          f"'{others[0]}.{{i}}', ...}}", RuntimeWarning, stacklevel=3)
    for tag_pattern, path_pattern in (taps or {}).items():
        match = _PATH_SIDE.match(path_pattern)
        path, side = match.group("path"), match.group("side") or "output"
        # over the decoder layers where the path is under them; elsewhere (no `layers` found, an
        # encoder's layers) 0, 1, ... while the path names a module
        indices = ([None] if "{i}" not in path else range(len(layers)) if layers is not None
                   and path.startswith(f"{layers_path}.") else layout.consecutive(path, modules))
        found = False
        for i in indices:
            name = path.format(i=i) if i is not None else path
            tag = tag_pattern.format(i=i) if i is not None else tag_pattern
            if name in modules:
                target = f"{name}:input" if side == "input" else name
                if tag in handle.taps and handle.taps[tag] != target:
                    raise ValueError(f"compiledump.instrument: tap {tag!r} at {target!r}: the defaults already "
                                     f"record {tag!r} at {handle.taps[tag]!r}; to record it elsewhere, leave it "
                                     f"out of the defaults with exclude=({re.sub(r'^layer[0-9]+', 'layer{i}', tag)!r},)"
                                     " and tap it under another name, or pass defaults=False")
                if encoder is not None and f"{name}.".startswith(f"{encoder}."):
                    # recorded once: its source length would teach the token gate a wrong prompt length
                    handle._add(modules[name], tag, name, side, capture=default_taps.once_capture(handle, tag))
                elif tag not in handle.taps and not default_taps.add_named_as_default(
                        handle, tag_pattern, tag, name, modules[name], side):
                    handle._add(modules[name], tag, name, side)
                found = True
        if not found:
            raise ValueError(f"compiledump.instrument: tap {tag_pattern!r}: no module at {path_pattern!r} "
                             f"(module paths are relative to the model, e.g. {next((n for n in modules if n), '')!r})")
    if unmatched := [pattern for pattern, regex in handle._exclude.items()
                     if not any(regex.fullmatch(tag) for tag in handle._left_out)]:
        raise ValueError(f"compiledump.instrument: exclude pattern(s) {', '.join(map(repr, unmatched))} match no tag "
                         f"attached (tags: {', '.join(_tag_patterns({*handle.taps, *handle._left_out}))})")
    if defaults:
        default_taps.warn_unfound(handle, layers_path, modules)


def _tag_patterns(taps) -> list[str]:
    """The attached tags with each layer index written `{i}`: what `exclude` takes."""
    return sorted({re.sub(r"^layer\d+", "layer{i}", tag) for tag in taps})


def _uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module to hook: `torch.compile(model)`'s original module. Code dynamo already traced
    for a compiled model would never see the new hooks (dynamo skips hook guards), so its caches
    are cleared: the next call re-traces with them."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compiledump.instrument: expected a torch.nn.Module, got {type(model).__name__}")
    inner = getattr(model, "_orig_mod", model)
    if inner is not model or getattr(model, "_compiled_call_impl", None) is not None:
        warnings.warn("compiledump.instrument: the model is compiled; cleared dynamo's caches "
                      "(torch._dynamo.reset()) so that its next call is traced with the capture hooks. "
                      "Call instrument() before torch.compile to avoid the re-trace.", RuntimeWarning, stacklevel=3)
        torch._dynamo.reset()
    return inner
