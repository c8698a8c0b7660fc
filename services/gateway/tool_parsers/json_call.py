"""An incremental reader of one JSON call object, ``{"name": ..., "arguments": {...}}``.

Fed characters as they stream, it finds the name and collects the raw text of the
``arguments`` (or ``parameters``) value, whatever the key order. It stops at the object's
closing brace (``done``) and says how many characters it used.
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"


class CallObjectReader:
    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.expect = "open"  # open | key | colon | value | scalar | after | done
        self.key: str | None = None
        self.target: str | None = None  # where the current characters go: key | name | args
        self.token = ""  # the key or name string being read (raw JSON, quotes included)
        self.name: str | None = None
        self.pending_args = ""  # argument text not yet taken
        self.saw_args = False

    @property
    def done(self) -> bool:
        return self.expect == "done"

    def take_arguments(self) -> str:
        out, self.pending_args = self.pending_args, ""
        return out

    def feed(self, text: str) -> int:
        """Reads ``text`` up to the end of the object; returns the characters used."""
        for i, ch in enumerate(text):
            if self.expect == "done":
                return i
            self._char(ch)
        return len(text)

    # -- one character ------------------------------------------------------------------------

    def _char(self, ch: str) -> None:
        if self.in_string:
            self._capture(ch)
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_closed()
            return
        if self.depth >= 2:
            self._nested(ch)
        elif self.expect == "open":
            if ch == "{":
                self.depth, self.expect = 1, "key"
        else:
            self._member(ch)

    def _nested(self, ch: str) -> None:
        self._capture(ch)
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._value_closed()

    def _member(self, ch: str) -> None:
        expect = self.expect
        if expect == "scalar":
            if ch in _WS or ch in ",}":
                self._value_closed()
                if ch in ",}":
                    self._member(ch)
            else:
                self._capture(ch)
            return
        if ch in _WS:
            return
        if expect == "key" and ch == '"':
            self.target, self.token, self.in_string = "key", '"', True
        elif expect in ("key", "after") and ch == "}":
            self.depth, self.expect = 0, "done"
        elif expect == "colon" and ch == ":":
            self.expect = "value"
        elif expect == "after" and ch == ",":
            self.expect = "key"
        elif expect == "value":
            self._value_start(ch)

    def _value_start(self, ch: str) -> None:
        if self.key in ARGUMENT_KEYS:
            self.target, self.saw_args = "args", True
        elif self.key == "name" and ch == '"':
            self.target, self.token = "name", ""
        else:
            self.target = None
        self._capture(ch)
        if ch == '"':
            self.in_string, self.expect = True, "after"
        elif ch in "{[":
            self.depth, self.expect = 2, "after"
        else:
            self.expect = "scalar"

    def _string_closed(self) -> None:
        if self.target == "key":
            self.key, self.expect = _loads_str(self.token), "colon"
        elif self.target == "name":
            self.name = _loads_str(self.token)
        if self.target != "key":
            self.target = None

    def _value_closed(self) -> None:
        self.target, self.expect = None, "after"

    def _capture(self, ch: str) -> None:
        if self.target == "args":
            self.pending_args += ch
        elif self.target in ("key", "name"):
            self.token += ch


def _loads_str(raw: str) -> str:
    try:
        value = json.loads(raw)
    except ValueError:
        return raw.strip('"')
    return value if isinstance(value, str) else str(value)
