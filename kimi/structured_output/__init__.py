"""Guided decoding (structured output) with xgrammar: request fields -> GrammarSpec -> compiled grammar -> per-step
token bitmasks applied before sampling.

- `spec`: GrammarSpec, the wire form of a constraint (carried in protocol.SamplingParams.grammar);
- `request`: the request fields (OpenAI response_format and tools, vLLM structured_outputs / guided_*, SGLang regex /
  json_schema / ebnf) -> a GrammarSpec or a BadRequest naming the field;
- `vocab`: xgrammar's TokenizerInfo for the Kimi vocabulary;
- `backend`: compiling a GrammarSpec (bounded cache; the controller compiles off the event loop to refuse a bad
  grammar with a 400, each worker compiles again for its matchers);
- `bitmask`: the worker's matchers (GuidedRequests): accept each sampled token, fill the next step's bitmask.

This package's modules import xgrammar on use; `spec` needs only msgspec (kimi.protocol imports it).
"""
