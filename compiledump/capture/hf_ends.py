"""What sits around a Hugging Face decoder's layer stack: the token embedding before it, the final
norm and the head after it, and the base model that runs it (the module names `instrument()` looks
for beside the layers capture/hf_layout.py finds); and the placeholders a pipeline-parallel stage
keeps for the modules other stages hold. This module only finds modules; instrument.py hooks them.
"""

from __future__ import annotations

import torch

# The token embedding beside the layers: Llama's `embed_tokens`, GPT-2's `wte`, GPT-NeoX's `embed_in`,
# Falcon's and Bloom's `word_embeddings`, GPT-1's `tokens_embed`, Meta's reference code's, gpt-fast's
# and torchtitan's `tok_embeddings`, DeepSeek's reference code's `embed`; Mamba's, RWKV's, xLSTM's and
# Nemotron-H's `embeddings` and CTRL's `w`, counted only as an `nn.Embedding` (_LOOKUPS_ONLY: a vision
# encoder's `embeddings` are patch embeddings); ModernBERT-decoder's and BERT's `embeddings` hold the
# lookup (`tok_embeddings`, `word_embeddings`).
TOKEN_EMBEDDINGS = ("embed_tokens", "wte", "embed_in", "word_embeddings", "tokens_embed", "tok_embeddings", "embed",
                    "embeddings", "w")
_LOOKUPS_ONLY = ("embeddings", "w")
# Names other code bases also give modules that are no lookup (Xcodec2's `embed` is a Conv1d): counted
# only as a lookup table (_lookup_table).
_TABLES_ONLY = ("tok_embeddings", "embed")
# Beside `layers`: most models, Jamba/Falcon-H1, Nemotron-H, LFM2 (whose final norm is embedding_norm),
# Qwen4-Exp (whose hyper-connection streams end in a mixer, not a norm).
FINAL_NORMS = ("norm", "final_layernorm", "norm_f", "embedding_norm", "hyper_connection_mixer",
               "ln_f", "final_layer_norm",  # the GPT-2 family; GPT-NeoX, OPT
               "layer_norm",  # Kosmos-2's text decoder
               "ln_out", "final_norm", "out_norm",  # RWKV, RecurrentGemma, xLSTM
               "layernorm", "ln", "LayerNorm")  # CTRL, MegatronBERT, XLM-RoBERTa-XL
# A head under no name transformers gives it, beside the layers: Meta's reference code's, gpt-fast's
# and older torchtitan's `output`, DeepSeek's reference code's `head` (taken where its 2-D weight has
# as many rows as the token embedding: not a value head or a projection).
_BARE_HEADS = ("output", "head")


def placeholder(module) -> bool:
    """Whether `module` stands in for one this process does not hold: a pipeline-parallel engine's
    (vLLM's `PPMissingLayer`, an `nn.Identity`) for the layers, embedding, final norm and head of
    the other stages. It records nothing of the model's."""
    return isinstance(module, torch.nn.Identity)


def _dropped(parent, name: str) -> bool:
    """Whether `parent`'s child `name` stands for one another pipeline stage holds: a placeholder,
    or set to None (torchtitan's stages drop their `tok_embeddings`, `norm` and `output`)."""
    held = name in getattr(parent, "_modules", {}) or name in getattr(parent, "__dict__", {})
    return (held and getattr(parent, name) is None) or placeholder(getattr(parent, name, None))


def held_elsewhere(layers_path: str, modules: dict) -> set[str]:
    """The model-level tags ("logits", "input_token") whose module is a placeholder here, or None
    (`_dropped`): a pipeline stage's head or token embedding, which another stage holds."""
    parent = modules.get(layers_path.rpartition(".")[0])
    found = set()
    if any(path.rpartition(".")[2] == "lm_head" and placeholder(module) for path, module in modules.items()) \
            or any(_dropped(parent, name) for name in ("lm_head", *_BARE_HEADS)):
        found.add("logits")
    if any(_dropped(parent, name) for name in TOKEN_EMBEDDINGS):
        found.add("input_token")
    return found


def embedding_parent(layers_path: str, modules: dict) -> str | None:
    """The path of the module that holds the token embedding of the layers at `layers_path`: their
    parent (`model` beside `model.layers`), or in BERT's family the parent's parent (`bert` of
    `bert.encoder.layer`, whose `embeddings` sit beside the `encoder`); None where neither does."""
    parent = layers_path.rpartition(".")[0]
    if _token_embedding_of(modules[parent]) is not None:
        return parent
    if parent.rpartition(".")[2] == "encoder" and (above := parent.rpartition(".")[0]) in modules \
            and ".".join(filter(None, (above, "embeddings", "word_embeddings"))) in modules:
        return above
    return None


