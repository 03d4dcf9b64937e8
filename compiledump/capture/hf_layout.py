"""Where a Hugging Face decoder keeps its layers and each layer its parts: the module names
`instrument()` looks for (what sits around the layers, embedding, final norm and head, is
capture/hf_ends.py's).

Default taps follow the names Hugging Face (and vLLM/SGLang) give a decoder-only causal LM:
`<...>.layers.<i>` with a token mixer (`self_attn`, or `linear_attn`/`mamba`/`mixer` in hybrid
models), the norm before the MLP, `mlp` (or `block_sparse_moe`/`feed_forward`) and its router
`gate` (or `router`); the names of the GPT-2 family (`transformer.h.<i>` with `attn`, `ln_2`, `mlp`:
GPT-2, GPT-J, GPT-Neo, GPTBigCode, CodeGen, Falcon, Bloom, MPT's `blocks`, GPT-NeoX's `attention`),
T5's (`decoder.block.<i>`, each block's parts in sublayers: SUBLAYERS), BERT's
(`<model>.encoder.layer.<i>`, its MLP split into `intermediate` and `output`) and Meta's reference
code's (`attention`, `feed_forward`, `ffn_norm`; torchtitan's `layers` a ModuleDict). This module
only finds modules; instrument.py hooks them.
"""

from __future__ import annotations

import inspect
import re

import torch

from . import hf_ends as ends
from .hf_configs import is_encoder_decoder
from .hf_ends import placeholder
from .hf_routers import int_attr

# A decoder layer has one of these token mixers (attention, or a hybrid model's linear attention
# or state-space block).
MIXERS = ("self_attn", "linear_attn", "mamba", "mixer", "self_attention", "conv",  # JetMoE, Falcon, Bloom; LFM2
          "attn", "attention",  # the GPT-2 family, MPT; GPT-NeoX
          "cross_attn",  # Mllama's cross-attention layers (to the image), between its self-attention ones
          "temporal_block", "mlstm_layer",  # RecurrentGemma (recurrent or attention), xLSTM
          "mamba_decoder",  # Zamba's hybrid layers: a shared transformer block feeding a Mamba layer
          "norm_attn_norm",  # DBRX: its attention between the norm before it and the norm before the MLP
          "SelfAttention",  # T5's family, inside its first sublayer (SUBLAYERS)
          "LocalSelfAttention", "TransientGlobalSelfAttention",  # LongT5's encoder blocks
          "multi_head_attention")  # CTRL
# A layer's mixer that is not softmax attention, named for what it is: where a layer has one beside
# attention (Falcon-H1's mamba and self_attn, summed), the layer is a state-space one (mixers.py).
RECURRENT_MIXERS = ("linear_attn", "mamba", "conv", "mlstm_layer", "mamba_decoder")
MLP_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward", "ffn", "fc2",  # MPT; OPT's MLP ends in the layer's fc2
              "mlp_block",  # RecurrentGemma
              "DenseReluDense",  # T5's family (Switch Transformers': `mlp`), inside its last sublayer
              "shared_mlp")  # Granite-MoE hybrid's dense layers (no `block_sparse_moe`)
# A dense MLP beside a layer's MoE block whose output the layer adds to the block's (Granite-MoE
# shared, hybrid and SWA: `block_sparse_moe(x) + shared_mlp(x)`): recorded as `layer<i>_shared_mlp`.
SHARED_MLPS = ("shared_mlp",)
# A shared expert inside an MoE block, which every token runs and whose output the block adds to the
# routed experts' (Qwen2-MoE's and Qwen3-Next's `shared_expert`, the DeepSeek family's, GLM-4-MoE's
# and ERNIE 4.5's `shared_experts`, Hunyuan V1's `shared_mlp`): recorded as `layer<i>_shared_mlp`.
SHARED_EXPERTS = ("shared_expert", "shared_experts", "shared_mlp")
# The decoder layers' list (`layers`; the GPT-2 family's `h`, MPT's `blocks`, T5's `block`; a
# `ModuleDict` keyed by layer index too: torchtitan's, mistral-inference's).
LAYER_LISTS = ("layers", "h", "blocks", "block",
               "layer")  # BERT's family: `<model>.encoder.layer` (its embedding beside the `encoder`: hf_ends)
