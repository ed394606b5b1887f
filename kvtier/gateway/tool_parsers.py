"""Tool calls parsed out of model text as it streams, through a registry of formats.

A parser is fed the completion's text deltas and returns ``ParserEvent``s: content text
(``str``), ``CallStart`` (a call's index, id and function name, sent once the name is read
and its arguments object opens) and ``ArgumentsDelta`` (the next fragment of that call's
arguments, as the model writes them). Text before the first call streams as content; from
a call's opening on, nothing is sent as content until the parser knows whether it is a
call. Arguments stream through ``ObjectPrefix``, so their fragments always join to one
valid JSON object, closed by ``finish`` when the model stops (or breaks the JSON) before
the object's end. A non-streaming response is the same parser fed the whole text, so both
carry the same calls and arguments.

A call that opens but never becomes one (no name, no arguments object, not JSON) is sent
as content once its region ends, and counts in ``num_unparsed`` (the gateway exports it
as a metric), so a small model's broken call reaches the client as what it is, text.

Formats:
  ``hermes``   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, SmolLM)
  ``llama3``   a bare JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1), one per
               line or ``;``-separated, optionally after ``<|python_tag|>``; output that does
               not open with an object is text
Register more with ``@register("name")`` on a ``ToolParser`` subclass; its class attributes
state the format's text, which the gateway writes into prompts (past calls, a forced call's
opening, the tools block's instruction).

Selection (``select_parser``): an explicit name (``kvtier gateway --tool-parser``) wins; else
the first registered format whose markers the model's chat template mentions (``<tool_call>``:
hermes; ``<|python_tag|>`` or a ``"parameters"`` call object: llama3); else ``hermes``, the
format of the gateway's own tools block.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvtier.domain.errors import ConfigError
from kvtier.gateway.json_prefix import ObjectPrefix


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One OpenAI tool call; ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


ParserEvent = str | CallStart | ArgumentsDelta


@dataclass(slots=True)
class ParsedOutput:
    """Parser events gathered: the content text and the calls with their whole arguments."""

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    num_unparsed: int = 0

    def add(self, events: Sequence[ParserEvent]) -> None:
        for e in events:
            if isinstance(e, str):
                self.text += e
            elif isinstance(e, CallStart):
                self.tool_calls.append(ToolCall(e.id, e.name, ""))
            else:
                c = self.tool_calls[e.index]
                self.tool_calls[e.index] = ToolCall(c.id, c.name, c.arguments + e.text)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def call_from_object(obj: Any, arguments_key: str = "arguments") -> tuple[str, str] | None:
    """(name, arguments JSON) from a decoded ``{"name", arguments_key}`` object, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


# A call object's head up to its arguments object: the name is read from here, and the
# arguments stream from the `{` on. A call written in another key order is read whole.
_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)', re.DOTALL)


