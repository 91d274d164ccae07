"""Structured output: requests whose output must follow a JSON schema, a regex, a choice or a grammar.

The grammar engine is xgrammar (benchmarks/RESULTS.md says why). `spec` turns a request's
`StructuredOutputsParams` into the text the engine compiles and the cache keys on; `backend`
holds the per-tokenizer engine state and compiles; `cache` keeps compiled grammars; `state` is
one sample's position in its grammar; `manager` compiles off the step loop, in threads.
"""
