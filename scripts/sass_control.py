"""Which sm_90 SASS instruction waits for which earlier memory operation, from the control bits
cuobjdump prints with each instruction (scripts/kernel_ptx.py and scripts/native_kernel_sass.py).

Since Volta, each 128-bit instruction carries its own scheduling: a variable-latency instruction
(a global load, an atomic with a reply) sets one of six scoreboards when it issues and clears it
when its result arrives, and an instruction that needs the result lists that scoreboard in its
wait mask. In the instruction's high 64-bit word (the second hex word cuobjdump prints), bits 46-48
are the write scoreboard set (7: none) and bits 52-57 the mask of scoreboards waited on (the
layout of Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018,
which sm_90 code still follows: a load's scoreboard is the one its first consumer waits on).

So "the payload's loads are in flight while the claim is" reads: between the first payload load
and the claim's atomic, no instruction waits on the load's scoreboard.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/")
_HIGH_WORD = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")


class Instruction(NamedTuple):
    address: int
    text: str  # the instruction, predicate and operands
    sets: int | None  # the scoreboard it sets (None: none)
    waits: frozenset[int]  # the scoreboards it waits on before issuing


def parse(sass: str) -> list[Instruction]:
    """The instructions of `sass` (cuobjdump -sass output, one kernel or several) in order."""
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        found = _INSTRUCTION.search(line)
        high = _HIGH_WORD.match(lines[i + 1])
        if found and high:
            word = int(high.group(1), 16)
            sets = (word >> 46) & 7
            out.append(Instruction(int(found.group(1), 16), found.group(2),
                                   None if sets == 7 else sets,
                                   frozenset(b for b in range(6) if (word >> (52 + b)) & 1)))
    return out


def in_flight_through(code: list[Instruction], load: str, atomic: str) -> bool | None:
    """Whether the first instruction matching `load` (a regex) issues before the first matching
    `atomic` and nothing in between, the atomic included, waits on its scoreboard; None where
    either is missing or the atomic comes first."""
    first_load = next((i for i, ins in enumerate(code) if re.search(load, ins.text)), None)
    first_atomic = next((i for i, ins in enumerate(code) if re.search(atomic, ins.text)), None)
    if first_load is None or first_atomic is None or first_atomic < first_load:
        return None
    board = code[first_load].sets
    return board is not None and not any(board in ins.waits for ins in code[first_load + 1 : first_atomic + 1])
