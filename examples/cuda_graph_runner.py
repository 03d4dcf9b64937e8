"""Wrap a CUDA-graph decode runner the way vLLM and SGLang do, with dumps.

The rules (docs/compiling.md): create the arena before any capture (`compiledump.init`), warm up
and capture under `compiledump.profiling()` (capture records the capture kernels but nothing is
written while the device flag is off), then replay for real steps with capture enabled. Settings
that differ per step (rows for the gate, the row to gather) are set outside the graph; the
kernels read them on every replay.

    COMPILEDUMP_DIR=/tmp/graphdump python examples/cuda_graph_runner.py

On a machine without CUDA the same runner runs its steps eagerly, so the flow can be tried
anywhere; on CUDA it captures a real `torch.cuda.CUDAGraph`.
"""

import os
import tempfile

import torch

import compiledump


class DecodeRunner:
    """A fixed-batch decode step: static buffers, one captured graph, replay per step."""

    def __init__(self, model, batch, dim, device):
        self.model = model
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.hidden = torch.zeros(batch, dim, device=device)
        self.graph = None
        if device.type == "cuda":
            self._capture()

    def _step(self):
        logits, hidden = self.model(self.tokens, self.hidden)
        compiledump.record_step("logits", logits)  # row 0: the first real request
        return logits, hidden

    def _capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), compiledump.profiling():  # dummy warm-up writes nothing
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with compiledump.profiling(), torch.cuda.graph(self.graph):
            self.logits, self.next_hidden = self._step()

    def step(self, tokens, hidden, real_rows):
        self.tokens.copy_(tokens)
        self.hidden.copy_(hidden)
        compiledump.set_rows(real_rows)  # outside the graph: the kernel reads it on replay
        if self.graph is None:
            self.logits, self.next_hidden = self._step()
        else:
            self.graph.replay()
        return self.logits.clone(), self.next_hidden.clone()


class TinyDecoder(torch.nn.Module):
    def __init__(self, dim=32, vocab=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.cell = torch.nn.Linear(2 * dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, hidden):
        hidden = torch.tanh(self.cell(torch.cat([self.embed(tokens), hidden], -1)))
        return self.head(hidden), hidden


def main(steps=6):
    if not compiledump.get_config().active:
        compiledump.configure(dir=os.environ.get("COMPILEDUMP_DIR") or tempfile.mkdtemp(prefix="graphdump-"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    compiledump.init(device)  # before any capture: the arena must not come from a graph's pool
    torch.manual_seed(0)
    model = torch.compile(TinyDecoder().to(device), fullgraph=True)
    batch, dim = 4, 32  # one real request padded to a captured batch size of 4
    with torch.no_grad():
        runner = DecodeRunner(model, batch, dim, device)
        hidden = torch.zeros(batch, dim, device=device)
        tokens = torch.randint(0, 64, (batch,), device=device)
        for _ in range(steps):
            logits, hidden = runner.step(tokens, hidden, real_rows=1)
            tokens = logits.argmax(-1)
    path = compiledump.flush()
    print(f"wrote {path} ({'CUDA graph replays' if runner.graph is not None else 'eager steps: no CUDA here'})")
    return path


if __name__ == "__main__":
    main()
