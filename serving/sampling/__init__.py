"""Choosing next tokens: sampling parameters and the host reference sampler (``params``),
the device sampler (``device``), log-probabilities (``logprobs``), grammars (``grammar``)
and the allowed-token masks they write (``token_masks``)."""
