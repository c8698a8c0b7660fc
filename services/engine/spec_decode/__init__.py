"""Speculative decoding (vLLM's ``--speculative-config``): drafts proposed cheaply, verified
by the target model in one forward pass, kept by a rejection sampler that preserves the
target's distribution exactly.

The parts here import nothing of the engine's core (which imports them): ``config`` (the JSON
object, validated at start), ``ngram`` (prompt lookup), ``draft_model`` (a draft model with its
own KV cache under the target's block ids), ``rejection`` (the accept/replace arithmetic),
``grammar`` (structured outputs' masks at every verified position) and ``metrics`` (vLLM's
counters). The core wires them into a step: ``services.engine.spec_step`` (drafts proposed
before each schedule, a step's verification inputs gathered, the verification), the input
batch's draft rows, the scheduler's ``1 + k`` tokens and the block manager's trim of rejected
slots.
"""