# T5's family (T5, mT5, UMT5, LongT5, Switch Transformers, Pop2Piano, UDOP) keeps a block's parts in
# a ModuleList `layer` of sublayers, each of which normalises its input, runs one part (`SelfAttention`,
# `EncDecAttention`, `DenseReluDense` or Switch's `mlp`) and adds the residual stream back.
SUBLAYERS = "layer"
ROUTERS = ("gate", "router")  # the MoE block's router: Qwen/Mixtral/DeepSeek, gpt-oss/Granite
# MoE blocks whose router follows no convention here (torchtitan's `moe`: top scores and ids, no
# logits): not tapped, warned about.
UNREAD_MOE_BLOCKS = ("moe",)
# A sparse-attention indexer inside the attention module (DeepSeek-V3.2, GLM-MoE-DSA, ...): it picks
# the keys each query attends to, by the top-k of an index score.
INDEXERS = ("indexer",)
# Where the residual stream after attention is a module's input. Pre-norm layers (Llama, Qwen,
# Mixtral) normalise it in post_attention_layernorm (ffn_norm, pre_ff_layernorm: other names);
# sandwich-norm layers (Gemma 2/3) use post_attention_layernorm on the attention output before the
# residual add and pre_feedforward_layernorm after it; post-norm layers (OLMo 2, EXAONE 4: a
# post_feedforward_layernorm and no norm before the MLP) feed it to the MLP block itself. The GPT-2
# family's is ln_2 (MPT's norm_2, Apertus' feedforward_layernorm); GPT-J, CodeGen, Phi and Falcon's
# new layers have none (attention and MLP read the same input).
_MLP_NORMS = ("pre_feedforward_layernorm", "pre_ff_layernorm", "ffn_norm", "pre_mlp_layernorm",  # AFMoE
              "ln_2", "norm_2", "feedforward_layernorm",  # the GPT-2 family, MPT, Apertus
              "channel_pre_norm", "norm_ffn", "ln2", "mlp_norm",  # RecurrentGemma, xLSTM, RWKV, ModernBERT-decoder
              "ln", "LayerNorm", "layernorm2",  # MegatronBERT, XLM-RoBERTa-XL, CTRL
              # BERT's family: `intermediate` (the MLP's up projection) reads the stream after
              # (self-, cross-)attention, post-norm in BERT; RoBERTa-PreLayerNorm normalises it inside
              "intermediate")


def child(module: torch.nn.Module, names: tuple[str, ...]) -> str | None:
    """The first of `names` that is a submodule of `module` that runs (not a ModuleList or
    ModuleDict, whose hooks never fire: LongCat-Flash keeps two norms in a list), or None."""
    return next((name for name in names if isinstance(getattr(module, name, None), torch.nn.Module)
                 and not isinstance(getattr(module, name), (torch.nn.ModuleList, torch.nn.ModuleDict))), None)


def part(layer: torch.nn.Module, names: tuple[str, ...]) -> str | None:
    """The path, relative to `layer`, of its first child among `names` (`child`), else of one inside
    a sublayer of a T5 block (`layer.2.DenseReluDense`), else None."""
    if (name := child(layer, names)) is not None:
        return name
    sublayers = getattr(layer, SUBLAYERS, None)
    for k, sublayer in enumerate(sublayers if isinstance(sublayers, torch.nn.ModuleList) else ()):
        if (name := child(sublayer, names)) is not None:
            return f"{SUBLAYERS}.{k}.{name}"
    return None


def mlp_block(layer: torch.nn.Module) -> str | None:
    """The path, relative to `layer`, of the module whose output is its MLP's own (MLP_BLOCKS, in
    a T5 block's sublayer too); in BERT's family, whose `output` adds the residual (and normalises
    the sum), the down projection `output.dense` (after `intermediate`); else None."""
    if (name := part(layer, MLP_BLOCKS)) is not None:
        inner = layer.get_submodule(name)
        # Pix2Struct's `mlp`, as a T5 sublayer, normalises, runs its DenseReluDense and adds the residual
        return f"{name}.DenseReluDense" if child(inner, ("DenseReluDense",)) is not None else name
    bert_style = child(layer, ("intermediate",)) and isinstance(getattr(layer, "output", None), torch.nn.Module)
    return "output.dense" if bert_style and isinstance(getattr(layer.output, "dense", None), torch.nn.Module) else None


def real_layers(layers) -> list[tuple[int, torch.nn.Module]]:
    """(index, layer) of the decoder layers this process runs (a pipeline stage's share)."""
    return [(i, layer) for i, layer in enumerate(layers) if not placeholder(layer)]


def indexer_of(mixer: torch.nn.Module) -> str | None:
    """The path, relative to the token mixer, of its sparse-attention indexer: a child `indexer`,
    or one a level further down (DeepSeek-V4's `compressor.indexer`); else None."""
    return next((name for name, _ in mixer.named_modules()
                 if name.split(".")[-1] in INDEXERS and name.count(".") <= 1), None)


def holds_experts(block) -> bool:
    return isinstance(getattr(block, "experts", None), torch.nn.Module)


def routes_tokens(block) -> bool:
    """An MoE block: it holds `experts`, or says how many experts a token gets (Doge's product-key
    MoE keeps its experts as embeddings and a `top_k`)."""
    return holds_experts(block) or int_attr((block,), ("top_k", "num_experts_per_tok")) is not None


