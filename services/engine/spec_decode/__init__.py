"""Speculative decoding (vLLM's ``--speculative-config``): drafts proposed cheaply, verified
by the target model in one forward pass, kept by a rejection sampler that preserves the
target's distribution exactly.

The parts here import nothing of the engine's core (which imports them): ``config`` (the JSON
object, validated at start), ``ngram`` (prompt lookup), ``draft_model`` (a draft model with its
own KV cache under the target's block ids), ``rejection`` (the accept/replace arithmetic),
``grammar`` (structured outputs' masks at every verified position) and ``metrics`` (vLLM's
counters). Two core modules wire these into a step: ``spec_proposers`` (drafts proposed
before each schedule) and ``spec_verifier`` (the step feature that holds each row's drafts,
gathers a step's verification inputs and verifies); they live in the core because they use
the input batch, the sampler and the scheduler's output, and this package must not import the
core (``tests/protocol/test_import_rules.py``). The rest of the core sees those two only, plus
the scheduler's lookahead tokens (``1 + k`` scheduled, a run back) and the block manager's
trim of rejected slots.
"""
