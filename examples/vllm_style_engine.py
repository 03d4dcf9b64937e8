"""An engine built the way vLLM and SGLang build their models, against the Hugging Face model it was
loaded from, both dumped with `compiledump.instrument` and nothing else, then compared.

    python examples/vllm_style_engine.py [OUT] [--model llama|qwen3_moe|mixtral] [--dtype float32|bfloat16]
        [--seed N] [--sglang] [--moe-layers N] [--bug norm_eps|rope_base|decode_position|renormalize]

Both sides prefill a 7-token prompt and decode 4 tokens fed to both (teacher forcing): the
reference is the Hugging Face model, float32, eager, with its DynamicCache; the engine (Llama,
Qwen3-MoE or Mixtral, in `--dtype`) is written as vLLM writes them. Prints the comparison and exits with its
status (0 no divergence, 1 divergence, 3 not comparable).

What matters for the capture (vLLM's `model_executor/models/llama.py`, SGLang's alike):
- tokens are flat, `[tokens, hidden]`, with `positions` beside them (no batch dimension);
- a decoder layer's forward is `(positions, hidden_states, residual)` and returns
  `(hidden_states, residual)`: the residual add is deferred to the next norm, a fused add-RMSNorm
  called as `norm(x, residual)` that returns `(normed, x + residual)`; the final `norm` ends it;
- q/k/v and gate/up are fused projections (`qkv_proj`, `gate_up_proj`);
- an MoE block's `gate` is a linear layer returning `(logits, None)` and its `experts` (vLLM's
  FusedMoE) pick each token's experts from those logits themselves;
- `lm_head` is never called (vLLM's ParallelLMHead raises): `logits_processor(lm_head, hidden)`
  computes the logits of the rows the runner picks (each request's last token).

With `sglang=True` the layers take SGLang's `(positions, hidden_states, forward_batch, residual)`
and an MoE block picks its experts in a `topk` module (SGLang's TopK, returning `topk_ids`)
whose output the fused MoE takes.

`bug` injects one engine bug: "norm_eps" (layer 1's post-attention norm uses eps 1e-2),
"rope_base" (rotary base 5000 instead of the config's), "decode_position" (decode positions off
by one), "renormalize" (the fused MoE renormalises its top-k weights where the model does not).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import compiledump
from compiledump import config as cd_config


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: `forward(x)` -> normed; `forward(x, residual)` -> (normed(x + residual), x + residual)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x, residual=None):
        dtype = x.dtype
        x = x.float()
        if residual is not None:
            x = x + residual.float()
            residual = x.to(dtype)
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype) * self.weight
        return x if residual is None else (x, residual)


def _rotate(x, positions, base: float):
    """Neox-style rotary embedding of `[tokens, heads, head_dim]` at `positions`."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / base ** (torch.arange(0, half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config, base: float):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.qkv_proj = nn.Linear(config.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        if config.model_type == "qwen3_moe":  # Qwen3: RMSNorm over each head of q and k before the rotary
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.base = base
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values of earlier tokens

    def forward(self, positions, hidden_states):
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q, k = q.view(-1, self.heads, self.head_dim), k.view(-1, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, positions, self.base), _rotate(k, positions, self.base)
        v = v.view(-1, self.kv_heads, self.head_dim)
        new = q.shape[0]
        if self.cache is not None:
            k, v = torch.cat([self.cache[0], k]), torch.cat([self.cache[1], v])
        self.cache = (k, v)
        group = self.heads // self.kv_heads
        keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # Query i (of the new tokens) sees every cached key and the new ones up to itself.
        mask = torch.ones(new, keys.shape[0], dtype=torch.bool).tril(keys.shape[0] - new)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask)
        return self.o_proj(out.transpose(0, 1).reshape(new, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Gate(nn.Module):
    """vLLM's ReplicatedLinear: `(output, output_bias)`, the bias None."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))

    def forward(self, x):
        return F.linear(x, self.weight), None


class FusedMoE(nn.Module):
    """Softmax over the router logits in float32, top-k, renormalised where the config says so."""

    def __init__(self, config, bug: str | None):
        super().__init__()
        experts, hidden, inner = _experts(config), config.hidden_size, getattr(config, "moe_intermediate_size", None) \
            or config.intermediate_size
        renormalize = getattr(config, "norm_topk_prob", True)  # Mixtral always renormalises
        self.top_k, self.renormalize = config.num_experts_per_tok, renormalize != (bug == "renormalize")
        self.w13_weight = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.w2_weight = nn.Parameter(torch.empty(experts, hidden, inner))

    def forward(self, hidden_states, router_logits=None, topk_output=None):
        weights, ids = pick(router_logits, self.top_k, self.renormalize) if topk_output is None else topk_output[:2]
        out = torch.zeros_like(hidden_states)
        for token in range(hidden_states.shape[0]):
            for weight, expert in zip(weights[token], ids[token].tolist()):
                gate, up = F.linear(hidden_states[token], self.w13_weight[expert]).chunk(2, dim=-1)
                out[token] += (F.linear(F.silu(gate) * up, self.w2_weight[expert]) * weight).to(out.dtype)
        return out


def _experts(config) -> int | None:
    """The routed experts of an MoE config (Qwen3-MoE's `num_experts`, Mixtral's
    `num_local_experts`); None for a dense one."""
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)


def pick(router_logits, top_k: int, renormalize: bool):
    """Softmax in float32, top-k, renormalised or not: (weights, ids)."""
    weights, ids = torch.softmax(router_logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights), ids


class TopKOutput(NamedTuple):
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


class TopK(nn.Module):
    """SGLang's TopK: the experts picked from the gate's logits, for the fused MoE to run."""

    def __init__(self, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, hidden_states, router_logits):
        return TopKOutput(*pick(router_logits, self.top_k, self.renormalize), router_logits)


class SparseMoeBlock(nn.Module):
    def __init__(self, config, bug: str | None, sglang: bool):
        super().__init__()
        self.gate, self.experts = Gate(config.hidden_size, _experts(config)), FusedMoE(config, bug)
        if sglang:
            self.topk = TopK(self.experts.top_k, self.experts.renormalize)

    def forward(self, hidden_states):
        router_logits, _ = self.gate(hidden_states)
        if hasattr(self, "topk"):
            return self.experts(hidden_states, topk_output=self.topk(hidden_states, router_logits))
        return self.experts(hidden_states=hidden_states, router_logits=router_logits)


class DecoderLayer(nn.Module):
    def __init__(self, config, base: float, mlp_eps: float, bug: str | None, sglang: bool = False):
        super().__init__()
        self.self_attn = Attention(config, base)
        self.mlp = SparseMoeBlock(config, bug, sglang) if _experts(config) else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, mlp_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class SGLangDecoderLayer(DecoderLayer):
    def forward(self, positions, hidden_states, forward_batch, residual):
        return super().forward(positions, hidden_states, residual)


class LMHead(nn.Module):
    """vLLM's ParallelLMHead: its weight is read by the logits processor; calling it is an error."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))

    def forward(self, *_):
        raise RuntimeError("LMHead's weights should be used in the sampler.")


class LogitsProcessor(nn.Module):
    def forward(self, lm_head, hidden_states):
        return hidden_states @ lm_head.weight.t()


class Model(nn.Module):
    def __init__(self, config, bug: str | None, sglang: bool):
        super().__init__()
        self.sglang = sglang
        layer = SGLangDecoderLayer if sglang else DecoderLayer
        base = 5000.0 if bug == "rope_base" else config.rope_parameters["rope_theta"]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer(config, base, 1e-2 if bug == "norm_eps" and i == 1 else config.rms_norm_eps, bug, sglang)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions):
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            extra = (object(),) if self.sglang else ()  # SGLang's forward_batch
            hidden_states, residual = layer(positions, hidden_states, *extra, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class ForCausalLM(nn.Module):
    """The engine of `hf_model` (a Hugging Face Llama, Qwen3-MoE or Mixtral), with its weights."""

    def __init__(self, hf_model, bug: str | None = None, sglang: bool = False):
        super().__init__()
        config = hf_model.config
        self.model = Model(config, bug, sglang)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor()
        self.bug = bug
        self._load(hf_model.state_dict())

    def _load(self, hf: dict) -> None:
        own = {}
        for name, weight in hf.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                own[name.replace("gate_up_proj", "w13_weight").replace("down_proj", "w2_weight")] = weight
                continue
            for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
                if f".{parts[0]}." in name:
                    own[name.replace(parts[0], fused)] = torch.cat([hf[name.replace(parts[0], p)] for p in parts])
            if not any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                own[name] = weight
        own.setdefault("lm_head.weight", hf["model.embed_tokens.weight"])
        self.load_state_dict(own)

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states):
        return self.logits_processor(self.lm_head, hidden_states)

    def generate(self, prompt: torch.Tensor, decode: list[int]) -> None:
        """Prefill `prompt` (`[tokens]`), then feed the `decode` tokens one per step (teacher
        forcing); the logits of each forward's last token, as a runner samples them."""
        for layer in self.model.layers:
            layer.self_attn.cache = None
        hidden = self(prompt, torch.arange(prompt.numel()))
        self.compute_logits(hidden[-1:])
        shift = 1 if self.bug == "decode_position" else 0
        for n, token in enumerate(decode):
            hidden = self(torch.tensor([token]), torch.tensor([prompt.numel() + n + shift]))
            self.compute_logits(hidden[-1:])


def _hf_example():
    """examples/hf_reference_vs_compiled.py (its `build_model`: the tiny configs)."""
    spec = importlib.util.spec_from_file_location("hf_reference_vs_compiled",
                                                  Path(__file__).with_name("hf_reference_vs_compiled.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dump(model: nn.Module, directory: Path, run, moe_layers: int = 2, **settings) -> dict:
    """Instrument `model`, `run()` it, flush into `directory`; the handle's taps. `settings`: other
    compiledump settings than their defaults (e.g. `arena_mb`)."""
    compiledump.reset()
    config = cd_config.Config(dir=str(directory), moe_layers=moe_layers, **settings)
    compiledump.configure(**dataclasses.asdict(config))
    handle = compiledump.instrument(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        run()
        compiledump.flush()
    handle.remove()
    compiledump.reset()
    return handle.taps


def run_pair(out: Path, name: str = "qwen3_moe", seed: int = 0, dtype=torch.float32, bug: str | None = None,
             moe_layers: int = 2, sglang: bool = False):
    """The reference's dump in `out/ref`, the engine's in `out/run`; (the Hugging Face model, the
    engine, the prompt)."""
    hf = _hf_example().build_model(name, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    prompt = torch.randint(0, hf.config.vocab_size, (7,), generator=g)
    decode = torch.randint(0, hf.config.vocab_size, (4,), generator=g).tolist()

    def reference():
        from transformers import DynamicCache

        cache = DynamicCache(config=hf.config)
        hf(input_ids=prompt[None], cache=cache, use_cache=True)
        for token in decode:
            hf(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)

    engine = ForCausalLM(hf, bug, sglang).eval().to(dtype)
    dump(hf, Path(out) / "ref", reference, moe_layers)
    dump(engine, Path(out) / "run", lambda: engine.generate(prompt, decode), moe_layers)
    return hf, engine, prompt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="output directory (default: a temporary one)")
    parser.add_argument("--model", choices=("llama", "qwen3_moe", "mixtral"), default="qwen3_moe")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sglang", action="store_true", help="SGLang's layer signature and TopK module")
    parser.add_argument("--moe-layers", type=int, default=2, help="COMPILEDUMP_MOE_LAYERS on both sides")
    parser.add_argument("--bug", choices=("norm_eps", "rope_base", "decode_position", "renormalize"))
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="compiledump_engine_"))
    run_pair(out, args.model, args.seed, getattr(torch, args.dtype), args.bug, args.moe_layers, args.sglang)
    from compiledump.cli import main as cli

    return cli(["compare", str(out / "ref"), str(out / "run")])


if __name__ == "__main__":
    sys.exit(main())
