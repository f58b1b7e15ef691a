"""Code in README.md and docs/**/*.md: fenced ```python blocks and shell command lines
(fenced bash/sh blocks and 4-space indented blocks). tests/test_docs.py runs them.

A block may be preceded (within two lines) by an HTML comment that says how to treat it:
``<!-- not-run: REASON -->`` (the test skips it and reports REASON) or
``<!-- example: PATH -->`` (the block is an excerpt of PATH, which a test runs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!--\s*(not-run|example):\s*(.*?)\s*-->")
# first words of a line that is a command (after NAME=value environment assignments)
PROGRAMS = ("cppo-megatron", ".venv/bin/cppo-megatron", ".venv-vllm/bin/cppo-megatron", ".venv-bridge/bin/cppo-megatron",
            "python",
            ".venv/bin/python", ".venv-vllm/bin/python", "bash", "pip", "grep", "torchrun")


@dataclass(frozen=True)
class Snippet:
    doc: str  # path relative to the repository root
    line: int  # 1-based line of the code's first line
    kind: str  # "python" or "shell"
    text: str  # the code (python) or one command line, continuations joined (shell)
    marker: tuple[str, str] | None  # ("not-run", reason) / ("example", path) / None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _marker(lines: list[str], start: int):
    for back in (1, 2):
        if start - back >= 0:
            m = MARKER.search(lines[start - back])
            if m:
                return m.group(1), m.group(2)
    return None


def _commands(doc: str, block: list[tuple[int, str]], marker) -> list[Snippet]:
    out, pending, first = [], "", 0
    for lineno, raw in block:
        line = raw.strip()
        if not pending:
            first = lineno
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        text = (pending + line).strip()
        pending = ""
        words = text.split()
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words and words[0] in PROGRAMS:
            out.append(Snippet(doc, first, "shell", text, marker))
    return out


def snippets() -> list[Snippet]:
    found: list[Snippet] = []
    for path in docs():
        rel = str(path.relative_to(ROOT))
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            fence = re.match(r"^\s*```(\w*)", line)
            if fence:
                lang, start = fence.group(1), i
                body: list[tuple[int, str]] = []
                i += 1
                while i < len(lines) and not lines[i].strip().startswith("```"):
                    body.append((i + 1, lines[i]))
                    i += 1
                marker = _marker(lines, start)
                if lang == "python":
                    found.append(Snippet(rel, start + 2, "python", "\n".join(t for _, t in body) + "\n", marker))
                elif lang in ("bash", "sh", "shell", "console", ""):
                    found += _commands(rel, body, marker)
                i += 1
                continue
            # an indented block: 4 spaces after a blank line (not a list continuation)
            if line.startswith("    ") and i > 0 and not lines[i - 1].strip():
                start = i
                body = []
                while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                    if lines[i].strip():
                        body.append((i + 1, lines[i]))
                    i += 1
                found += _commands(rel, body, _marker(lines, start - 1))
                continue
            i += 1
    return found
