"""Continuous batching: many requests over one batched cache, one forward per iteration.

The engine's parts, in the order a request's data flows through them:

``requests``   what a caller sees: Request, Event, handles, stats, errors (no MLX)
``jobs``       the engine's host state of each request and its samples (no MLX)
``scheduler``  queues, limits, admission, chunking, prefix reuse -> a step plan, or a
               refusal with its reason (pure Python over the cache's control face)
``runner``     a step plan on the device: forward, grammar masks, draws, logprobs;
               failures come back as data
``readout``    drawn tokens -> events: detokenize, stops, finishes, completions
``loop``       the Engine: inbox, worker thread, and the one ``step()`` that orders them
``prompt_store`` finished sequences kept for later prompts to fork

Names are resolved lazily, so building requests does not load MLX.
"""
from mlx_pte.ir.lazy_exports import lazy_exports

_EXPORTS = {
    "Engine": ".loop",
    "open_engine": ".loop",
    **{name: ".requests" for name in (
        "DEFAULT_CAPACITY_CONTEXTS", "Completion", "EngineError", "EngineLoad", "EngineStats", "Event",
        "FINISHED", "Request", "RequestFailed", "RequestHandle", "RequestRejected", "RequestStats",
        "SampleResult", "SequenceState", "Status",
    )},
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
