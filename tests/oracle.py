"""An independent label oracle: a small interpreter of rendered task text.

Written from the task descriptions in docs/tasks.md, not from the generators: it reads
the words before the colon and computes what the answer must be.
"""

from __future__ import annotations


def interpret(text: str) -> tuple[str, ...]:
    words = text.split()
    assert words[0] == "<bos>", "sequences start with <bos>"
    assert words.count(":") == 1, "exactly one colon"
    prompt = words[1 : words.index(":")]
    if prompt and prompt[0] == "SET":
        return (prompt[1],)  # the stored bit; nothing later can change it
    if prompt and prompt[0] == "NEED":
        need = int(prompt[1][1:])
        steps = sum(1 for w in prompt[2:] if w == "STEP")
        return ("DONE",) if steps >= need else ("MORE",)
    # multi_register: "R<x> V<v>" pairs; a register's answer is its last value
    regs: dict[str, str] = {}
    i = 0
    while i < len(prompt):
        w = prompt[i]
        if len(w) == 2 and w[0] == "R" and w[1].isupper():
            regs[w] = prompt[i + 1]
            i += 2
        else:
            i += 1
    return tuple(regs[r] for r in sorted(regs))


def overwrites(text: str) -> tuple[int, ...]:
    prompt = text.split()[: text.split().index(":")]
    counts: dict[str, int] = {}
    for w in prompt:
        if len(w) == 2 and w[0] == "R" and w[1].isupper():
            counts[w] = counts.get(w, 0) + 1
    return tuple(counts[r] - 1 for r in sorted(counts))
