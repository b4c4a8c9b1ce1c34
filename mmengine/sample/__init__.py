"""Sampling: what a request asks for and how its next token is drawn.

  params.py            SamplingParams (plain data, checked on construction)
  sampler.py           Sampler: per-row settings as tensors, greedy / top-k / top-p, token logprobs
  penalties.py         presence, frequency and repetition penalties over each request's token counts
  detokenizer.py       incremental detokenization and stop strings
  reasoning.py         <think>...</think> apart from the answer; a grammar that waits for the reasoning to end
  token_bytes.py       each token's bytes, for logprobs' token texts
  structured_output/   grammars (JSON schema, regex, choice, Lark) and the masks they put on logits
"""
