"""Corpora made from this interpreter's standard library, for examples, tests and benchmarks.

`stdlib_chat_rows`: chat rows from the standard library's documented functions, the docstring as the user's
question and the function's source (docstring left out) as the assistant's answer. Deterministic for a given
Python: modules and functions are visited in sorted order.

    python -m meshkd.bench.corpora OUT.jsonl [--rows N]   # writes such rows as JSONL ({"messages": [...]})
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch


def stdlib_token_rows(tokenizer, rows: int, sequence: int, samples: int) -> list[torch.Tensor]:
    """`samples` batches [rows, sequence + 1] of token ids from standard-library sources, in file order."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    needed = samples * rows * (sequence + 1)
    stream: list[int] = []
    for path in files:
        stream.extend(tokenizer(path.read_text(errors="replace"))["input_ids"])
        if len(stream) >= needed:
            break
    ids = torch.tensor(stream[:needed]).view(samples, rows, sequence + 1)
    return list(ids)


def stdlib_chat_rows(*, max_rows: int | None = None, max_answer_chars: int = 1200,
                     modules: str = "*.py") -> Iterator[dict]:
    """{"messages": [user: "Write ...", assistant: the function]} for each documented top-level function."""
    count = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob(modules)):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            docstring = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if not docstring or len(node.body) < 2:
                continue
            header = lines[node.lineno - 1].strip()
            body = "\n".join(lines[node.body[1].lineno - 1 : node.end_lineno])
            answer = f"{header}\n{body}"[:max_answer_chars]
            question = f"Write the function `{node.name}` of Python's `{path.stem}` module:\n{docstring}"
            yield {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
            count += 1
            if count == max_rows:
                return


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write chat rows made from the standard library as JSONL.")
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=None)
    args = parser.parse_args(argv)
    with open(args.out, "w") as sink:
        for row in stdlib_chat_rows(max_rows=args.rows):
            sink.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
