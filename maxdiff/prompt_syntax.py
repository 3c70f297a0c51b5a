"""Prompt weighting syntaxes -> (text, weight) fragments, on the host (no JAX, no torch).

Three syntaxes, chosen per request (``prompt_syntax``):

- ``"a1111"`` (the default everywhere): AUTOMATIC1111's and ComfyUI's emphasis. ``(words)``
  multiplies their weight by 1.1, ``[words]`` divides it by 1.1, ``(words:1.3)`` sets a factor,
  brackets nest (factors multiply), ``\\(`` ``\\)`` ``\\[`` ``\\]`` ``\\\\`` are literal
  characters, and ``BREAK`` (upper case, a word of its own) starts a new 75-token chunk.
  Unlike A1111, an unclosed or unmatched bracket is an error (A1111 closes it silently at the
  end of the prompt), and so is prompt editing / alternation (``[cat:dog:0.5]``, ``[cat|dog]``),
  which schedules prompts over the steps and is not weighting.
- ``"compel"``: the syntax of the ``compel`` library diffusers users use. ``word+`` / ``word++``
  (x1.1 each), ``word-`` (x0.9 each), the same after ``(words)`` or ``"words"``, ``(words)1.3``
  or ``"words"1.3`` (a factor), ``(words).attend(1.3)``; parentheses alone only group;
  ``\\(`` ``\\)`` ``\\"`` ``\\,`` ``\\.`` ``\\+`` ``\\-`` ``\\=`` escape. ``.blend()``,
  ``.and()``, ``.swap()`` and ``withLora()`` are refused with an error that says so.
- ``"none"``: the text as it is (diffusers' meaning), weight 1 everywhere.

:func:`parse` returns the fragments with adjacent equal weights fused (as both tools do); a
fragment whose text is :data:`BREAK` (weight None) is A1111's chunk break. Errors are
:class:`PromptSyntaxError` (a ValueError) that quote the prompt around the problem.
"""

from __future__ import annotations

import re

__all__ = ["SYNTAXES", "DEFAULT_SYNTAX", "BREAK", "PromptSyntaxError", "parse", "syntax_problem"]

SYNTAXES = ("a1111", "compel", "none")
DEFAULT_SYNTAX = "a1111"
BREAK = "BREAK"
EMPHASIS = 1.1  # A1111's ( ) and [ ] factor
PLUS, MINUS = 1.1, 0.9  # compel's + and - bases


class PromptSyntaxError(ValueError):
    """A prompt the chosen syntax cannot read (the message says where and why)."""


def syntax_problem(syntax) -> str | None:
    """Why ``syntax`` is not a prompt syntax (None when it is)."""
    if syntax in SYNTAXES:
        return None
    return f"{syntax!r} is not a prompt syntax; choose one of {', '.join(SYNTAXES)}"


def parse(text: str, syntax: str = DEFAULT_SYNTAX) -> list[tuple[str, float | None]]:
    """``text`` in ``syntax`` -> fused (text, weight) fragments (never empty: an empty prompt
    is ``[("", 1.0)]``)."""
    if (p := syntax_problem(syntax)) is not None:
        raise ValueError(p)
    if syntax == "none":
        return [(text, 1.0)]
    if syntax == "a1111":
        return _fuse(_a1111(text), "")
    return _fuse(_Compel(text).prompt(), " ")


def _fuse(frags: list[tuple[str, float | None]], joiner: str) -> list[tuple[str, float | None]]:
    """Adjacent fragments of equal weight as one (compel joins their words with a space; A1111
    keeps the text as written); a break stays on its own."""
    out: list[tuple[str, float | None]] = []
    for t, w in frags:
        if w is None:
            out.append((t, w))
        elif out and out[-1][1] == w:
            out[-1] = (out[-1][0] + joiner + t, w)
        elif t:
            out.append((t, w))
    return out or [("", 1.0)]


def _where(text: str, i: int) -> str:
    lo, hi = max(0, i - 20), min(len(text), i + 20)
    return f"at character {i + 1}: ...{text[lo:hi]}..."


# ------------------------------------------------------------------------------ A1111
_A1111 = re.compile(r"""
    \\[()\[\]\\]           # an escaped bracket or backslash
  | \\                     # a lone backslash (literal)
  | \(|\[                  # open
  | :\s*([+-]?[.\d]+)\s*\) # :1.3) closes a round bracket with a factor
  | \)|\]                  # close
  | [^\\()\[\]:]+          # text
  | :                      # a colon that is text
""", re.X)
_BREAK = re.compile(r"\s*\bBREAK\b\s*")