def _token_embedding_of(parent: torch.nn.Module) -> str | None:
    """The name (relative to `parent`) of its token embedding (TOKEN_EMBEDDINGS), or None."""
    for name in TOKEN_EMBEDDINGS:
        module = getattr(parent, name, None)
        if not isinstance(module, torch.nn.Module) or placeholder(module):
            continue
        if name in _TABLES_ONLY and not _lookup_table(module):
            continue
        if name not in _LOOKUPS_ONLY or isinstance(module, torch.nn.Embedding):
            return name
        for lookup in ("tok_embeddings", "word_embeddings"):  # ModernBERT-decoder's, BERT's: the lookup, a norm, ...
            if name == "embeddings" and isinstance(getattr(module, lookup, None), torch.nn.Embedding):
                return f"{name}.{lookup}"
    return None


def _lookup_table(module: torch.nn.Module) -> bool:
    """An `nn.Embedding`, or a module that says how many rows its 2-D weight holds (Meta's and
    DeepSeek's vocabulary-parallel embeddings: `num_embeddings`, `vocab_size`)."""
    if isinstance(module, torch.nn.Embedding):
        return True
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and not isinstance(module, torch.nn.Linear) \
        and any(isinstance(getattr(module, name, None), int) for name in ("num_embeddings", "vocab_size"))


def _vocabulary_rows(layers_path: str, modules: dict) -> int | None:
    """The rows of the token embedding beside the layers (a shard's, under tensor parallelism), or None."""
    path = token_embedding_path(layers_path, modules)
    weight = getattr(modules[path], "weight", None) if path is not None else None
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _beside(path: str, names, modules: dict) -> str | None:
    """The path of the first of `names` that is a module beside `path` (its sibling), or None."""
    parent = path.rpartition(".")[0]
    return next((path for path in (f"{parent}.{name}" if parent else name for name in names)
                 if path in modules and not placeholder(modules[path])), None)


def final_norm_path(layers_path: str, modules: dict) -> str | None:
    """The final norm beside `layers` (FINAL_NORMS), or None."""
    return _beside(layers_path, FINAL_NORMS, modules)


def token_embedding_path(layers_path: str, modules: dict) -> str | None:
    """The token embedding beside `layers` (TOKEN_EMBEDDINGS: its input is the token ids a forward
    feeds), or None."""
    parent = embedding_parent(layers_path, modules)
    name = None if parent is None else _token_embedding_of(modules[parent])
    return None if name is None else f"{parent}.{name}" if parent else name


def base_model_path(layers_path: str, modules: dict) -> str:
    """The base model the layers at `layers_path` run in, whose forward takes the token ids and the
    2-D attention mask: the holder of their token embedding, else their parent."""
    parent = embedding_parent(layers_path, modules)
    return layers_path.rpartition(".")[0] if parent is None else parent


def logits_path(modules: dict, layers_path: str = "") -> str | None:
    """The module whose output is the logits: the `Linear` the model's `get_output_embeddings()`
    returns (a transformers model's head under any name: RWKV's `head`, BioGPT's
    `output_projection`, ModernBERT-decoder's `decoder`, whose `lm_head` is a prediction head before
    it), else the model's own lm_head, else the nearest nested one (Llama 4's multimodal class holds
    language_model.lm_head), else an `embed_out` (GPT-NeoX Japanese), else what a model around the
    layers at `layers_path` says (BLIP's `text_decoder`, whose head `cls.predictions.decoder` its
    outer model does not name), else an `output` or `head` beside the layers whose 2-D weight has as
    many rows as the token embedding (Meta's reference code, gpt-fast, DeepSeek's reference code; not a
    value head or a projection); where a `logits_processor`
    sits beside it (vLLM, SGLang), that one: their lm_head only holds the weight the processor
    reads (calling it is an error)."""
    head = _output_embeddings(modules)
    if head is None:
        head = "lm_head" if "lm_head" in modules else next((p for p in modules if p.endswith(".lm_head")), None)
        head = head or ("embed_out" if "embed_out" in modules else None)
    parts = layers_path.split(".")[:-1]
    for holder in (".".join(parts[:n]) for n in range(1, len(parts) + 1)):
        head = head or _output_embeddings(modules, holder)
    bare = _beside(layers_path, _BARE_HEADS, modules) if layers_path else None
    weight = getattr(modules[bare], "weight", None) if bare is not None else None
    if head is None and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
            and weight.shape[0] == _vocabulary_rows(layers_path, modules):  # (not a value or projection head)
        head = bare
    if head is not None and placeholder(modules[head]):
        return None  # a pipeline stage without the head
    return None if head is None else _beside(head, ("logits_processor",), modules) or head


def _output_embeddings(modules: dict, holder: str = "") -> str | None:
    """The path of the `Linear` the `get_output_embeddings()` of the model (or of its module at
    `holder`) returns (a transformers model's head under any name), or None (not a `Linear`: a head
    that reuses another module's weight is not hooked through it)."""
    get = getattr(modules[holder], "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError):  # a model that does not say
        return None
    return path_of(head, modules) if isinstance(head, torch.nn.Linear) else None


def path_of(module: torch.nn.Module, modules: dict) -> str | None:
    """The path of `module` among the model's `modules` (not the model itself), or None."""
    return next((path for path, candidate in modules.items() if path and candidate is module), None)
