"""Instrument your own model: a few capture calls, no hooks, works compiled.

    COMPILEDUMP_DIR=/tmp/mydump python examples/instrument_your_model.py
    compiledump inspect /tmp/mydump

Without COMPILEDUMP_DIR every capture call is a no-op that adds nothing to the compiled graph.
"""

import os
import tempfile

import torch

import compiledump


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, i):
        x = x + torch.tanh(self.proj(x))
        compiledump.record(f"layer{i}", x)  # keeps the last row (the position being generated)
        return x


class MyModel(torch.nn.Module):
    def __init__(self, dim=32, layers=4, vocab=100):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, decode=False):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, i)
        logits = self.head(x)
        if decode:
            compiledump.record_step("logits", logits)  # logits_0, logits_1, ... (row 0)
        else:
            compiledump.record("logits", logits, once=True)
        return logits


def main():
    if not compiledump.get_config().active:  # let the example run as is
        compiledump.configure(dir=os.environ.get("COMPILEDUMP_DIR") or tempfile.mkdtemp(prefix="mydump-"))
    torch.manual_seed(0)
    model = torch.compile(MyModel(), fullgraph=True)
    with torch.no_grad():
        model(torch.randint(0, 100, (9,)))  # prefill
        for _ in range(5):
            model(torch.randint(0, 100, (1,)), decode=True)
    path = compiledump.flush()
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