def _a1111(text: str) -> list[tuple[str, float | None]]:
    frags: list[list] = []  # [text, weight]
    opened: list[tuple[str, int, int]] = []  # (bracket, first fragment, character)

    def scale(start: int, factor: float) -> None:
        for f in frags[start:]:
            f[1] *= factor

    for m in _A1111.finditer(text):
        tok, factor = m.group(0), m.group(1)
        if tok.startswith("\\") and len(tok) == 2:
            frags.append([tok[1], 1.0])
        elif tok in ("(", "["):
            opened.append((tok, len(frags), m.start()))
        elif factor is not None or tok in (")", "]"):
            want = "[" if tok == "]" else "("
            if not opened or opened[-1][0] != want:
                raise PromptSyntaxError(
                    f"{tok.strip()!r} closes no {want!r} {_where(text, m.start())}; write "
                    f"\\{tok[-1]} for the character itself")
            _, start, at = opened.pop()
            if tok == "]" and any(c in "".join(f[0] for f in frags[start:]) for c in ":|"):
                raise PromptSyntaxError(
                    f"prompt editing or alternation ([a:b:when], [a|b]) is not supported "
                    f"{_where(text, at)}; [words] alone lowers their weight")
            if factor is not None:
                try:
                    value = float(factor)
                except ValueError:
                    raise PromptSyntaxError(
                        f"{factor!r} is not a number {_where(text, m.start())}") from None
                scale(start, value)
            else:
                scale(start, EMPHASIS if tok == ")" else 1 / EMPHASIS)
        else:
            parts = _BREAK.split(tok)
            for k, part in enumerate(parts):
                if k:
                    frags.append([BREAK, None])
                if part:
                    frags.append([part, 1.0])
    if opened:
        bracket, _, at = opened[-1]
        raise PromptSyntaxError(f"{bracket!r} is never closed {_where(text, at)}; close it or "
                                f"write \\{bracket} for the character itself")
    return [(t, w) for t, w in frags]


# ------------------------------------------------------------------------------ compel
_SYNTACTIC = '()",.+-='
_UNSUPPORTED = (".blend(", ".and(", ".add(", ".swap(", "withLora(", "useLora(")


class _Compel:
    """A recursive-descent reader of compel's attention syntax (what its grammar gives for
    weighting; fragments are words with their weights)."""

    def __init__(self, text: str, quoted: bool = False):
        self.text, self.i = text, 0
        self.depth = int(quoted)  # inside a group ',' and '.' are fragments of their own
        for op in _UNSUPPORTED:
            if (k := text.find(op)) >= 0:
                raise PromptSyntaxError(
                    f"compel's {op[:-1]}() is not supported {_where(text, k)}; maxdiff reads "
                    "compel's weights (word+, word-, (words)1.3, .attend())")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.text[j] if j < len(self.text) else ""

    def prompt(self) -> list[tuple[str, float]]:
        out = self.items(top=True)
        if self.i < len(self.text):  # a ')' that closes nothing
            raise PromptSyntaxError(f"')' closes no '(' {_where(self.text, self.i)}; write \\) "
                                    "for the character itself")
        return out

    def items(self, top: bool) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        while self.i < len(self.text):
            c = self.peek()
            if c.isspace():
                self.i += 1
            elif c == ")":
                if top:
                    break
                return out
            elif c == "(" or c == '"':
                inner = self.group()
                w = self.operator(numbers=True)
                out += [(t, wt * w) for t, wt in inner]
            else:
                out += self.word()
        if not top:
            raise PromptSyntaxError(f"'(' is never closed {_where(self.text, len(self.text))}")
        return out

    def group(self) -> list[tuple[str, float]]:
        start = self.i
        if self.peek() == "(":
            self.i += 1
            self.depth += 1
            inner = self.items(top=False)
            self.depth -= 1
            self.i += 1  # the ')'
            return inner
        self.i += 1  # the opening quote
        j = start + 1
        while j < len(self.text) and not (self.text[j] == '"' and self.text[j - 1] != "\\"):
            j += 1
        if j >= len(self.text):
            raise PromptSyntaxError(f"'\"' is never closed {_where(self.text, start)}")
        inner = _Compel(self.text[start + 1:j].replace('\\"', '"'), quoted=True).items(top=True)
        self.i = j + 1
        return inner

    def operator(self, numbers: bool) -> float:
        """The weight operator that follows at once, if any (1 if none): +..., -..., a number
        (after a group only), .attend(x)."""
        rest = self.text[self.i:]
        if m := re.match(r"\++|-+", rest):
            self.i += m.end()
            return (PLUS if m.group(0)[0] == "+" else MINUS) ** m.end()
        if numbers and (m := re.match(r"-?(\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", rest)):
            self.i += m.end()
            return float(m.group(0))
        if m := re.match(r"\.attend\(\s*([^)]*?)\s*\)", rest):
            self.i += m.end()
            arg = m.group(1)
            if re.fullmatch(r"\++|-+", arg):
                return (PLUS if arg[0] == "+" else MINUS) ** len(arg)
            try:
                return float(arg)
            except ValueError:
                raise PromptSyntaxError(f".attend() takes a number or +/- signs, got {arg!r} "
                                        f"{_where(self.text, self.i)}") from None
        return 1.0

    def word(self) -> list[tuple[str, float]]:
        """A word up to whitespace or a bracket, with a trailing + / - run weighting it (a +/-
        inside a word, or followed by more word, is text); escapes become their character."""
        chars: list[str] = []
        while self.i < len(self.text):
            c = self.peek()
            if c.isspace() or c in '()"':
                break
            if self.depth and c in ",.":
                if chars:
                    break
                self.i += 1
                return [(c, 1.0)]
            if c == "\\" and self.peek(1) and self.peek(1) in _SYNTACTIC:
                chars.append(self.peek(1))
                self.i += 2
                continue
            if c in "+-":
                m = re.match(r"\++|-+", self.text[self.i:])
                nxt = self.peek(m.end())
                if chars and (not nxt or nxt.isspace() or nxt in _SYNTACTIC):
                    # a weight for the word so far (compel stops the word at the signs)
                    w = self.operator(numbers=False)
                    return [("".join(chars), w)]
                chars.append(c)
                self.i += 1
                continue
            if c == "." and self.text.startswith(".attend(", self.i) and chars:
                w = self.operator(numbers=False)
                return [("".join(chars), w)]
            chars.append(c)
            self.i += 1
        return [("".join(chars), 1.0)] if chars else []
