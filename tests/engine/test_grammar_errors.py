"""A grammar the compiler refuses is the client's 400 naming ``structured_outputs``, with the
error of the grammar's own language: an EBNF grammar's EBNF error (it was once replaced by
Lark's "parametric grammar is not supported", from the Lark attempt that follows a failed
EBNF compile), a Lark grammar still compiled as Lark. Through the engine's own endpoint (one
engine: the tokenizer's grammar index is built once)."""

from __future__ import annotations

import asyncio

from services.protocol.structured_outputs import StructuredOutputsParams as SO
from tests.engine.test_server import engine_app, gen_body, post_generate

EBNF_ERRORS = [
    ('root ::= "a" | undefined_rule', 'Rule "undefined_rule" is not defined'),
    ('root ::= ("a" item\nitem ::= "b"', "Expect )"),
]


def test_grammar_errors_are_400s_in_the_grammars_own_language(fast_model_dir) -> None:
    async def answers(grammars: list[str]) -> list[tuple[int, dict | None]]:
        async with engine_app(fast_model_dir) as client:
            return [await post_generate(client, gen_body(
                f"r{i}", [5, 6, 7], max_tokens=3, structured_outputs=SO(grammar=g)))
                for i, g in enumerate(grammars)]

    lark_ok, neither = 'start: "yes" | "no"', "start: (((("
    *ebnf, ok, bad = asyncio.run(answers([g for g, _ in EBNF_ERRORS] + [lark_ok, neither]))
    for (status, err), (_, error) in zip(ebnf, EBNF_ERRORS, strict=True):
        assert status == 400 and err["param"] == "structured_outputs", err
        message = err["message"]
        assert message.startswith("structured_outputs.grammar cannot be compiled as EBNF: EBNF")
        assert error in message and "Lark" not in message, message
        assert ".cc:" not in message  # xgrammar's log prefix (its build paths) is cut
    assert ok == (200, None)
    status, err = bad
    assert status == 400 and "as EBNF (EBNF lexer error" in err["message"], err
    assert "nor as Lark (" in err["message"], err
