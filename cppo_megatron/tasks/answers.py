"""Answer extraction and comparison for math-style completions."""

from __future__ import annotations

import re
from fractions import Fraction

_NUM = r"-?\d[\d,]*(?:\.\d+)?"
_GSM_FINAL = re.compile(r"####\s*(" + _NUM + r")")
_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)
_LAST_NUM = re.compile(_NUM)


def normalize_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5'; '$12' -> '12'; None if ``text`` is not a number."""
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", t):
        return None
    try:
        value = Fraction(t)
    except ValueError:
        return None
    if value.denominator == 1:
        return str(value.numerator)
    return str(float(value))


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def extract_answer(text: str) -> tuple[str | None, bool]:
    """(answer, formatted): from ``<answer>x</answer>``, ``#### x`` or ``\\boxed{x}`` (formatted),
    else the last number in the text (not formatted)."""
    m = _ANSWER_TAG.search(text)
    if m:
        return m.group(1).strip(), True
    m = _GSM_FINAL.search(text)
    if m:
        return m.group(1), True
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, True
    nums = _LAST_NUM.findall(text)
    return (nums[-1] if nums else None), False


def answers_match(predicted: str | None, reference: str) -> bool:
    """Numeric comparison when both sides are numbers, else whitespace-insensitive text."""
    if predicted is None:
        return False
    a, b = normalize_number(predicted), normalize_number(reference)
    if a is not None and b is not None:
        return Fraction(a) == Fraction(b)
    return "".join(predicted.split()) == "".join(reference.split())
