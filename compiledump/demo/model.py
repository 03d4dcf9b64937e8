"""A small built-in transformer-like model that exercises every capture kind like a real engine.

Deterministic from a random seed (no weights to download). The residual stream is `[tokens, hc_mult,
dim]` (hyper-connection style), each layer has a recurrent token mixer (a linear recurrence, so
decode carries a small per-request state instead of a KV cache) and a top-k MoE whose expert ids
are captured with `record_ids`. Used by the tests, the benchmarks and `compiledump demo`.

The capture calls go through `self.dump`, any object with the capture API (`compiledump`, the
`debug_dump.py` module it replaces, or `NO_DUMP`), so the same model compares compiledump with
debug_dump.py and with an uninstrumented run.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn


def _no_op(*_args, **_kwargs) -> None:
    return None


# An uninstrumented run: the same call sites, nothing captured.
NO_DUMP = types.SimpleNamespace(record=_no_op, record_step=_no_op, record_ids=_no_op, set_rows=_no_op)


BUGS = ("dropped_hc", "routed_scale")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the built-in model. `bug_layer` >= 0 injects a realistic bug in that layer."""

    vocab: int = 256
    dim: int = 64
    hc_mult: int = 4
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    ffn: int = 96
    seed: int = 0
    captures_per_layer: int = 3  # hidden state + expert ids (2), + MoE output (3), + mixer (4), + MoE input (5)
    bug_layer: int = -1  # dropped_hc: hc stream 1 loses this layer's update; routed_scale: MoE output x bug_scale
    bug: str = "dropped_hc"  # or "routed_scale": how the bug at bug_layer breaks the layer
    bug_scale: float = 1.5  # routed_scale's factor on the MoE output

    def __post_init__(self):
        if self.bug not in BUGS:
            raise ValueError(f"unknown bug {self.bug!r}; choose from {BUGS}")
        if not 2 <= self.captures_per_layer <= 5:
            raise ValueError("captures_per_layer must be 2..5")