def router_like_children(block: torch.nn.Module) -> list[str]:
    """The names of `block`'s children that look like a router under another name (`router_gate`)."""
    return [name for name, _ in block.named_children() if "router" in name or "gating" in name]


def last_projection(block: torch.nn.Module) -> str | None:
    """The name of `block`'s last direct `Linear` child (Bloom's `dense_4h_to_h`, MPT's
    `down_proj`), or None."""
    return next((name for name, module in reversed(list(block.named_children()))
                 if isinstance(module, torch.nn.Linear)), None)


def residual_after_attention(layer: torch.nn.Module, block_name: str | None, cross: bool = False) -> str | None:
    """The path, relative to `layer`, of the module whose input is the residual stream after
    attention (see _MLP_NORMS; a child, or DBRX's norm inside its `norm_attn_norm`), or None when
    the layer's structure does not say. `cross`: the layer is an encoder-decoder's decoder layer,
    whose cross-attention runs (a standalone Bart or TrOCR decoder skips it, and its norm)."""
    if block_name is not None and (block_name.startswith(f"{SUBLAYERS}.") or block_name.endswith(".DenseReluDense")):
        return block_name.rpartition(".")[0]  # T5, Pix2Struct: the MLP's sublayer reads the stream after attention
    if getattr(layer, "use_parallel_residual", False) is True:
        return None  # GPT-NeoX: its post_attention_layernorm reads the layer's input, beside attention
    wrapper = getattr(layer, "norm_attn_norm", None)
    if isinstance(wrapper, torch.nn.Module) and child(wrapper, ("norm_2",)) is not None:
        return "norm_attn_norm.norm_2"  # DBRX: norm_2 normalises the sum after attention, inside the wrapper
    children = [name for name, _ in layer.named_children()]
    if {"attn", "ln_1"} <= set(children) and children.index("ln_1") > children.index("attn"):
        return "ln_1"  # GPT-1's post-norm block: ln_1 normalises the sum after attention, ln_2 after the MLP
    if isinstance(before := getattr(layer, "do_layer_norm_before", None), bool):
        # OPT: pre-norm layers normalise the stream before fc1 in the layer's final_layer_norm;
        # post-norm ones (OPT-350m) normalise the sum after attention in self_attn_layer_norm
        return child(layer, ("final_layer_norm",) if before else ("self_attn_layer_norm",))
    if (norm := child(layer, _MLP_NORMS)) is not None:
        return norm
    if cross and (attention := child(layer, CROSS_ATTENTIONS)) and (norm := _norm_called_after(layer, attention)):
        return norm  # an encoder-decoder's decoder layer: the stream after self- and cross-attention
    if child(layer, ("post_feedforward_layernorm",)) is not None:
        return block_name  # post-norm: the MLP block reads the residual stream itself
    return child(layer, ("post_attention_layernorm",))


# A decoder layer's attention to the encoder's output (Bart's family and Whisper; NLLB-MoE, SeamlessM4T;
# ProphetNet, Mllama's cross-attention layers; T5's family, in a sublayer).
CROSS_ATTENTIONS = ("encoder_attn", "cross_attention", "cross_attn", "EncDecAttention")
_NORM_CALL = re.compile(r"self\.(\w*norm\w*)\(")


def _norm_called_after(layer: torch.nn.Module, cross: str) -> str | None:
    """The child norm `layer`'s forward calls first after its cross-attention `cross`: it reads the
    sum after the cross-attention, before the MLP (the final_layer_norm of a pre-norm layer: mBART,
    Whisper; the encoder_attn_layer_norm of a post-norm one: Bart, Marian, whose code orders the
    same children otherwise, with no flag that says which), or None where the source cannot tell."""
    try:
        source = inspect.getsource(type(layer).forward)
    except (OSError, TypeError):
        return None
    at = source.find(f"self.{cross}(")
    match = _NORM_CALL.search(source, at) if at >= 0 else None
    return match.group(1) if match and child(layer, (match.group(1),)) is not None else None


def find_layers(modules: dict[str, torch.nn.Module]):
    """The decoder's `layers` among `modules` (the model's `named_modules()`), as (path, list of layers),
    or (None, None). A vision-language model also has a vision encoder's `layers` (Llava, Gemma 3,
    Llama 4, Idefics 3), often first in module order: the language model's are the ones beside a
    token embedding (`embed_tokens`), which vision encoders do not have; of an encoder-decoder's
    two such lists, the decoder's. A list named `layers` is preferred to an `h` or `blocks` (a
    vision encoder's `blocks` of `attn`: Qwen2-VL's); of two BERT-style stacks (`layer`), one under
    a `*decoder` part (BLIP's question answering: `text_encoder` and `text_decoder`)."""
    found = sorted(_layer_lists(modules), key=lambda item: (LAYER_LISTS.index(item[0].rpartition(".")[2]),
                                                            item[0].endswith(".layer") and not _decoder_parts(item[0])))
    beside = _beside_embeddings(found, modules)
    if is_encoder_decoder(modules.get("")) and (decoders := [item for item in beside + found if _decoder_parts(item[0])]):
        # Generation runs the decoder at every step, the encoder once per request (Bart, Marian,
        # SeamlessM4T's text_decoder, SpeechT5's wrapped_decoder): the decoder's layers, wherever
        # they sit in module order and with a token embedding beside them or not
        return decoders[0]
    return (beside or found or [(None, None)])[0]


