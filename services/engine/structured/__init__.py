"""Structured outputs (guided decoding) in the engine: grammars compiled off the step loop and
cached, one matcher per constrained request, and the step's token masks.

The grammar library is xgrammar, picked by measurement (``benchmarks/grammar_backends.py``,
SmolLM2's 49,152-token vocabulary, a 9-property nested schema, batch 64, one 2-core
AVX-512 CPU): tokenizer index 94 ms (llguidance 268 ms); compiling the schema 9.5 ms cold
(llguidance 2.6 ms, lazily); filling 64 masks per step 0.13-0.20 ms (llguidance 0.18 ms with
its thread pool, 1.5 ms without). Compilation is off the step loop and cached either way, so
the per-step mask cost decides; xgrammar is also what vLLM and SGLang use. Its CPU
``apply_token_bitmask_inplace`` took 7.4 ms for 64 rows, so the masks are applied with our
own numpy/torch code instead (``masks.TokenMasker``). With half of a 64-request batch under a
JSON schema, the masks and matchers cost 4.9 ms per step, 2.0% of an all-free run's time
(``benchmarks/structured_throughput.py``).
"""
