"""Continuous batching: many requests over one batched cache, one forward per iteration.

Each iteration builds ONE step: the pending token of every decoding sample first, then
prefill chunks of admitted requests in arrival order, then the first chunk of each newly
admitted request, up to the token budget (``max_batch_tokens``, at most the model's
``max_step``). Requests are admitted strictly first-in first-out.

Admission reserves each request's worst-case footprint (every sample grown to its final
length) against the cache's capacity, and one decode slot per sample against the token
budget. So a running sample always has room for its next token and a place in the next
step, and the engine never has to preempt; the cache's own ``check_step`` is the final
gate for every request it admits. A request that could never fit is refused at submit.

With a prompt store (``prompt_cache_tokens``), a finished request's sequences stay in the
cache, keyed by the tokens they hold; a later prompt sharing a prefix with one forks it
(``seq_clone``) and prefills only the rest. Retained sequences use only room that admitted
requests have not reserved: admission evicts them, least recently used first, before a
request would have to wait, so whether and when a request starts is decided as without
the store.

``n > 1`` samples of one prompt prefill once; right after the prefill the sequence is
forked (``seq_clone``) once per extra sample, each sample drawing from the same last-row
logits with its own key chain (seeds ``seed, seed + 1, ...``).

Iterations are pipelined the way ``generate()`` is: tokens are chosen on the device
(``device_sampling``), and each iteration dispatches its forward before reading the
previous one's token ids, so the host plans and builds step n+1 while the device computes
step n. A decoding sample is fed its token unread, straight from the previous step's ids;
what the host learns only on reading (eos, a stop string) ends the sample one step late,
and its extra position is dropped with its sequence. (On MLX's CPU backend the overlap is
small: ``async_eval`` waits while more than 10 scheduler tasks are in flight, and there
every op is a task; on a GPU the tasks are command buffers.)

A request with a ``grammar`` gives each sample a matcher (``grammar.Matcher``); its
allowed-token bitmask is applied to the sample's logits row on the device, in the same
batched draw as every other row (``token_masks``). A mask depends on the sample's previous
token, so a step with constrained draws dispatches its forward first, then reads the
previous step's tokens (advancing the matchers) while the device computes, and only then
computes the masks and queues the draws. Eos is allowed only where the grammar accepts;
a sample whose grammar is complete stops. With ``logprobs``, each draw also returns the
token's log-probability and the top alternatives, computed on the device from the same
(masked) rows (``logprobs``).
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

from mlx_pte.runtime.cache import KIND_BATCHED_SEQUENCE, Step, Verdict

from .output_options import MAX_TOP_LOGPROBS
from .sampling import SamplingParams
from .stops import StopStringError, StopStrings, StopText
from mlx_pte.interpreter.text import TextCodec

from .detokenizer import IncrementalDecoder
from .prompt_store import PromptStore, Retained

if TYPE_CHECKING:
    import mlx.core as mx

    from .grammar import Grammar, Matcher
    from .logprobs import TokenLogprob

    from .device_sampling import TokenStream

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


@dataclass
class _Sample:
    index: int
    stream: "TokenStream"
    stop_text: StopText
    decoder: Optional[IncrementalDecoder]
    seq_id: Optional[int] = None
    length: int = 0  # positions its sequence holds
    tokens: list[int] = field(default_factory=list)  # read and emitted
    drawn: int = 0  # tokens drawn on the device, read or not
    # Where, in the ids of the newest forward, the token to feed next is drawn; None when
    # that draw is the sample's last.
    pending: Optional[int] = None
    finish_reason: Optional[str] = None
    matcher: Optional["Matcher"] = None
    logprob_top: Optional[int] = None  # Request.logprobs
    logprobs: list["TokenLogprob"] = field(default_factory=list)


@dataclass
class _Job:
    handle: RequestHandle
    ids: list[int]
    cap: int  # the most positions each sample's sequence may hold
    footprint: int  # reserved capacity units
    samples: list[_Sample]
    fed: int = 0  # prompt tokens in its sequence (forked or prefilled)
    # Finished samples' sequences with the tokens they hold, kept until the job ends.
    finished: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.ids)

    @property
    def live(self) -> list[_Sample]:
        return [s for s in self.samples if s.finish_reason is None and s.seq_id is not None]


@dataclass
class _StepBuild:
    # The step's tokens: first one per decoding sample, drawn by the previous forward (its
    # row there in ``feeds``), then prompt tokens (``prompt``).
    feeds: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    # (token row, job, sample) for each row whose logits are sampled; sample None = the
    # row ending a prompt (its job's samples draw their first tokens from it).
    rows: list[tuple[int, _Job, Optional[_Sample]]] = field(default_factory=list)
    chunks: list[tuple[_Job, int]] = field(default_factory=list)  # prompt tokens per job
    jobs: dict[int, _Job] = field(default_factory=dict)  # every job in the step, by id
    feed_owners: list[int] = field(default_factory=list)  # each feed's job id
    prompt_owners: list[int] = field(default_factory=list)  # each prompt token's job id

    @property
    def size(self) -> int:
        return len(self.feeds) + len(self.prompt)

    def add_decode(self, job: _Job, sample: _Sample) -> None:
        self.rows.append((self.size, job, sample))
        self.feeds.append(sample.pending)  # type: ignore[arg-type]
        self.feed_owners.append(job.handle.id)
        self.positions.append(sample.length)
        self.seq_ids.append(sample.seq_id)  # type: ignore[arg-type]
        self.jobs[job.handle.id] = job

    def add(self, job: _Job, seq_id: int, tokens: Sequence[int], start: int) -> None:
        self.prompt.extend(tokens)
        self.positions.extend(range(start, start + len(tokens)))
        self.seq_ids.extend([seq_id] * len(tokens))
        self.prompt_owners.extend([job.handle.id] * len(tokens))
        self.jobs[job.handle.id] = job

    def only(self, job: _Job) -> "_StepBuild":
        """The part of this step that belongs to ``job`` (a valid step on its own: a
        subset of each of its sequences' contiguous runs); its feeds still index the
        previous forward's draws."""
        own = job.handle.id
        feeds = [i for i, owner in enumerate(self.feed_owners) if owner == own]
        prompt = [i for i, owner in enumerate(self.prompt_owners) if owner == own]
        keep = feeds + [len(self.feeds) + i for i in prompt]  # token indices, in token order
        row_of = {old: new for new, old in enumerate(keep)}
        return _StepBuild(
            feeds=[self.feeds[i] for i in feeds],
            prompt=[self.prompt[i] for i in prompt],
            positions=[self.positions[i] for i in keep],
            seq_ids=[self.seq_ids[i] for i in keep],
            rows=[(row_of[r], j, sample) for r, j, sample in self.rows if j is job],
            chunks=[(j, count) for j, count in self.chunks if j is job],
            jobs={own: job},
            feed_owners=[own] * len(feeds),
            prompt_owners=[own] * len(prompt),
        )

    def absorb(self, part: "_StepBuild") -> None:
        """Count ``part`` in this build (for a flight's accounting: sizes, chunks, jobs)."""
        self.feeds += part.feeds
        self.prompt += part.prompt
        self.chunks += part.chunks
        self.jobs.update(part.jobs)

    @property
    def prefill_tokens(self) -> int:
        return sum(count for _, count in self.chunks)

    def with_prompt_chunk(self, seq_id: int, start: int, count: int) -> Step:
        """This step plus ``count`` prompt tokens of a newly admitted sequence from ``start``."""
        return Step(tuple(self.seq_ids) + (seq_id,) * count,
                    tuple(self.positions) + tuple(range(start, start + count)))


@dataclass
class _InFlight:
    """A dispatched forward whose token ids the host has not read yet."""

    build: _StepBuild
    ids: Optional["mx.array"]  # one drawn token per entry of ``draws``; None when none
    logits: "mx.array"
    draws: list[tuple[_Job, _Sample, bool]]  # (job, sample, is its first token)
    dispatched: float
    # (index of its first draw, logprob_arrays, each draw's top count or None) per part
    logprobs: list[tuple[int, tuple, list[Optional[int]]]] = field(default_factory=list)
    read: bool = False


@dataclass
class _Queued:
    """A step's forward, queued; ``ids`` is None until its draws are queued too."""

    logits: "mx.array"
    draws: list[tuple[_Job, _Sample, bool]]
    rows: list[int]  # each draw's row of ``logits``
    ids: Optional["mx.array"] = None
    logprobs: Optional[tuple] = None

    @property
    def constrained(self) -> bool:
        return any(sample.matcher is not None for _, sample, _ in self.draws)


class Engine:
    """Continuous batching of generation requests over one batched cache.

    Args:
        program: a loaded Program.
        kind: "batched-sequence", "batched-cell" or "single" (one request at a time).
        capacity: the cache's capacity (positions held by all sequences, or cells);
            defaults to the model's max context.
        max_batch_tokens: the most tokens one forward carries (clamped to the model's
            max step); also bounds how many samples decode at once.
        max_seqs: the most live cache sequences.
        kv_dtype, initial_capacity: passed to the cache (see Session).
        prompt_cache_tokens: the most tokens finished requests' sequences keep in the cache
            for later prompts to fork (0, the default here, keeps none; ``open_engine``
            defaults to the capacity). They use only room no request has reserved.
    """

    def __init__(
        self,
        program,
        kind: str = KIND_BATCHED_SEQUENCE,
        capacity: Optional[int] = None,
        max_batch_tokens: Optional[int] = None,
        max_seqs: Optional[int] = None,
        kv_dtype: Optional[str] = None,
        initial_capacity: int = 512,
        prompt_cache_tokens: int = 0,
    ) -> None:
        if isinstance(prompt_cache_tokens, bool) or not isinstance(prompt_cache_tokens, int) or prompt_cache_tokens < 0:
            raise EngineError(f"prompt_cache_tokens must be an integer >= 0, got {prompt_cache_tokens!r}")
        # Imported here so that building requests (and the server's parsing and command
        # line) does not load MLX.
        from . import device_sampling
        from mlx_pte.interpreter.session import Session

        self._sampling = device_sampling

        self.session = Session(
            program, kind, capacity=capacity, kv_dtype=kv_dtype,
            initial_capacity=initial_capacity, max_seqs=max_seqs,
        )
        self.kind = kind
        self.cache = self.session.cache
        manifest = self.session.manifest
        self.capacity = self.cache.capacity
        self.max_context = manifest.max_context
        self.max_seqs = self.cache.max_seqs()
        budget = max_batch_tokens if max_batch_tokens is not None else self.session.max_step
        if budget < 1:
            raise EngineError(f"max_batch_tokens must be at least 1, got {budget}")
        self.token_budget = min(budget, self.session.max_step)
        self.vocab_size = manifest.vocab_size
        self.eos_ids = frozenset(manifest.eos_token_ids)
        self.codec = TextCodec(manifest) if manifest.tokenizer else None
        self._manifest = manifest
        self.stats = EngineStats()
        self.prompt_store = PromptStore(prompt_cache_tokens, self.cache.seq_rm)
        self.load = EngineLoad()

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[_Job] = []
        self._next_id = 0
        self._waiting: deque[_Job] = deque()
        self._active: list[_Job] = []  # admitted, in admission order
        self._reserved = 0
        self._slots = 0  # decode slots (samples) reserved by admitted jobs
        self._worker: Optional[threading.Thread] = None
        self._stopping = False
        self._in_flight: Optional[_InFlight] = None
        self._last_read = 0.0  # when the host last read a forward's token ids

    # -- submitting (any thread) ----------------------------------------------------------
    def submit(self, request: Request, on_event: Optional[Callable[[Event], None]] = None) -> RequestHandle:
        """Queue ``request``; returns its handle at once.

        Args:
            on_event: called on the engine's thread with each Event, as it happens.
        Raises:
            EngineError: a malformed request (empty prompt, unknown token ids, text
                without a tokenizer, bad n or max_tokens).
            RequestRejected: a request that can never fit this engine.
        """
        ids = self._prompt_ids(request)
        cap, units = self._limits(request, len(ids))
        try:
            stops = StopStrings.of(request.stop)
        except StopStringError as exc:
            raise EngineError(str(exc)) from None
        samples = self._new_samples(request, stops)
        with self._wake:
            handle = RequestHandle(self._next_id, request, len(ids), on_event)
            self._next_id += 1
            self._inbox.append(_Job(handle, ids, cap, units, samples))
            self._wake.notify()
        return handle

    def vocabulary(self):
        """The tokenizer as the grammar engine sees it (``grammar.TokenVocabulary``: token
        bytes, eos), built on first use.

        Raises:
            EngineError: the program has no tokenizer, or the grammar engine cannot read it.
        """
        from .grammar import GrammarError, TokenVocabulary

        if not self._manifest.tokenizer:
            raise EngineError("structured output and logprobs need the program's tokenizer, and it embeds none")
        try:
            return TokenVocabulary.of(self._manifest.tokenizer, self.vocab_size, sorted(self.eos_ids))
        except GrammarError as exc:
            raise EngineError(str(exc)) from None

    def encode(self, text: str) -> list[int]:
        if self.codec is None:
            raise EngineError(
                "this program embeds no tokenizer; send token ids, or re-export from a checkpoint "
                "directory that has tokenizer.json"
            )
        return self.codec.encode(text)

    def _prompt_ids(self, request: Request) -> list[int]:
        if isinstance(request.prompt, str):
            ids = self.encode(request.prompt)
        else:
            ids = [int(t) for t in request.prompt]
        if not ids:
            raise EngineError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _limits(self, request: Request, prompt_len: int) -> tuple[int, int]:
        """Validate ``request`` against the engine's fixed limits.

        Returns:
            The most positions each sample may hold, and the capacity units to reserve.
        """
        n = request.n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise EngineError(f"n must be a positive integer, got {n!r}")
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise EngineError(f"max_tokens must be a positive integer, got {request.max_tokens!r}")
        if request.stop and self.codec is None:
            raise EngineError("stop strings need the program's tokenizer; use stop_ids instead")
        k = request.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise EngineError(f"logprobs must be None or an integer from 0 to {MAX_TOP_LOGPROBS}, got {k!r}")
        if n > self.token_budget:
            raise RequestRejected(
                f"{n} samples need {n} decode tokens per step, but a step carries at most "
                f"{self.token_budget}; lower n or raise max_batch_tokens"
            )
        if self.max_seqs is not None and n > self.max_seqs:
            raise RequestRejected(f"{n} samples need {n} sequences, the cache allows {self.max_seqs}; lower n")
        # Each sample's fair share of the cache, so n samples never outgrow it together.
        cap = min(self.max_context, self.cache.sample_share(prompt_len, n))
        if prompt_len + 1 > cap:
            raise RequestRejected(
                f"the prompt has {prompt_len} tokens, but each of its {n} sample(s) may hold at most "
                f"{cap} positions (cache capacity {self.capacity}, model context {self.max_context}); "
                "shorten the prompt, lower n or raise the capacity"
            )
        # The last sampled token is never fed, so a sample holds at most prompt + max - 1.
        final_len = min(prompt_len + request.max_tokens - 1, cap)
        return cap, self.cache.footprint(prompt_len, n, final_len)

    def _new_samples(self, request: Request, stops: StopStrings) -> list[_Sample]:
        return [
            _Sample(
                index=i,
                stream=self._sampling.TokenStream.start(_seeded(request.sampling, i)),
                stop_text=StopText(stops),
                decoder=IncrementalDecoder(self.codec) if self.codec else None,
                matcher=self._matcher(request.grammar) if request.grammar is not None else None,
                logprob_top=request.logprobs,
            )
            for i in range(request.n)
        ]

    def _matcher(self, grammar: "Grammar") -> "Matcher":
        from .grammar import GrammarError

        try:
            return self.vocabulary().matcher(grammar)
        except GrammarError as exc:
            raise EngineError(str(exc)) from None

    # -- running ------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._waiting or self._active or self._in_flight)

    def step(self) -> bool:
        """One iteration: admit, dispatch one forward (tokens drawn on the device), then
        read the previous forward's tokens (emit, stop, finish) while the device computes
        this one. False if idle."""
        self._take_inbox()
        self._drop_cancelled()
        previous, self._in_flight = self._in_flight, None
        build = self._build_step()
        if build.size:
            self._in_flight = self._dispatch(build, previous)
        if previous is not None and not previous.read:  # a constrained step reads it sooner
            self._read(previous)
        self.load = EngineLoad(len(self._inbox) + len(self._waiting), len(self.sequences()),
                               self._reserved, self.cache.usage().logical_positions)
        return bool(build.size) or previous is not None

    def run(self) -> None:
        """Iterate on the calling thread until every submitted request has ended."""
        if self._worker is not None:
            raise EngineError("the engine runs on its worker thread; submit and wait on handles instead")
        while self.has_work:
            self.step()

    def start(self) -> None:
        """Run the engine loop on a worker thread until ``stop()``."""
        if self._worker is not None:
            return
        self._stopping = False
        self._worker = threading.Thread(target=self._loop, name="mlx-pte-engine", daemon=True)
        self._worker.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop the worker; requests still in flight fail with a reason."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._worker is not None:
            self._worker.join(timeout)
            self._worker = None
        self._take_inbox()
        self._in_flight = None
        for job in list(self._waiting) + list(self._active):
            self._fail(job, "the engine stopped before the request finished")

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not (self._inbox or self._waiting or self._active or self._in_flight):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:  # an engine bug must not kill the server
                for job in list(self._waiting) + list(self._active):
                    self._fail(job, f"the engine failed: {type(exc).__name__}: {exc}")

    # -- views --------------------------------------------------------------------------
    def sequences(self) -> list[SequenceState]:
        """Every live cache sequence with the length the engine accounts to it."""
        out = []
        for job in self._active:
            for s in job.samples:
                if s.seq_id is not None and s.finish_reason is None:
                    out.append(SequenceState(job.handle.id, s.index, s.seq_id, s.length, s.drawn - len(s.tokens)))
        return out

    def waiting(self) -> list[RequestHandle]:
        return [job.handle for job in self._waiting]

    # -- one iteration --------------------------------------------------------------------
    def _take_inbox(self) -> None:
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.handle._cancelled.is_set()]:
            self._waiting.remove(job)
            job.handle._close(Status.CANCELLED, Event(job.handle.id, 0, finish_reason="cancelled"))
        for job in [j for j in self._active if j.handle._cancelled.is_set()]:
            try:
                for sample in job.samples:
                    if sample.finish_reason is None:
                        self._finish(job, sample, "cancelled")
            except Exception as exc:
                self._fail(job, f"cancelling the request failed: {type(exc).__name__}: {exc}")

    def _build_step(self) -> _StepBuild:
        build = _StepBuild()
        for job in self._active:
            for sample in job.live:
                if sample.pending is not None:
                    build.add_decode(job, sample)
        for job in self._active:
            if job.fed < job.prompt_len and build.size < self.token_budget:
                self._add_chunk(build, job, job.samples[0].seq_id)  # type: ignore[arg-type]
        while self._waiting and build.size < self.token_budget:
            head = self._waiting[0]
            if not self._admit(head, build):
                if not self._active:
                    # Refused by an empty cache: it never will be admitted.
                    self._waiting.popleft()
                    self._fail(head, f"the request cannot start: {head.handle.waiting_reason}")
                    continue
                break
            self._waiting.popleft()
        return build

    def _chunk_len(self, job: _Job, build: _StepBuild) -> int:
        return min(job.prompt_len - job.fed, self.token_budget - build.size)

    def _add_chunk(self, build: _StepBuild, job: _Job, seq_id: int) -> None:
        count = self._chunk_len(job, build)
        build.add(job, seq_id, job.ids[job.fed : job.fed + count], job.fed)
        if job.fed + count == job.prompt_len:
            build.rows.append((build.size - 1, job, None))
        build.chunks.append((job, count))

    def _admit(self, job: _Job, build: _StepBuild) -> bool:
        """Admit the head of the queue into ``build`` if room allows; else say why it waits."""
        n = len(job.samples)
        reason = None
        if self._slots + n > self.token_budget:
            reason = (
                f"all {self.token_budget} decode slots of a step are taken ({self._slots} samples "
                f"running); it starts when some finish"
            )
        elif self.max_seqs is not None and self._slots + n > self.max_seqs:
            reason = f"all {self.max_seqs} cache sequences are taken; it starts when some finish"
        elif self._reserved + job.footprint > self.capacity:
            reason = (
                f"it may grow to {job.footprint} of the cache's {self.capacity} units, and running "
                f"requests have reserved {self._reserved}; it starts when some finish"
            )
        if reason is None:
            seq_id = self._open_sequence(job)
            verdict = self._check_first_chunk(build, job, seq_id)
            if not verdict and (job.fed or len(self.prompt_store)):
                # Retained prompts never cost a request its start: retry as without them.
                self.cache.seq_rm(seq_id)
                self.prompt_store.clear()
                job.fed = 0
                seq_id = self.cache.seq_new()
                verdict = self._check_first_chunk(build, job, seq_id)
            if verdict:
                job.samples[0].seq_id = seq_id
                job.samples[0].length = job.fed
                self._active.append(job)
                self._reserved += job.footprint
                self._slots += n
                job.handle.status = Status.PREFILL
                job.handle.waiting_reason = None
                job.handle.stats.admitted = time.perf_counter()
                if job.fed:
                    job.handle.stats.cached_tokens = job.fed
                    self.stats.prefix_hits += 1
                    self.stats.cached_tokens += job.fed
                self._add_chunk(build, job, seq_id)
                return True
            self.cache.seq_rm(seq_id)
            job.fed = 0
            reason = verdict.reason
        job.handle.waiting_reason = reason
        return False

    def _check_first_chunk(self, build: _StepBuild, job: _Job, seq_id: int) -> Verdict:
        return self.cache.check_step(build.with_prompt_chunk(seq_id, job.fed, self._chunk_len(job, build)))

    def _open_sequence(self, job: _Job) -> int:
        """The sequence ``job``'s prompt starts in: a fork of the retained sequence sharing
        its longest prefix, where the cache can fork (``job.fed`` set to the shared
        length), else a new one. Retained sequences are evicted first as far as the
        request's reservation needs; the one it forks from goes last."""
        matches = self.prompt_store.matches(job.ids)
        self._shrink_store(job.footprint, len(job.samples), keep=matches[0].entry if matches else None)
        seq_id = None
        for match in matches:
            if match.entry in self.prompt_store and self.cache.can_clone(match.entry.seq_id, match.length):
                seq_id = self.cache.seq_clone(match.entry.seq_id, match.length)
                self.prompt_store.touch(match.entry)
                job.fed = match.length
                break
        self._shrink_store(job.footprint, len(job.samples))
        return seq_id if seq_id is not None else self.cache.seq_new()

    def _shrink_store(self, units: int = 0, seqs: int = 0, keep: Optional[Retained] = None) -> None:
        """Evict retained sequences (least recently used first, ``keep`` spared) until they
        fit beside the running requests' reservations plus ``units`` capacity units and
        ``seqs`` sequences more."""
        store = self.prompt_store
        while (self._reserved + units + store.tokens > self.capacity
               or (self.max_seqs is not None and self._slots + seqs + len(store) > self.max_seqs)):
            if not store.evict_lru(keep):
                return

    def _dispatch(self, build: _StepBuild, previous: Optional[_InFlight]) -> Optional[_InFlight]:
        """Queue the step's forward and its draws on the device; None if it failed.

        A failed forward leaves the cache as it was (the session aborts the step). With
        one request in the step, that request failed; with several, each runs alone, so
        only those whose own forward fails end.
        """
        import mlx.core as mx

        dispatched = time.perf_counter()
        try:
            queued = self._queue(build, previous)
        except Exception as exc:
            if len(build.jobs) == 1:
                self._fail_step(build, exc)
                return None
            return self._dispatch_alone(build, previous, dispatched)
        if queued.constrained:
            mx.async_eval(queued.logits)
            self._advance(build, queued.draws)
            if not self._draw_constrained(queued, build, previous):
                return None
        else:
            # A step that only prefills draws nothing; its logits stand for its work.
            mx.async_eval(queued.ids if queued.ids is not None else queued.logits)
            self._advance(build, queued.draws)
        return _InFlight(build, queued.ids, queued.logits, queued.draws, dispatched, self._logprob_parts(queued))

    def _logprob_parts(self, queued: _Queued, first_draw: int = 0) -> list:
        if queued.logprobs is None:
            return []
        return [(first_draw, queued.logprobs, [s.logprob_top for _, s, _ in queued.draws])]

    def _draw_constrained(self, queued: _Queued, build: _StepBuild, previous: Optional[_InFlight]) -> bool:
        """Queue the draws of a step with constrained samples, its forward already queued
        and accounted: first the previous step's tokens are read (the masks depend on
        them), while the device computes. False if the draws failed (the step's
        requests failed with them)."""
        import mlx.core as mx

        if previous is not None and not previous.read:
            self._read(previous)
        try:
            queued.ids, queued.logprobs = self._draw(queued)
            mx.async_eval(queued.ids)
        except Exception as exc:
            self._fail_step(build, exc)
            return False
        return True

    def _draw(self, queued: _Queued) -> tuple["mx.array", Optional[tuple]]:
        """Token ids drawn from the step's rows, masked by each sample's grammar, and,
        when some draw wants them, the log-probabilities of those same rows (lazy)."""
        from .logprobs import logprob_arrays

        samples = [sample for _, sample, _ in queued.draws]
        rows = self._sampling.take_rows(queued.logits, queued.rows)
        if queued.constrained:
            from .token_masks import apply_masks

            rows = apply_masks(rows, self._masks(queued.draws))
        ids = self._sampling.draw(rows, [s.stream for s in samples])
        wants = [s.logprob_top for s in samples if s.logprob_top is not None]
        return ids, (logprob_arrays(rows, ids, max(wants)) if wants else None)

    def _masks(self, draws: list[tuple[_Job, _Sample, bool]]):
        """Each draw's allowed-token bitmask; a sample whose grammar fails here fails alone
        (its row is left unmasked, and its token unread)."""
        from .grammar import masks

        def failed(row: int, exc: Exception) -> None:
            self._fail(draws[row][0], f"the request's grammar failed: {exc}")

        matchers = [sample.matcher if sample.finish_reason is None else None for _, sample, _ in draws]
        return masks(matchers, self.vocab_size, on_error=failed)

    def _queue(self, build: _StepBuild, previous: Optional[_InFlight]) -> _Queued:
        """The step's forward and, unless a sample is constrained, its draws (lazy)."""
        import mlx.core as mx

        draws: list[tuple[_Job, _Sample, bool]] = []
        draw_rows: list[int] = []
        for k, (_, job, sample) in enumerate(build.rows):
            for s in job.samples if sample is None else [sample]:
                draws.append((job, s, sample is None))
                draw_rows.append(k)
        tokens = mx.array(build.prompt, dtype=mx.int64)
        if build.feeds:
            assert previous is not None  # a sample is fed only what the previous forward drew
            fed = self._sampling.take_rows(previous.ids, build.feeds)
            tokens = mx.concatenate([fed.astype(mx.int64), tokens])
        rows = [r for r, _, _ in build.rows] or [build.size - 1]  # the program needs at least one row
        logits = self.session.forward(tokens, build.positions, build.seq_ids, rows, evaluate=False)
        queued = _Queued(logits, draws, draw_rows)
        if not draws or queued.constrained:  # constrained draws wait for their masks
            return queued
        try:
            queued.ids, queued.logprobs = self._draw(queued)
        except Exception:  # the cache holds the step already: take it back before retrying
            self._rewind_step(build)
            raise
        return queued

    def _rewind_step(self, build: _StepBuild) -> None:
        """Undo a step the cache has committed: each sequence back to where the step began."""
        start: dict[int, int] = {}
        for seq, pos in zip(build.seq_ids, build.positions):
            start[seq] = min(pos, start.get(seq, pos))
        for seq, pos in start.items():
            self.cache.rewind(seq, pos)

    def _dispatch_alone(self, build: _StepBuild, previous: Optional[_InFlight],
                        dispatched: float) -> Optional[_InFlight]:
        """Run each request of a failed step alone, evaluated at once (failures are rare;
        this keeps each one's error its own), as one flight of the parts that worked."""
        import mlx.core as mx

        ids: list = []
        draws: list[tuple[_Job, _Sample, bool]] = []
        logprobs: list = []
        kept = _StepBuild()
        last = None
        for job in list(build.jobs.values()):
            part = build.only(job)
            try:
                queued = self._queue(part, previous)
                mx.eval(queued.ids if queued.ids is not None else queued.logits)
            except Exception as exc:
                self._fail_step(part, exc)
                continue
            self._advance(part, queued.draws, first_draw=len(draws))
            if queued.constrained:
                if not self._draw_constrained(queued, part, previous):
                    continue
                mx.eval(queued.ids)
            ids += [queued.ids] if queued.ids is not None else []
            logprobs += self._logprob_parts(queued, first_draw=len(draws))
            draws += queued.draws
            kept.absorb(part)
            last = queued.logits
        if last is None:
            return None
        return _InFlight(kept, mx.concatenate(ids) if ids else None, last, draws, dispatched, logprobs)

    def _advance(self, build: _StepBuild, draws: list[tuple[_Job, _Sample, bool]], first_draw: int = 0) -> None:
        """The host's account of a dispatched step: positions held, forks, draws."""
        for job, count in build.chunks:
            job.fed += count
            job.samples[0].length = job.fed
        for _, job, sample in build.rows:
            if sample is not None:
                sample.length += 1
            else:  # the prompt is in: one sequence per extra sample
                first = job.samples[0]
                for fork in job.samples[1:]:
                    fork.seq_id = self.cache.seq_clone(first.seq_id, job.prompt_len)
                    fork.length = job.prompt_len
        for i, (job, sample, _) in enumerate(draws):
            sample.drawn += 1
            # Fed next step unless it is the last token or its sequence is full.
            more = sample.drawn < job.handle.request.max_tokens and sample.length + 1 <= job.cap
            sample.pending = first_draw + i if more else None

    def _read(self, flight: _InFlight) -> None:
        """Wait for a dispatched step's token ids, then emit them and end what they end."""
        import mlx.core as mx

        flight.read = True
        try:
            if flight.ids is None:
                mx.eval(flight.logits)
            ids = flight.ids.tolist() if flight.ids is not None else []
            records = self._logprob_records(flight, ids)
        except Exception as exc:
            self._fail_step(flight.build, exc)
            return
        now = time.perf_counter()
        # The device runs steps in order: this one started when dispatched or when the
        # previous one was read, whichever came later.
        self._count(flight.build, now - max(flight.dispatched, self._last_read))
        self._last_read = now
        for (job, sample, first), token, record in zip(flight.draws, ids, records):
            if sample.finish_reason is not None:  # ended (stop, cancel, failure) after dispatch
                continue
            if first and job.handle.status == Status.PREFILL:
                job.handle.status = Status.DECODING
                job.handle.stats.first_token = now
            try:  # detokenizing, a stop check or a grammar that fails ends this request only
                self._accept(job, sample, int(token), first_token=first, logprob=record)
            except Exception as exc:
                self._fail(job, f"the request failed after its forward: {type(exc).__name__}: {exc}")

    @staticmethod
    def _logprob_records(flight: _InFlight, ids: list[int]) -> list[Optional["TokenLogprob"]]:
        """Each draw's log-probability record (None where the request asked for none)."""
        records: list[Optional["TokenLogprob"]] = [None] * len(ids)
        if flight.logprobs:
            from .logprobs import read

            for first, arrays, wants in flight.logprobs:
                chunk = read(ids[first : first + len(wants)], arrays, [w or 0 for w in wants])
                for i, (want, record) in enumerate(zip(wants, chunk)):
                    if want is not None:
                        records[first + i] = record
        return records

    def _fail_step(self, build: _StepBuild, exc: Exception) -> None:
        for job in build.jobs.values():
            self._fail(job, f"the forward failed: {type(exc).__name__}: {exc}")

    def _count(self, build: _StepBuild, seconds: float) -> None:
        st = self.stats
        st.steps += 1
        st.step_tokens += build.size
        st.prompt_tokens += build.prefill_tokens
        st.busy_seconds += seconds
        if not build.chunks:
            st.decode_steps += 1
            st.decode_tokens += build.size
            st.decode_seconds += seconds

    def _accept(self, job: _Job, sample: _Sample, token: int, first_token: bool = False,
                logprob: Optional["TokenLogprob"] = None) -> None:
        sample.tokens.append(token)
        if logprob is not None:
            sample.logprobs.append(logprob)
        job.handle.stats.generated_tokens += 1
        self.stats.generated_tokens += 1
        if not first_token:
            job.handle.stats.decoded_tokens += 1
        piece = sample.stop_text.push(sample.decoder.push(token)) if sample.decoder else ""
        request = job.handle.request
        eos = token in self.eos_ids
        if sample.matcher is not None and not eos:
            sample.matcher.consume(token)
        if sample.stop_text.stopped:
            reason = "stop"
        elif token in request.stop_ids or (eos and not request.ignore_eos):
            reason = "stop"
        elif sample.matcher is not None and (sample.matcher.done or eos):  # nothing more may follow
            reason = "stop"
        elif sample.drawn > len(sample.tokens):  # its next token is being drawn
            reason = None
        elif len(sample.tokens) >= request.max_tokens:
            reason = "length"
        else:
            reason = "capacity"
        job.handle._emit(Event(job.handle.id, sample.index, token, piece, logprob=logprob))
        if reason is not None:
            self._finish(job, sample, reason)

    def _finish(self, job: _Job, sample: _Sample, reason: str) -> None:
        sample.finish_reason = reason
        sample.pending = None
        tail = ""
        if sample.decoder and not sample.stop_text.stopped and reason != "cancelled":
            tail = sample.stop_text.push(sample.decoder.flush()) + sample.stop_text.flush()
        if sample.stop_text.stopped:
            sample.tokens = sample.tokens[: self._kept_tokens(sample)]
            del sample.logprobs[len(sample.tokens):]
        if sample.seq_id is not None:
            # Keep the cache's history equal to what the caller sees, then keep it for
            # the prompt store (when the job ends) or drop it.
            kept = min(job.prompt_len + len(sample.tokens), sample.length)
            if kept < sample.length and self.cache.can_rewind(sample.seq_id, kept):
                self.cache.rewind(sample.seq_id, kept)
                sample.length = kept
            if self.prompt_store.budget and reason != "cancelled" and sample.length == kept:
                job.finished.append((sample.seq_id, job.ids + sample.tokens[: kept - job.prompt_len]))
            else:
                self.cache.seq_rm(sample.seq_id)
            sample.seq_id = None
        event = Event(job.handle.id, sample.index, text=tail, finish_reason=reason)
        if all(s.finish_reason is not None for s in job.samples):
            self._complete(job, event)
        else:
            job.handle._emit(event)

    def _kept_tokens(self, sample: _Sample) -> int:
        """The most tokens whose text fits inside the text kept before the stop string."""
        kept_text = sample.stop_text.text
        for k in range(len(sample.tokens), -1, -1):
            text = self.codec.decode(sample.tokens[:k])  # type: ignore[union-attr]
            if kept_text.startswith(text):
                return k
        return 0

    def _complete(self, job: _Job, last: Event) -> None:
        self._release(job, retain=True)
        if any(s.finish_reason == "cancelled" for s in job.samples):
            job.handle._close(Status.CANCELLED, last)
            return
        samples = [SampleResult(s.index, s.tokens, s.stop_text.text, s.finish_reason or "", tuple(s.logprobs))
                   for s in job.samples]
        job.handle._close(Status.DONE, last, Completion(job.handle.id, job.prompt_len, samples, job.handle.stats))

    def _fail(self, job: _Job, error: str) -> None:
        if job.handle.status in FINISHED:
            return
        for sample in job.samples:
            if sample.seq_id is not None:  # still in the cache, even if it failed while finishing
                self.cache.seq_rm(sample.seq_id)
                sample.seq_id = None
            sample.finish_reason = sample.finish_reason or "error"
        if job in self._waiting:
            self._waiting.remove(job)
        self._release(job)
        job.handle._close(Status.FAILED, Event(job.handle.id, 0, error=error), error=error)

    def _release(self, job: _Job, retain: bool = False) -> None:
        """Give back what ``job`` reserved; its finished sequences go to the prompt store
        (``retain``) or are removed."""
        if job in self._active:
            self._active.remove(job)
            self._reserved -= job.footprint
            self._slots -= len(job.samples)
        for seq_id, tokens in job.finished:
            if retain:
                self.prompt_store.add(seq_id, tokens)
            else:
                self.cache.seq_rm(seq_id)
        job.finished.clear()
        self._shrink_store()


def _seeded(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def open_engine(model: str, kind: str, capacity: Optional[int] = None, max_batch_tokens: Optional[int] = None,
                max_seqs: Optional[int] = None, kv_dtype: Optional[str] = None,
                tokenizer: Optional[str] = None, prompt_cache_tokens: Optional[int] = None) -> Engine:
    """An engine over the program in the .pte file ``model`` (tokenizer: see ``load``);
    capacity defaults to room for a few full-context requests at once, the prompt store
    to the whole capacity (retained prompts only use room no request has reserved)."""
    from mlx_pte.interpreter.program import load

    program = load(model, tokenizer=tokenizer)
    if capacity is None:
        capacity = DEFAULT_CAPACITY_CONTEXTS * int(program.manifest["max_context"])
    return Engine(program, kind, capacity=capacity, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                  kv_dtype=kv_dtype,
                  prompt_cache_tokens=capacity if prompt_cache_tokens is None else prompt_cache_tokens)