def _decoder_parts(path: str) -> list[str]:
    """The prefixes of `path` that end in a decoder module (`model.decoder`, `text_decoder`,
    `speecht5.decoder.wrapped_decoder`), innermost first."""
    parts = path.split(".")
    return [".".join(parts[:n + 1]) for n in reversed(range(len(parts))) if parts[n].endswith("decoder")]


def other_token_stacks(modules: dict[str, torch.nn.Module], taken: str, encoder: str | None = None) -> list[str]:
    """The paths of layer lists beside a token embedding other than `taken`: a text encoder's
    and a decoder's (Bart, DiffusionGemma), of which `find_layers` takes the first. A BERT-style
    stack (its embedding beside its `encoder`, not beside the list) counts only inside the
    encoder-decoder's `encoder` (BERT2GPT-2's): InstructBLIP's Q-Former is one too, and no
    stack to compare instead of its language model's."""
    return [name for name, _ in _beside_embeddings(_layer_lists(modules), modules) if name != taken
            and (ends.embedding_parent(name, modules) == name.rpartition(".")[0]
                 or (encoder is not None and name.startswith(f"{encoder}.")))]


def _layer_lists(modules: dict[str, torch.nn.Module]) -> list[tuple[str, list]]:
    """Every list named as LAYER_LISTS (`_by_index`) whose modules each have a token mixer (a pipeline
    stage's: those it runs, the others placeholders), at least one."""
    return [(name, layers) for name, module in modules.items()
            if name.rpartition(".")[2] in LAYER_LISTS and (layers := _by_index(module)) is not None
            and (ran := real_layers(layers))
            and all(any(hasattr(layer, mixer) for mixer in MIXERS) or part(layer, MIXERS) for _, layer in ran)]


def _by_index(module) -> list | None:
    """A layer list's modules by layer index: a ModuleList's; a ModuleDict's keyed "0", "1", ...
    (torchtitan's, whose pipeline stages drop the other stages' keys: a placeholder stands for
    each); None for anything else."""
    if isinstance(module, torch.nn.ModuleList):
        return list(module)
    if not isinstance(module, torch.nn.ModuleDict) or not module or not all(key.isdigit() for key in module):
        return None
    held = {int(key): layer for key, layer in module.items()}
    return [held.get(i, torch.nn.Identity()) for i in range(max(held) + 1)]


def _beside_embeddings(found: list, modules: dict[str, torch.nn.Module]) -> list:
    return [(name, module) for name, module in found if ends.embedding_parent(name, modules) is not None]



def encoder_path(layers_path: str | None, modules: dict) -> str | None:
    """An encoder-decoder's encoder: the module its `get_encoder()` returns (T5's `encoder`, whose
    layers `find_layers` does not find), else the one beside the decoder whose layers are at
    `layers_path` (`model.encoder` beside `model.decoder`, SeamlessM4T's `speech_encoder` or
    `text_encoder` beside its `text_decoder`, SpeechT5's `encoder` beside the `decoder` that wraps
    its decoder), or None."""
    get = getattr(modules[""], "get_encoder", None)
    try:
        encoder = get() if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        encoder = None
    if isinstance(encoder, torch.nn.Module) and (path := ends.path_of(encoder, modules)):
        return path
    for decoder in _decoder_parts(layers_path or ""):
        parent = decoder.rpartition(".")[0]
        siblings = [path for path in modules if path.rpartition(".")[0] == parent and path != decoder
                    and path.rpartition(".")[2].endswith("encoder")]
        if siblings:
            return siblings[0]
    return None


def consecutive(path: str, modules: dict) -> range:
    """0..n-1 for the longest run of `path.format(i=...)` from 0 that names modules (a pattern
    such as `transformer.blocks.{i}` in an explicit tap, where no `layers` list is found)."""
    n = 0
    while path.format(i=n) in modules:
        n += 1
    return range(n)


def mixer_for_kind(layer: torch.nn.Module) -> str | None:
    """The child that says what kind of token mixer `layer` is (mixers.kinds_of): a recurrent one
    where the layer has one beside attention (Falcon-H1), else its mixer (MIXERS)."""
    return child(layer, RECURRENT_MIXERS) or part(layer, MIXERS)
