"""Where a decoder layer keeps the residual stream, which `layer<i>_attn` and `layer<i>` record.

Hugging Face layers add each sublayer's output to the stream themselves: a layer's output is the
stream, and so is the input of the norm before its MLP. vLLM and SGLang defer each add to the next
norm, a fused add-RMSNorm: a layer takes and returns the stream in two parts,
`forward(positions, hidden_states, ..., residual) -> (hidden_states, residual)`, whose sum is the
stream, and the norm, called as `norm(x, residual)`, adds them before it normalises (returning
`(normed, x + residual)`; its CUDA kernel does it in place). Recording either part alone would
read as a divergence against a Hugging Face reference on an engine that is right.

The readers below run inside hooks traced by `torch.compile`: their checks are on types only,
which dynamo resolves while tracing (no graph break).
"""

from __future__ import annotations

import inspect

import torch


def defers_residual(layer: torch.nn.Module) -> bool:
    """Whether `layer` takes and returns the stream in two parts: its forward has a `residual`
    parameter (vLLM's and SGLang's decoder layers; Hugging Face's have none)."""
    return "residual" in _parameters(layer)


def hidden_states_reader(layer: torch.nn.Module):
    """`(args, kwargs) -> ` the hidden states `layer` is called with: its `hidden_states`
    argument, wherever the forward takes it (vLLM's and SGLang's layers take `positions` first);
    the first where the forward does not name it."""
    names = [name for name in _parameters(layer) if name != "self"]
    at = names.index("hidden_states") if "hidden_states" in names else 0
    return lambda args, kwargs: args[at] if len(args) > at else kwargs.get("hidden_states")


def altup_active(layer: torch.nn.Module):
    """`stack -> stack[active]` for a layer that passes an AltUp stack `[altup_num_inputs, batch,
    seq, hidden]` from layer to layer (Gemma 3n: its `altup` corrects the predictions; the active
    one is the stream the next layer's attention reads), None for any other layer. Read as it
    is, the stack looked like `[batch, seq, hc_mult, hidden]` of one token, which the token gate
    dropped at every call: Gemma 3n's `layer<i>` was never recorded."""
    config = getattr(layer, "config", None)
    index = getattr(config, "altup_active_idx", None)
    if not isinstance(getattr(layer, "altup", None), torch.nn.Module) or not isinstance(index, int):
        return None
    return lambda stack: stack[index] if isinstance(stack, torch.Tensor) and stack.dim() == 4 else stack


def first_input(args: tuple, kwargs: dict):
    """A module's first input, positional or not."""
    return args[0] if args else next(iter(kwargs.values()), None)


def layer_stream(output):
    """A deferring layer's output `(hidden_states, residual)` -> their sum, the stream (the first
    alone where the residual is None); anything else as it is."""
    if isinstance(output, (tuple, list)) and len(output) >= 2 and is_float(output[0]) and is_float(output[1]):
        return output[0] + output[1]
    return output


def norm_stream(args: tuple, kwargs: dict):
    """A fused add-norm's inputs `(x, residual)` -> `x + residual`, the stream it normalises (read
    before the norm runs: its CUDA kernel overwrites both); `x` where it is called without one."""
    x = args[0] if args else kwargs.get("x", kwargs.get("hidden_states"))
    residual = args[1] if len(args) > 1 else kwargs.get("residual")
    return x + residual if is_float(x) and is_float(residual) else x


def output_argument(module: torch.nn.Module):
    """`(args, kwargs) -> ` the `output` argument of a module that writes its result there and
    returns None (vLLM's Mamba mixers: `self.mamba(h, output)`); None where its forward has none."""
    names = [name for name in _parameters(module) if name != "self"]
    if "output" not in names:
        return None
    at = names.index("output")
    return lambda args, kwargs: args[at] if len(args) > at else kwargs.get("output")


def batched_ids(value) -> bool:
    """Whether `value` is `[batch, seq]` token ids (a 2-D integer tensor)."""
    return isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point()


def _parameters(layer: torch.nn.Module):
    try:
        return inspect.signature(layer.forward).parameters
    except (TypeError, ValueError):  # a forward inspect cannot read (a C extension's)
        return {}


def is_float(value) -> bool:
    """Whether `value` is a floating-point tensor."""
    return isinstance(value, torch.Tensor) and value.is_floating_point()
