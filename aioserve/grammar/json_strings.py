r"""JSON strings that a strict parser accepts, in the grammar xgrammar makes
of a JSON schema.

xgrammar (0.2.x) writes a string with `maxLength` / `minLength` as
`"\"" chars{min, max} "\""` with chars `[^"\\\r\n]`: that admits the raw
control characters U+0000-U+001F other than CR and LF (a TAB, a NUL), which
RFC 8259 forbids inside a string (Python's json.loads raises "Invalid
control character"), and no escape at all. Its unbounded strings are right
(`[^\0-\x1f"\\]` or an escape). This rewrites the bounded strings' character
the same way: a character other than a control character, `"` or `\`, or
one escape (which is one character of the string, as maxLength counts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr

# The character class as xgrammar prints it, and what replaces it (the
# `basic_escape` rule is in every grammar it makes of a schema).
LOOSE_CHARACTER = r'[^\"\\\r\n]'
STRICT_CHARACTER = r'[^\0-\x1f\"\\] | ("\\" basic_escape)'


def strict_json_schema_grammar(schema: str) -> xgr.Grammar:
    import xgrammar as xgr  # imported when a grammar is first compiled, as compiler.py does

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    text = str(grammar)
    if LOOSE_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(LOOSE_CHARACTER, STRICT_CHARACTER), root_rule_name="root")
