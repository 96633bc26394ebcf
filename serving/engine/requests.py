"""What a caller of the engine sees: requests, events, handles, stats and errors.

No MLX here: the server's request parsing and the command line build these without
loading the device side.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

from ..openai.output_options import MAX_TOP_LOGPROBS
from ..sampling.params import SamplingParams

if TYPE_CHECKING:
    from ..sampling.grammar import Grammar
    from ..sampling.logprobs import TokenLogprob

# open_engine's default capacity, in full contexts: room for a few long requests at once.
DEFAULT_CAPACITY_CONTEXTS = 4


class EngineError(ValueError):
    """A request or engine setting the engine cannot take; the message says what to change."""


class RequestRejected(EngineError):
    """A request that can never run with this engine's capacity, context or batch limits."""


class RequestFailed(RuntimeError):
    """A request that failed while running (its forward raised, or the engine stopped)."""


class Status(str, Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODING = "decoding"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED = (Status.DONE, Status.FAILED, Status.CANCELLED)


@dataclass(frozen=True)
class Request:
    """What to generate.

    Args:
        prompt: text (needs the program's tokenizer) or token ids.
        max_tokens: the most tokens each sample generates.
        sampling: temperature / top-k / top-p / seed; sample ``i`` uses ``seed + i``.
        stop: strings that end a sample; the text is cut before the first one.
        stop_ids: token ids that end a sample (kept in its tokens, like eos).
        n: samples of the prompt, prefilled once and forked.
        ignore_eos: keep generating past the model's eos tokens.
        grammar: what each sample's text must match (``grammar.Grammar``); a sample
            stops once its match is complete.
        logprobs: None, or k in 0..20: each token comes with its log-probability and
            the k most likely tokens' (``logprobs.TokenLogprob``).
    """

    prompt: Union[str, Sequence[int]]
    max_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    grammar: Optional["Grammar"] = None
    logprobs: Optional[int] = None


@dataclass(frozen=True)
class Event:
    """One thing that happened to a request, in order.

    A token event carries ``token`` and the new ``text`` it made visible (may be empty:
    text that could still become a stop string, or half a character, is held back). The
    last event of each sample has ``finish_reason`` ("stop" | "length" | "capacity" |
    "cancelled") and any text released at the end. A failed request ends with one event
    carrying ``error``. With ``Request.logprobs``, a token event carries ``logprob``.
    """

    request_id: int
    index: int
    token: Optional[int] = None
    text: str = ""
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    logprob: Optional["TokenLogprob"] = None


@dataclass
class RequestStats:
    """Timings of one request (``time.perf_counter`` seconds)."""

    prompt_tokens: int
    submitted: float
    admitted: Optional[float] = None
    first_token: Optional[float] = None
    finished: Optional[float] = None
    generated_tokens: int = 0  # over all samples
    decoded_tokens: int = 0  # produced by decode steps: all but each sample's first
    cached_tokens: int = 0  # leading prompt tokens forked from a retained sequence, not computed

    @property
    def queue_seconds(self) -> float:
        return (self.admitted or self.submitted) - self.submitted

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens computed per second (cached ones excluded)."""
        if self.admitted is None or self.first_token is None or self.first_token <= self.admitted:
            return 0.0
        return (self.prompt_tokens - self.cached_tokens) / (self.first_token - self.admitted)

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first (which the prefill produces), all samples."""
        if self.first_token is None or self.finished is None or self.finished <= self.first_token:
            return 0.0
        return self.decoded_tokens / (self.finished - self.first_token)


@dataclass(frozen=True)
class SampleResult:
    index: int
    tokens: list[int]
    text: str
    finish_reason: str
    logprobs: tuple["TokenLogprob", ...] = ()  # one per token, with Request.logprobs


@dataclass(frozen=True)
class Completion:
    request_id: int
    prompt_tokens: int
    samples: list[SampleResult]
    stats: RequestStats


@dataclass
class EngineStats:
    """Totals over the engine's life. Decode-only steps are counted apart, since their
    rate is the batched decode speed (steps that carry prefill tokens are slower)."""

    steps: int = 0
    step_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    busy_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    # Host time of decode-only steps: ``Engine.step`` outside waiting for token ids, and
    # of it the launch (the forward's graph building and dispatch, and the draws).
    decode_host_seconds: float = 0.0
    decode_launch_seconds: float = 0.0
    prefix_hits: int = 0  # requests that forked a retained sequence
    cached_tokens: int = 0  # prompt tokens those forks saved computing

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def throughput_tps(self) -> float:
        """Generated tokens per second of forward time, prefill included."""
        return self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds, as of its last step: published whole after each step, so
    any thread may read ``Engine.load`` (for monitoring) without a lock."""

    waiting: int = 0  # requests submitted, not yet admitted
    running: int = 0  # cache sequences generating
    reserved: int = 0  # capacity units reserved by admitted requests
    positions: int = 0  # token positions the cache holds, summed over its sequences


@dataclass(frozen=True)
class SequenceState:
    """One live cache sequence as the engine accounts for it."""

    request_id: int
    index: int  # sample index (0 while the prompt is prefilled)
    seq_id: int
    length: int  # positions the sequence holds
    unread: int = 0  # tokens drawn by the forward in flight, not yet read and emitted


class RequestHandle:
    """The caller's side of a submitted request; safe to use from any thread.

    Iterate it (or call ``events()``) for the stream of Events; ``result()`` waits for
    the Completion. ``waiting_reason`` says why a queued request has not started yet.
    """

    def __init__(self, request_id: int, request: Request, prompt_tokens: int,
                 on_event: Optional[Callable[[Event], None]]) -> None:
        self.id = request_id
        self.request = request
        self.status = Status.QUEUED
        self.waiting_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.stats = RequestStats(prompt_tokens, time.perf_counter())
        self._on_event = on_event
        self._events: queue.Queue[Optional[Event]] = queue.Queue()
        self._done = threading.Event()
        self._cancelled = threading.Event()
        self._completion: Optional[Completion] = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop the request at the engine's next iteration; its sequences are removed."""
        self._cancelled.set()

    def events(self, timeout: Optional[float] = None) -> Iterator[Event]:
        """Events as they happen, until the request ends; ``timeout`` bounds each wait.

        The stream can be consumed once (by one iterator).
        """
        while True:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id} produced nothing for {timeout} s") from None
            if event is None:
                return
            yield event

    __iter__ = events

    def result(self, timeout: Optional[float] = None) -> Completion:
        """The completion; RequestFailed if the request failed or was cancelled."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self._completion is None:
            raise RequestFailed(self.error or f"request {self.id} was {self.status.value}")
        return self._completion

    # -- engine side --------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        self._events.put(event)
        self._notify(event)

    def _notify(self, event: Event) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:  # a broken consumer ends only its own request
            self._cancelled.set()

    def _close(self, status: Status, last: Event, completion: Optional[Completion] = None,
               error: Optional[str] = None) -> None:
        """End the request with ``last`` as its final event.

        The handle is done before the callback sees ``last``, so a consumer reacting to
        it can call ``result()`` at once.
        """
        self.status = status
        self.error = error
        self._completion = completion
        self.stats.finished = time.perf_counter()
        self._events.put(last)
        self._events.put(None)
        self._done.set()
        self._notify(last)



def check_request(request: Request) -> None:
    """The request's own fields, checked before the engine looks at its prompt.

    Raises:
        EngineError: naming the field and what it takes.
    """
    n = request.n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise EngineError(f"n must be a positive integer, got {n!r}")
    if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
        raise EngineError(f"max_tokens must be a positive integer, got {request.max_tokens!r}")
    k = request.logprobs
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
        raise EngineError(f"logprobs must be None or an integer from 0 to {MAX_TOP_LOGPROBS}, got {k!r}")
