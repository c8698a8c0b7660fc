"""Speculative decoding (vLLM's ``--speculative-config``): drafts proposed cheaply, verified
by the target model in one forward pass, kept by a rejection sampler that preserves the
target's distribution exactly.

A part above the core: it imports the core (the input batch, the sampler's stages, the
scheduler's output, the config's ``SpeculativeConfig``) and the core imports nothing of it.
``feature`` registers the step feature ``speculation`` with ``features.registry``, through
which the runner builds it: before the KV pool the lookahead rows, the draft model's KV per
token and its memory; after it the draft model, the verifier and the proposers. The rest:
``verifier`` (the step feature: each row's drafts, a step's verification inputs, the draft
model's passes before the target's, the rejection sampler that samples a verifying step),
``proposers`` (drafts per running request before each schedule), ``ngram`` (prompt lookup),
``draft_model`` (a draft model with its own KV cache under the target's block ids),
``rejection`` (the accept/replace arithmetic), ``grammar`` (structured outputs' masks at every
verified position), ``metrics`` (vLLM's counters) and ``config`` (the flag's object, as this
package names it). The rest of the core sees the step-feature hooks only, plus the
scheduler's lookahead tokens (``1 + k`` scheduled, a run back) and the block manager's trim of
rejected slots.
"""