class TinyMoE(nn.Module):
    """hc_mult residual stream + linear-recurrence mixer + top-k MoE; see the module docstring.

    `forward(tokens)` is a prefill of one request (`tokens` is `[T]`); `forward(tokens, state)`
    is one decode step of a batch (`tokens` `[B]`, `state` `[layers, B, dim]`, row 0 the real
    request, the rest padding). Both return `(logits, state)`.
    """

    def __init__(self, cfg: ModelConfig = ModelConfig(), dump=NO_DUMP, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.dump = dump
        # Weights are drawn on `device` (default CPU): large benchmark models are generated on
        # the GPU directly. The same seed gives the same weights for one device type.
        gen = torch.Generator(device=device or "cpu").manual_seed(cfg.seed)

        def param(*shape, scale):
            w = torch.randn(*shape, generator=gen, device=device) * scale
            return nn.Parameter(w.to(dtype) if dtype is not None else w, requires_grad=False)

        d, e, f = cfg.dim, cfg.experts, cfg.ffn
        self.embed = param(cfg.vocab, d, scale=1.0)
        self.hc_in = param(cfg.hc_mult, 1, scale=0.5)
        self.decay = nn.Parameter(torch.linspace(0.3, 0.8, cfg.layers, device=device, dtype=dtype),
                                  requires_grad=False)
        self.router = param(cfg.layers, d, e, scale=d**-0.5)
        self.w_in = param(cfg.layers, e, d, f, scale=d**-0.5)
        self.w_out = param(cfg.layers, e, f, d, scale=f**-0.5)
        self.hc_gate = param(cfg.layers, cfg.hc_mult, 1, scale=0.5)
        self.head = param(d, cfg.vocab, scale=d**-0.5)
        with torch.no_grad():
            self.hc_in += 1.0
            self.hc_gate += 1.0

    @staticmethod
    def _norm(h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)

    def _moe(self, i: int, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        weights, ids = torch.topk(torch.softmax((h @ self.router[i]).float(), -1), cfg.top_k, dim=-1)
        self.dump.record_ids(f"layer{i}_topk", ids)
        weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
        # Dense over experts, then gather the chosen ones: shape-static, compile-friendly.
        hidden = torch.nn.functional.silu(torch.einsum("nd,edf->nef", h, self.w_in[i]))
        outs = torch.einsum("nef,efd->ned", hidden, self.w_out[i])
        chosen = torch.gather(outs, 1, ids[:, :, None].expand(-1, -1, outs.shape[-1]))
        out = (chosen * weights[:, :, None]).sum(1)
        if i == cfg.bug_layer and cfg.bug == "routed_scale":
            out = out * cfg.bug_scale  # a routed scaling factor applied where the reference has none
        return out

    def forward(self, tokens: torch.Tensor, state: torch.Tensor | None = None):
        cfg = self.cfg
        dump = self.dump
        x = self.embed[tokens][:, None, :] * self.hc_in  # [N, hc, dim]
        new_state = []
        for i in range(cfg.layers):
            h = self._norm(x.mean(1))
            a = self.decay[i].to(h.dtype)
            if state is None:
                # Prefill: s_t = sum_{j<=t} a^(t-j) h_j, as one causal matrix product.
                t = torch.arange(h.shape[0], device=h.device)
                lag = (t[:, None] - t[None, :]).to(h.dtype)
                mix = torch.where(lag >= 0, a ** lag.clamp(min=0), 0) @ h
                new_state.append(mix[-1:].expand(1, -1))
            else:
                mix = a * state[i] + h
                new_state.append(mix)
            if cfg.captures_per_layer >= 4:
                dump.record(f"layer{i}_mix", mix)
            moe_in = self._norm(mix)
            if cfg.captures_per_layer >= 5:
                dump.record(f"layer{i}_moe_in", moe_in)
            moe = self._moe(i, moe_in)
            if cfg.captures_per_layer >= 3:
                dump.record(f"layer{i}_moe_out", moe)
            gate = self.hc_gate[i]
            if i == cfg.bug_layer and cfg.bug == "dropped_hc":
                gate = gate * (torch.arange(cfg.hc_mult, device=x.device) != 1)[:, None].to(gate.dtype)
            x = x + moe[:, None, :] * gate
            dump.record(f"layer{i}", x)
        logits = self._norm(x.mean(1)) @ self.head
        if state is None:
            dump.record("logits", logits, once=True)  # prefill: the last position's logits
        else:
            dump.record_step("logits", logits)  # decode: row 0, the real request
        return logits, torch.stack(new_state)


def _null_profiling():
    import contextlib

    return contextlib.nullcontext()


NO_DUMP.profiling = _null_profiling


@dataclass(frozen=True)
class Session:
    """Inputs of one engine-like run: a prompt, a profile run, warm-up and padded decode steps."""

    prompt: torch.Tensor  # [T] token ids of the one real request
    decode_tokens: torch.Tensor  # [steps] teacher-forced tokens of the real request
    pad_tokens: torch.Tensor  # [steps, pad_rows] tokens of the padding rows
    pad_state: torch.Tensor  # [layers, pad_rows, dim] recurrent state of the padding rows
    profile_tokens: torch.Tensor  # [P] the engine's dummy profile forward (P != T)
    warmup_rows: int = 8  # a warm-up decode batch this wide is reported to set_rows

    def to(self, device) -> "Session":
        """The same session with its tensors on `device` (stage inputs before timing or graphs)."""
        moved = {k: getattr(self, k).to(device) for k in ("prompt", "decode_tokens", "pad_tokens", "pad_state", "profile_tokens")}
        return Session(**moved, warmup_rows=self.warmup_rows)


def make_session(cfg: ModelConfig, prompt_len: int = 7, steps: int = 32, pad_rows: int = 3, seed: int = 1) -> Session:
    """Random but deterministic inputs for `run_session`."""
    gen = torch.Generator().manual_seed(seed)
    return Session(
        prompt=torch.randint(0, cfg.vocab, (prompt_len,), generator=gen),
        decode_tokens=torch.randint(0, cfg.vocab, (steps,), generator=gen),
        pad_tokens=torch.randint(0, cfg.vocab, (steps, pad_rows), generator=gen),
        pad_state=torch.randn(cfg.layers, pad_rows, cfg.dim, generator=gen),
        profile_tokens=torch.randint(0, cfg.vocab, (prompt_len + 4,), generator=gen),
    )


def with_dynamic_token_count(forward):
    """`forward(tokens[, state])` with the token count marked dynamic before every call (the
    tokens' dim 0 and the decode state's dim 1, a row per token), as engines mark num_tokens: a
    compiled forward then keeps one graph for prefill-shaped and one for decode-shaped calls,
    whatever the batch, and the model's widths stay static."""

    def marked(tokens, state=None):
        torch._dynamo.maybe_mark_dynamic(tokens, 0)
        if state is None:
            return forward(tokens)
        torch._dynamo.maybe_mark_dynamic(state, 1)
        return forward(tokens, state)

    return marked


def run_session(forward, dump, session: Session, device=None, on_step=None, engine: bool = True):
    """Drive `forward` (the model or its compiled form) the way an engine does.

    1. prefill of the prompt; 2. (engine only) the profile run under `dump.profiling()`;
    3. (engine only) one warm-up decode of `warmup_rows` rows, reported through `set_rows` (so
    `record_step` must skip it); 4. the decode steps: row 0 is the real request, the rest
    padding (none for a reference session), and the sampler reports one real row.
    `device`: where the inputs go (default: where the session's tensors are).
    Returns the real request's logits per decode step.
    """
    dev = torch.device(device) if device is not None else session.prompt.device
    with torch.no_grad():
        dump.set_rows(1)
        _, state = forward(session.prompt.to(dev))
        if engine:
            with dump.profiling():
                forward(session.profile_tokens.to(dev))
            rows = session.warmup_rows
            warm_state = torch.zeros(state.shape[0], rows, state.shape[-1], device=dev, dtype=state.dtype)
            dump.set_rows(rows)
            forward(torch.zeros(rows, dtype=torch.long, device=dev), warm_state)
        state = torch.cat([state, session.pad_state.to(dev, state.dtype)], 1)
        out = []
        for step in range(session.decode_tokens.shape[0]):
            tokens = torch.cat([session.decode_tokens[step : step + 1], session.pad_tokens[step]]).to(dev)
            dump.set_rows(1)
            logits, state = forward(tokens, state)
            out.append(logits[0])
            if on_step is not None:
                on_step(step)
        return torch.stack(out)


def export_session(model: "TinyMoE", session: Session):
    """The model's prefill and decode step exported with `compiledump.aot.export`, as an engine
    exports them: prefill with a dynamic prompt length, decode with a dynamic batch (its tokens
    and state share the batch dim). Capture must be configured. Returns (prefill, decode)."""
    from .. import aot

    device = session.prompt.device
    batch = 1 + session.pad_tokens.shape[1]
    rows = torch.export.Dim("batch", min=2, max=1024)
    prefill = aot.export(model, (session.prompt,), dynamic_shapes=({0: torch.export.Dim("tokens", min=2, max=4096)},))
    state = torch.zeros(model.cfg.layers, batch, model.cfg.dim, device=device, dtype=model.embed.dtype)
    decode = aot.export(model, (torch.zeros(batch, dtype=torch.long, device=device), state),
                        dynamic_shapes=({0: rows}, {1: rows}))
    return prefill, decode


def session_forward(prefill, decode):
    """One `forward(tokens, state=None)` for `run_session` from separate prefill and decode programs."""

    def forward(tokens, state=None):
        return prefill(tokens) if state is None else decode(tokens, state)

    return forward


def run_session_cuda_graph(forward, dump, session: Session, on_step=None):
    """`run_session` with the decode step captured once in a `torch.cuda.graph` and replayed.

    As vLLM/SGLang do: static input buffers, warm-up on a side stream and capture with dummy
    data, both under `dump.profiling()` (capture must be recorded but write nothing); then every
    step copies its inputs into the buffers, reports its rows outside the graph, and replays.
    `session` must already be on the CUDA device. Returns the real request's logits per step.
    """
    dev = session.prompt.device
    with torch.no_grad():
        dump.set_rows(1)
        _, state = forward(session.prompt)
        with dump.profiling():
            forward(session.profile_tokens)
        batch = 1 + session.pad_tokens.shape[1]
        tokens = torch.zeros(batch, dtype=torch.long, device=dev)
        static_state = torch.zeros(state.shape[0], batch, state.shape[-1], device=dev, dtype=state.dtype)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), dump.profiling():
            for _ in range(2):  # warm-up: kernels compile here, never during capture
                forward(tokens, static_state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with dump.profiling(), torch.cuda.graph(graph):
            logits, new_state = forward(tokens, static_state)
        dump.set_rows(session.warmup_rows)  # a wide warm-up replay: record_step must skip it
        graph.replay()
        state = torch.cat([state, session.pad_state.to(state.dtype)], 1)
        out = []
        for step in range(session.decode_tokens.shape[0]):
            tokens.copy_(torch.cat([session.decode_tokens[step : step + 1], session.pad_tokens[step]]))
            static_state.copy_(state)
            dump.set_rows(1)
            graph.replay()
            state = new_state.clone()
            out.append(logits[0].clone())
            if on_step is not None:
                on_step(step)
        return torch.stack(out)
