"""Pooling models: the forward runs without a sampler and each request gets one vector.

What holds per pooling type (the scheduler enforces it; see `ModelConfig.pooling_needs_whole_prompt`):

- LAST (decoders such as Qwen3-Embedding): the last prompt token's hidden state. Causal
  attention makes it depend only on the prefix, so the prompt may be prefilled in chunks and
  may hit the prefix cache; a full-prompt hit still recomputes the last token (a hit covers at
  most `num_tokens - 1` tokens), whose hidden state is the embedding.
- MEAN: the mean over every prompt token's hidden state, and CLS: the first token's. Both need
  every prompt token computed in the one step that pools, so such a request reads no prefix
  cache and is never chunked: a prompt over max_num_batched_tokens is refused, one that does
  not fit the step's remaining budget waits for the next step.
- Encoders (BERT): bidirectional attention sees the whole prompt, so the same holds whatever
  the pooling type; their layers keep no KV cache (`EncoderOnlyAttentionSpec` holds no blocks).

Then each vector is cut to the request's `dimensions` (Matryoshka) and L2-normalized when the
request (or the model's pooler config) says so.
"""