class ToolParser(ABC):
    """Contract: ``feed`` each text delta, then ``finish`` once; the events of all calls, in
    order, are the response. Content, call names and argument fragments do not depend on how
    the text was split into deltas.

    The format's text: ``call_open`` + ``{"name": ..., "<arguments_key>": {...}}`` +
    ``call_close`` is one call; ``required_opening`` opens the assistant's turn when a call is
    required; ``instruction`` ends the tools block of a template that does not render tools;
    ``template_markers`` are the strings of a chat template that selects this format."""

    call_open: ClassVar[str]
    call_close: ClassVar[str]
    arguments_key: ClassVar[str]
    required_opening: ClassVar[str]
    instruction: ClassVar[str]
    template_markers: ClassVar[tuple[str, ...]]

    @classmethod
    def call_text(cls, name: str, arguments: str) -> str:
        return cls.call_opening(name, arguments) + "}" + cls.call_close

    @classmethod
    def call_opening(cls, name: str, arguments_opening: str = "") -> str:
        """The text that forces a call to ``name``: the model continues its arguments object
        from ``arguments_opening``."""
        return f'{cls.call_open}{{"name": {json.dumps(name)}, "{cls.arguments_key}": ' + arguments_opening

    def __init__(self) -> None:
        self.num_calls = 0
        self.num_unparsed = 0
        self._events: list[ParserEvent] = []
        self._buf = ""
        self._space = ""  # trailing whitespace of the content, sent once more content follows
        self._args: ObjectPrefix | None = None

    def feed(self, text: str) -> list[ParserEvent]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[ParserEvent]:
        self._run(final=True)
        if self._args is not None:
            self._arguments(self._args.closing())
            self._args = None
        if not self.num_calls and self._space:
            self._events.append(self._space)
        self._space = ""
        return self._take()

    @abstractmethod
    def _run(self, *, final: bool) -> None:
        """Turn as much of ``self._buf`` into events as is known."""

    def _take(self) -> list[ParserEvent]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept):]
        if kept:
            self._events.append(kept)

    def _unparsed(self, raw: str) -> None:
        self.num_unparsed += 1
        self._content(raw)

    def _start(self, name: str) -> None:
        self._events.append(CallStart(self.num_calls, new_call_id(), name))
        self.num_calls += 1

    def _arguments(self, text: str) -> None:
        if text:
            self._events.append(ArgumentsDelta(self.num_calls - 1, text))

    def _head(self) -> bool:
        """Start a call if the buffer opens with a call's head; its arguments stream next."""
        m = _CALL_HEAD.match(self._buf)
        if m is None:
            return False
        try:
            name = json.loads(m.group(1))
        except ValueError:
            return False
        if not name:
            return False
        self._start(name)
        self._buf = self._buf[m.end():]
        self._args = ObjectPrefix()
        return True

    def _stream_arguments(self) -> bool:
        """Send the arguments the buffer holds; True once the object is done."""
        assert self._args is not None
        sent, used = self._args.feed(self._buf)
        self._buf = self._buf[used:]
        self._arguments(sent)
        if not self._args.is_done:
            return False
        self._args = None
        return True

    def _whole(self, body: str, arguments_key: str = "arguments") -> bool:
        """A call written whole (another key order, arguments as a string): start and send it."""
        try:
            call = call_from_object(json.loads(body), arguments_key)
        except ValueError:
            return False
        if call is None:
            return False
        self._start(call[0])
        self._arguments(call[1])
        return True


PARSERS: dict[str, type[ToolParser]] = {}
DEFAULT_PARSER = "hermes"


