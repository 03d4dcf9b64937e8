"""What a Hugging Face model's config says about its shape beyond the decoder's layers: whether it
is an encoder-decoder, and whether a vision or audio tower feeds features into its token
embeddings. capture/hf_layout.py finds the modules; this module reads only configs."""

from __future__ import annotations

import torch


def is_encoder_decoder(model) -> bool:
    """Whether `model`'s config (or a sub-config of it: Florence-2's text model) says it is an
    encoder-decoder."""
    return any(getattr(c, "is_encoder_decoder", False) is True for c in _configs(model))


def _configs(model) -> list:
    """`model`'s config and its sub-configs (a config without __dict__, a dict or a named tuple of a
    custom model, has none)."""
    config = getattr(model, "config", None)
    return [config, *(value for value in getattr(config, "__dict__", {}).values() if hasattr(value, "to_dict"))]


# A composite model's config names the tower whose features it merges into the token embeddings;
# beside a `text_config`, a tower may go by its role (Granite Speech's `encoder_config`, VibeVoice's
# `semantic_tokenizer_encoder_config`); an omni model's sits in its thinker's config.
TOWER_CONFIGS = ("vision_config", "audio_config", "speech_config", "visual_config")
_TOWER_ROLES = ("encoder_config",)


def has_tower(model: torch.nn.Module) -> bool:
    """Whether features of another input (an image, audio) may enter the decoder beside the token
    embeddings: the model's config (or a sub-config of it: an omni model's thinker) names a vision
    or audio tower. (Not any second layer list: BLT's and HRM's text stacks would count.)"""
    return any(_names_tower(c) for c in _configs(model))


def _names_tower(config) -> bool:
    if any(getattr(config, name, None) is not None for name in TOWER_CONFIGS):
        return True
    return getattr(config, "text_config", None) is not None and any(
        value is not None and name.endswith(_TOWER_ROLES) for name, value in getattr(config, "__dict__", {}).items())
