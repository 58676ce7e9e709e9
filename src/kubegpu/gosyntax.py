"""Go's value syntax, as NVIDIA's and GFD's urfave/cli flags read flags and env vars.

Kept free of imports so that `kubegpu.cli`, which must be light to load (it ignores SIGHUP
only once imported), reads `true`, `0x1f` and friends one way in every command: the
boolean and integer option types of `kubegpu.cli.options` are built on these two.
"""

from __future__ import annotations

#: Exactly the spellings Go's strconv.ParseBool takes: `yes`/`on` are not among them.
GO_TRUE = ("1", "t", "T", "TRUE", "true", "True")
GO_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def parse_bool(text: str) -> bool:
    """A boolean as Go's strconv.ParseBool reads it; ValueError lists what is accepted."""
    if text in GO_TRUE:
        return True
    if text in GO_FALSE:
        return False
    raise ValueError(f"invalid boolean {text!r}; use one of {', '.join(GO_TRUE + GO_FALSE)}")


def parse_go_int(text: str) -> int:
    """An integer as Go's strconv.ParseInt(s, 0, 64) reads it: a sign, `0x`/`0o`/`0b` or a
    leading `0` (octal), `_` between digits."""
    sign = -1 if text.startswith("-") else 1
    body = text[1:] if text[:1] in ("+", "-") else text
    try:
        if not body[:1].isdigit() or body != body.strip():
            raise ValueError(text)
        if len(body) > 1 and body[0] == "0" and body[1] in "01234567_":
            return sign * int(body[1:], 8)  # Go's legacy octal `010`; Python's base 0 refuses it
        return sign * int(body, 0)
    except ValueError:
        raise ValueError(f"invalid integer {text!r}") from None
