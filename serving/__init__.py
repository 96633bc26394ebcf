"""Serving: requests, sampling, the engine and the OpenAI-compatible server."""