def register(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def add(parser: type[ToolParser]) -> type[ToolParser]:
        PARSERS[name] = parser
        return parser

    return add


def get_parser(name: str) -> ToolParser:
    """A new parser of the format ``name``."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise KeyError(f"no tool-call parser {name!r}; one of {', '.join(sorted(PARSERS))}") from None


def parser_format(name: str) -> type[ToolParser]:
    """The registered format ``name``; a ``ConfigError`` naming the registered ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ConfigError(f"no tool-call parser {name!r}; registered: {', '.join(sorted(PARSERS))}",
                          field="tool_parser") from None


def select_parser(chat_template: str | dict[str, str] | None, name: str | None = None) -> str:
    """The tool-call format of a model (see the module's doc): ``name`` when given, else the
    first registered format whose markers ``chat_template`` mentions (a tokenizer's named
    templates: any of them), else ``hermes``."""
    if name is not None:
        parser_format(name)
        return name
    text = "\n".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""
    for registered, parser in PARSERS.items():
        if any(marker in text for marker in parser.template_markers):
            return registered
    return DEFAULT_PARSER


def parse(name: str, text: str) -> ParsedOutput:
    """The whole ``text`` through a new ``name`` parser."""
    parser = get_parser(name)
    out = ParsedOutput()
    out.add(parser.feed(text))
    out.add(parser.finish())
    out.num_unparsed = parser.num_unparsed
    return out


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


@register("hermes")
class HermesParser(ToolParser):
    """Content up to ``<tool_call>``; the call's head, its arguments, then everything up to
    ``</tool_call>`` is skipped; content again after it."""

    call_open = HERMES_OPEN + "\n"
    call_close = "\n" + HERMES_CLOSE
    arguments_key = "arguments"
    required_opening = HERMES_OPEN + "\n"
    instruction = ("For each function call, return a json object with function name and arguments within "
                   "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                   '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    template_markers = (HERMES_OPEN,)

    def __init__(self) -> None:
        super().__init__()
        self._mode = "text"

    def _run(self, *, final: bool) -> None:
        while True:
            if self._mode == "text":
                i = self._buf.find(HERMES_OPEN)
                if i >= 0:
                    self._content(self._buf[:i])
                    self._buf, self._mode = self._buf[i + len(HERMES_OPEN):], "head"
                    continue
                keep = 0 if final else _partial_tag(self._buf, HERMES_OPEN)
                self._content(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            if self._mode == "head":
                if self._head():
                    self._mode = "arguments"
                    continue
                j = self._buf.find(HERMES_CLOSE)
                if j >= 0:
                    body, self._buf = self._buf[:j], self._buf[j + len(HERMES_CLOSE):]
                    if not self._whole(body.strip()):
                        self._unparsed(HERMES_OPEN + body + HERMES_CLOSE)
                    self._mode = "text"
                    continue
                if final:
                    if not self._whole(self._buf.strip()):
                        self._unparsed(HERMES_OPEN + self._buf)
                    self._buf = ""
                return
            if self._mode == "arguments":
                if not self._stream_arguments():
                    return
                self._mode = "skip"
                continue
            j = self._buf.find(HERMES_CLOSE)  # skip: the call's own tail
            if j >= 0:
                self._buf, self._mode = self._buf[j + len(HERMES_CLOSE):], "text"
                continue
            keep = 0 if final else _partial_tag(self._buf, HERMES_CLOSE)
            self._buf = self._buf[len(self._buf) - keep:]
            return


PYTHON_TAG = "<|python_tag|>"


@register("llama3")
class Llama3Parser(ToolParser):
    """Calls when the output opens with ``{`` (after ``<|python_tag|>``); else all text."""

    call_open = ""
    call_close = ""
    arguments_key = "parameters"
    required_opening = '{"name": '
    instruction = ("For each function call, respond with only a JSON object of the form "
                   '{"name": <function-name>, "parameters": <args-json-object>}')
    template_markers = (PYTHON_TAG, '"parameters"', '\\"parameters\\"')

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"
        self._raw = ""  # what went before the call being read, sent with it if it is not a call

    def _run(self, *, final: bool) -> None:
        while True:
            if self._mode == "start":
                body = self._buf.lstrip()
                if body.startswith(PYTHON_TAG):
                    body = body[len(PYTHON_TAG):].lstrip()
                elif not final and PYTHON_TAG.startswith(body):
                    return
                if not body and not final:
                    return
                self._mode = "head" if body.startswith("{") else "text"
                if self._mode == "head":
                    self._raw, self._buf = self._buf[:len(self._buf) - len(body)], body
                continue
            if self._mode == "text":
                self._content(self._buf)
                self._buf = ""
                return
            if self._mode == "head":
                if self._head():
                    self._raw, self._mode = "", "arguments"
                    continue
                end = json_object_end(self._buf.lstrip())
                if end is None and not final:
                    return
                body = self._buf.lstrip()[:end] if end is not None else self._buf
                if self._whole(body, "parameters"):
                    self._buf, self._raw, self._mode = self._buf.lstrip()[len(body):], "", "between"
                    continue
                self._unparsed(self._raw + self._buf)
                self._buf, self._mode = "", "text"
                return
            if self._mode == "arguments":
                if not self._stream_arguments():
                    return
                self._mode = "between"
                continue
            rest = self._buf.lstrip(" \t\r\n;}")  # between calls: separators and the call's `}`
            self._buf = rest
            if not rest:
                return
            self._mode = "head" if rest.startswith("{") else "text"


def json_object_end(text: str) -> int | None:
    """Index just past the first complete top-level JSON object starting at ``text[0]``, or None.

    A scanner over braces outside strings (escapes honoured); it finds where a forced call's
    arguments close while they stream, before the model says anything after them.
    """
    depth = 0
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and not ch.isspace():
            return None
    return None
