"""One side of a chunked-prefill comparison: a Hugging Face model's prompt run in several forwards
(as vLLM and SGLang run a prompt longer than their chunk), then teacher-forced decode steps, dumped
with `compiledump.instrument`. Shared by tests/compare/test_chunked_prefill.py and
test_prefix_cache.py (a chunked pair must not read as a prefix cache's tail)."""

from __future__ import annotations

from transformers import DynamicCache

from helpers.hf_dump import dump_run
from helpers.hf_example import ex


def run_in_chunks(model, directory, prompt, decode, chunks, before=None, exclude=()) -> str:
    """`before` (a shorter request run first, outside profiling()), then `prompt` in forwards of
    `chunks` tokens, then a forward per `decode` token; `exclude` as `instrument` takes it. Returns
    the dump's path."""
    def run():
        if before is not None:
            model(input_ids=before, use_cache=False)
        cache = DynamicCache(config=model.config)
        start = 0
        for size in chunks:
            model(input_ids=prompt[:, start:start + size], **ex.cache_kwargs(model, cache))
            start += size
        for token in decode:
            model(input_ids=token.view(1, 1), **ex.cache_kwargs(model, cache))

    return dump_run(model, directory, run, exclude=exclude)
