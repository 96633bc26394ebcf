"""The OpenAI-compatible HTTP layer over the engine: request bodies and their fields, parsing
into engine Requests, response shapes, tools, ``/tokenize``, ``/metrics``, the app, and
``run --prompts`` (which shares the request parser)."""
