"""A JSON object streamed as it is written: the text that is safe to send now, and the
suffix that closes it.

Tool-call arguments stream to the client while the model writes them, so every fragment
sent must stay a prefix of the final arguments, and the final arguments must be one valid
JSON object even when the model breaks the JSON or ``max_tokens`` cuts it off. ``ObjectPrefix``
reads the text one character at a time and sends it only from points where the text so far
plus ``closing()`` is valid JSON::

    {"city": "Os|lo", "days": 3|, "unit": "c|el"}
                 ^ in a value string: close it with `"` and `}`
    held until the value begins: `, "days": `, a number or literal until it ends, an escape

The first character that cannot continue valid JSON ends the object there (``is_broken``);
the model's text from it on is dropped, and ``closing()`` closes what was sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum, auto

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")
_HEX = frozenset("0123456789abcdefABCDEF")


class _At(Enum):
    START = auto()        # before the top-level `{`
    KEY_OR_END = auto()   # after `{`
    KEY = auto()          # after `,` in an object
    IN_KEY = auto()
    COLON = auto()
    VALUE = auto()        # after `:` or `,` in an array
    VALUE_OR_END = auto()  # after `[`
    IN_STRING = auto()    # a value string
    IN_SCALAR = auto()    # a number or a literal
    AFTER_VALUE = auto()
    DONE = auto()


@dataclass(slots=True)
class ObjectPrefix:
    """One JSON object read incrementally; ``feed`` returns what may be sent now."""

    stack: list[str] = field(default_factory=list)  # "}" or "]" per open container
    at: _At = _At.START
    held: str = ""     # accepted, not yet sent
    escape: str = ""   # an escape sequence in progress (inside ``held`` for keys)
    scalar: str = ""   # a number or literal in progress
    is_broken: bool = False

    @property
    def is_done(self) -> bool:
        return self.at is _At.DONE or self.is_broken

    @property
    def has_started(self) -> bool:
        return self.at is not _At.START

    def feed(self, text: str) -> tuple[str, int]:
        """Read ``text``; return the sendable text and how many characters were consumed
        (fewer than ``len(text)`` once the object is done: the rest is not its)."""
        out: list[str] = []
        for i, ch in enumerate(text):
            if self.is_done:
                return "".join(out), i
            if not self._step(ch, out):
                self.is_broken = True  # ``ch`` leaves the state unchanged, for ``closing``
                return "".join(out), i
        return "".join(out), len(text)

    def closing(self) -> str:
        """The suffix that makes everything sent so far one valid object (``{}`` if nothing was)."""
        if self.at is _At.START:
            return "{}"
        if self.at is _At.DONE:
            return ""
        tail = ""
        if self.at is _At.IN_SCALAR and _is_scalar(self.scalar):
            tail = self.held + self.scalar  # a complete number or literal at the end of the text
        elif self.at is _At.IN_STRING:
            tail = '"'
        self.held, self.scalar, self.at = "", "", _At.DONE
        return tail + "".join(reversed(self.stack))

    # ---- one character ------------------------------------------------------------------
    def _send(self, out: list[str], ch: str) -> None:
        out.append(self.held + ch)
        self.held = ""

    def _open(self, ch: str, out: list[str]) -> None:
        self.stack.append("}" if ch == "{" else "]")
        self.at = _At.KEY_OR_END if ch == "{" else _At.VALUE_OR_END
        self._send(out, ch)

    def _close(self, ch: str, out: list[str]) -> bool:
        if not self.stack or self.stack[-1] != ch:
            return False
        self.stack.pop()
        self.at = _At.AFTER_VALUE if self.stack else _At.DONE
        self._send(out, ch)
        return True

    def _step(self, ch: str, out: list[str]) -> bool:
        at = self.at
        if at is _At.IN_STRING:
            return self._string_char(ch, out)
        if at is _At.IN_KEY:
            return self._key_char(ch)
        if at is _At.IN_SCALAR:
            if ch.isalnum() or ch in "+-.":
                self.scalar += ch
                return True
            if not _is_scalar(self.scalar):
                return False
            out.append(self.held + self.scalar)
            self.held, self.scalar, self.at = "", "", _At.AFTER_VALUE
            return self._step(ch, out)
        if ch in " \t\r\n":
            if self.held:
                self.held += ch
            else:
                out.append(ch)
            return True
        if at is _At.START:
            if ch != "{":
                return False
            self._open(ch, out)
            return True
        if at in (_At.KEY_OR_END, _At.KEY):
            if ch == "}" and at is _At.KEY_OR_END:
                return self._close(ch, out)
            if ch != '"':
                return False
            self.held += ch
            self.at = _At.IN_KEY
            return True
        if at is _At.COLON:
            if ch != ":":
                return False
            self.held += ch
            self.at = _At.VALUE
            return True
        if at in (_At.VALUE, _At.VALUE_OR_END):
            if ch == "]" and at is _At.VALUE_OR_END:
                return self._close(ch, out)
            return self._value_start(ch, out)
        assert at is _At.AFTER_VALUE, at
        if ch in "}]":
            return self._close(ch, out)
        if ch != ",":
            return False
        self.held += ch
        self.at = _At.KEY if self.stack[-1] == "}" else _At.VALUE
        return True

    def _value_start(self, ch: str, out: list[str]) -> bool:
        if ch in "{[":
            self._open(ch, out)
        elif ch == '"':
            self.at = _At.IN_STRING
            self._send(out, ch)
        elif ch == "-" or ch.isdigit() or ch in "tfn":
            self.at = _At.IN_SCALAR
            self.scalar = ch
        else:
            return False
        return True

    def _string_piece(self, ch: str) -> str | None:
        """One character of a string: the text it completes ("" while an escape is in
        progress), or None when it cannot be in a string. Only a closing quote is returned as ``"``."""
        if self.escape:
            self.escape += ch
            if len(self.escape) == 2:
                if ch == "u":
                    return ""
                valid = ch in '"\\/bfnrt'
            elif ch not in _HEX:
                valid = False
            elif len(self.escape) < 6:
                return ""
            else:
                valid = True
            piece, self.escape = self.escape, ""
            return piece if valid else None
        if ch == "\\":
            self.escape = ch
            return ""
        return None if ord(ch) < 0x20 else ch

    def _string_char(self, ch: str, out: list[str]) -> bool:
        piece = self._string_piece(ch)
        if piece is None:
            return False
        if piece == '"':
            self.at = _At.AFTER_VALUE
        out.append(piece)
        return True

    def _key_char(self, ch: str) -> bool:
        piece = self._string_piece(ch)
        if piece is None:
            return False
        self.held += ch
        if piece == '"':
            self.at = _At.COLON
        return True


def _is_scalar(token: str) -> bool:
    return token in _LITERALS or _NUMBER.fullmatch(token) is not None
