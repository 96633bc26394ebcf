"""The engine: an inbox, a worker thread, and one ``step()`` that runs the data path.

Each step, in this order: take the inbox; end cancelled requests; plan the step
(``scheduler``); launch its forward (``runner``); account for it on the host (positions,
forks, where each sample's next token will be drawn); read the previous step's tokens
(``readout``) — before the masks when a grammar needs that step's tokens, else while the
device computes this one; queue the remaining (constrained) draws. Iterations are so
pipelined the way ``generate()`` is: tokens are chosen on the device, and each step is
dispatched before the previous one's ids are read, so the host plans step n+1 while the
device computes step n. A decoding sample is fed its token unread, straight from the
previous step's ids; what the host learns only on reading (eos, a stop string) ends the
sample one step late, and its extra position is dropped with its sequence. (On MLX's CPU
backend the overlap is small: ``async_eval`` waits while more than 10 scheduler tasks are
in flight, and there every op is a task; on a GPU the tasks are command buffers.)

``n > 1`` samples of one prompt prefill once; right after the prefill the sequence is
forked once per extra sample, each sample drawing from the same last-row logits with its
own key chain (seeds ``seed, seed + 1, ...``); a fork that fails ends its request only.
With ``Request.grammar``, each sample's allowed tokens are masked on the device in the
same batched draw as every other row; eos is allowed only where the grammar accepts, and a
sample whose grammar is complete stops. With ``logprobs``, each draw also returns the
token's log-probability and the top alternatives, from the same (masked) rows.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Optional

from mlx_pte.runtime.cache import KIND_BATCHED_SEQUENCE

from ..sampling.params import SamplingParams
from ..text.detokenizer import IncrementalDecoder
from ..text.model_text import ModelText, TextError
from ..text.stops import StopStringError, StopStrings, StopText
from .jobs import Failures, Job, Sample
from .prompt_store import PromptStore
from .readout import Readout
from .requests import (
    DEFAULT_CAPACITY_CONTEXTS,
    FINISHED,
    EngineError,
    EngineLoad,
    EngineStats,
    Event,
    Request,
    RequestHandle,
    SequenceState,
    Status,
    check_request,
)
from .runner import Flight, Runner
from .scheduler import Limits, Scheduler
from .step_plan import StepPlan

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
        launch: how steps are handed to MLX ("thread" or "inline"; see Session).
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
        launch: Optional[str] = None,
    ) -> None:
        if isinstance(prompt_cache_tokens, bool) or not isinstance(prompt_cache_tokens, int) or prompt_cache_tokens < 0:
            raise EngineError(f"prompt_cache_tokens must be an integer >= 0, got {prompt_cache_tokens!r}")
        # Imported here so that building requests (and the server's parsing and command
        # line) does not load MLX.
        from ..sampling import device as device_sampling
        from mlx_pte.interpreter.session import Session

        self._sampling = device_sampling
        self.session = Session(
            program, kind, capacity=capacity, kv_dtype=kv_dtype,
            initial_capacity=initial_capacity, max_seqs=max_seqs, launch=launch,
        )
        self.kind = kind
        self.cache = self.session.cache
        manifest = self.session.manifest
        budget = max_batch_tokens if max_batch_tokens is not None else self.session.max_step
        if budget < 1:
            raise EngineError(f"max_batch_tokens must be at least 1, got {budget}")
        self.limits = Limits(min(budget, self.session.max_step), self.cache.capacity, manifest.max_context,
                             self.cache.max_seqs())
        self.text = ModelText.of(manifest)
        self.vocab_size = self.text.vocab_size
        self.eos_ids = self.text.eos_ids
        self.codec = self.text.codec
        self.stats = EngineStats()
        self.prompt_store = PromptStore(prompt_cache_tokens, self.cache.seq_rm)
        self.scheduler = Scheduler(self.cache, self.limits, self.prompt_store, self.stats)
        self.runner = Runner(self.session, self.vocab_size)
        self.readout = Readout(self.codec, self.eos_ids, self.stats)
        self.load = EngineLoad()

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Job] = []
        # Run on the worker before its next step (True), or told it never will (False).
        self._tasks: list[Callable[[bool], None]] = []
        self._next_id = 0
        self._worker: Optional[threading.Thread] = None
        self._stopping = False
        self._in_flight: Optional[Flight] = None
        self._last_read = 0.0  # when the host last read a forward's token ids
        self._waited = 0.0  # seconds this step waited for token ids (not host work)

    # The engine's limits, as callers read them.
    @property
    def token_budget(self) -> int:
        return self.limits.token_budget

    @property
    def capacity(self) -> int:
        return self.limits.capacity

    @property
    def max_context(self) -> int:
        return self.limits.max_context

    @property
    def max_seqs(self) -> Optional[int]:
        return self.limits.max_seqs

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
        check_request(request)
        if request.stop and self.codec is None:
            raise EngineError("stop strings need the program's tokenizer; use stop_ids instead")
        cap, units = self.scheduler.sizes(len(ids), request.n, request.max_tokens)
        try:
            stops = StopStrings.of(request.stop)
        except StopStringError as exc:
            raise EngineError(str(exc)) from None
        samples = self._new_samples(request, stops)
        with self._wake:
            handle = RequestHandle(self._next_id, request, len(ids), on_event)
            self._next_id += 1
            self._inbox.append(Job(handle, ids, cap, units, samples))
            self._wake.notify()
        return handle

    def vocabulary(self):
        """The tokenizer as the grammar engine sees it (``ModelText.vocabulary``).

        Raises:
            EngineError: the program has no tokenizer, or the grammar engine cannot read it.
        """
        try:
            return self.text.vocabulary()
        except TextError as exc:
            raise EngineError(str(exc)) from None

    def encode(self, text: str) -> list[int]:
        try:
            return self.text.encode(text)
        except TextError as exc:
            raise EngineError(str(exc)) from None

    def _prompt_ids(self, request: Request) -> list[int]:
        try:
            return self.text.prompt_ids(request.prompt)
        except TextError as exc:
            raise EngineError(str(exc)) from None

    def _new_samples(self, request: Request, stops: StopStrings) -> list[Sample]:
        return [
            Sample(
                index=i,
                stream=self._sampling.TokenStream.start(_seeded(request.sampling, i)),
                stop_text=StopText(stops),
                decoder=IncrementalDecoder(self.codec) if self.codec else None,
                matcher=self._matcher(request.grammar) if request.grammar is not None else None,
                logprob_top=request.logprobs,
            )
            for i in range(request.n)
        ]

    def _matcher(self, grammar):
        from ..sampling.grammar import GrammarError

        try:
            return self.vocabulary().matcher(grammar)
        except GrammarError as exc:
            raise EngineError(str(exc)) from None

    # -- running ------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self.scheduler.has_work or self._in_flight)

    def step(self) -> bool:
        """One iteration of the data path (the module docstring gives its order). False
        if idle."""
        # Everything the step makes on the device (forwards, draws, the scheduler's forks
        # of K/V) is built for the session's launcher, in the order it is launched.
        with self.session.launcher.building():
            return self._step()

    def _step(self) -> bool:
        start, self._waited = time.perf_counter(), 0.0
        self._take_inbox()
        self._cancel()
        previous, self._in_flight = self._in_flight, None
        plan = self.scheduler.plan()
        for job, reason in plan.refused:
            self._fail(job, reason)
        launched = 0.0
        if plan.step.size:
            launched = time.perf_counter()
            launch = self.runner.launch(plan.step, previous)
            self._fail_all(launch.failures)
            first = 0
            for part in launch.parts:
                self._fail_all(self.scheduler.advance(part.plan, part.draws, first))
                first += len(part.draws)
            if launch.needs_masks and previous is not None:
                self._read(previous)  # a grammar's mask depends on the previous step's tokens
            self._in_flight, failures = self.runner.draw(launch)
            launched = time.perf_counter() - launched
            self._fail_all(failures)
        if previous is not None and not previous.read:
            self._read(previous)
        if plan.step.size and not plan.step.chunks:
            self.stats.decode_host_seconds += time.perf_counter() - start - self._waited
            self.stats.decode_launch_seconds += launched
        self.load = EngineLoad(len(self._inbox) + len(self.scheduler.waiting), len(self.sequences()),
                               self.scheduler.reserved, self.cache.usage().logical_positions)
        return bool(plan.step.size) or previous is not None

    def warm_up(self) -> float:
        """Trace every shape bucket a step of this engine can take (token counts up to the
        token budget, and as many sampled rows), so no request waits for a compilation;
        returns the seconds it took. Call it before submitting anything; once ``start``ed,
        the warm-up runs on the engine's thread (MLX keeps compiled graphs per thread).

        Raises:
            EngineError: the engine already holds requests.
        """
        if self.has_work or self.scheduler.has_work:
            raise EngineError("warm the engine up before submitting requests")
        worker = self._worker
        if worker is None or worker is threading.current_thread():
            return self._warm_up()
        done: "queue.SimpleQueue[tuple[Optional[float], Optional[BaseException]]]" = queue.SimpleQueue()

        def task(run: bool) -> None:
            if not run:
                done.put((None, EngineError("the engine stopped before it warmed up")))
                return
            try:
                done.put((self._warm_up(), None))
            except BaseException as exc:
                done.put((None, exc))

        with self._wake:
            self._tasks.append(task)
            self._wake.notify()
        seconds, error = done.get()
        if error is not None:
            raise error
        return seconds  # type: ignore[return-value]

    def _warm_up(self) -> float:
        from mlx_pte.interpreter.capture import bucket

        start = time.perf_counter()
        most = min(self.limits.token_budget, self.limits.capacity)
        sizes = sorted({bucket(n, self.session.max_step) for n in range(1, most + 1)})
        self.prompt_store.clear()  # its sequences go with the cache's clearing
        # Built as the steps are: compiled segments are kept per stream.
        with self.session.launcher.building():
            self.runner.warm_up([size for size in sizes if size <= self.limits.capacity])
        return time.perf_counter() - start

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
        with self._lock:
            tasks, self._tasks = self._tasks, []
        for task in tasks:
            task(False)
        for job in self.scheduler.jobs():
            self._fail(job, "the engine stopped before the request finished")

    def _loop(self) -> None:
        from mlx_pte.runtime.mlx.launcher import release_thread_state

        try:
            self._serve()
        finally:
            release_thread_state()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._tasks or self._inbox or self.scheduler.has_work
                           or self._in_flight):
                    self._wake.wait()
                if self._stopping:
                    return
                tasks, self._tasks = self._tasks, []
            for task in tasks:  # each reports its own outcome
                task(True)
            try:
                self.step()
            except Exception as exc:  # an engine bug must not kill the server
                for job in self.scheduler.jobs():
                    self._fail(job, f"the engine failed: {type(exc).__name__}: {exc}")

    # -- views --------------------------------------------------------------------------
    def sequences(self) -> list[SequenceState]:
        """Every live cache sequence with the length the engine accounts to it."""
        return self.scheduler.sequences()

    def waiting(self) -> list[RequestHandle]:
        return self.scheduler.waiting_handles()

    # -- the stages' glue -----------------------------------------------------------------
    def _take_inbox(self) -> None:
        with self._lock:
            self.scheduler.enqueue(self._inbox)
            self._inbox.clear()

    def _cancel(self) -> None:
        for job in self.scheduler.take_cancelled():
            job.handle._close(Status.CANCELLED, Event(job.handle.id, 0, finish_reason="cancelled"))
        for job in [j for j in self.scheduler.active if j.handle._cancelled.is_set()]:
            try:
                for sample in job.samples:
                    if sample.finish_reason is None:
                        self._finish(job, sample, "cancelled")
            except Exception as exc:
                self._fail(job, f"cancelling the request failed: {type(exc).__name__}: {exc}")

    def _read(self, flight: Flight) -> None:
        """Wait for a dispatched step's token ids, then emit them and end what they end."""
        waiting = time.perf_counter()
        tokens = self.runner.collect(flight)
        self._waited += time.perf_counter() - waiting
        if tokens.error is not None:
            self._fail_all([(job, tokens.error) for job in flight.plan.jobs.values()])
            return
        now = time.perf_counter()
        # The device runs steps in order: this one started when dispatched or when the
        # previous one was read, whichever came later.
        self._count(flight.plan, now - max(flight.dispatched, self._last_read))
        self._last_read = now
        for draw, token, record in zip(flight.draws, tokens.ids, tokens.records):
            job, sample = draw.job, draw.sample
            if sample.finish_reason is not None:  # ended (stop, cancel, failure) after dispatch
                continue
            if draw.first and job.handle.status == Status.PREFILL:
                job.handle.status = Status.DECODING
                job.handle.stats.first_token = now
            try:  # detokenizing, a stop check or a grammar that fails ends this request only
                reason = self.readout.accept(job, sample, int(token), first_token=draw.first, logprob=record)
                if reason is not None:
                    self._finish(job, sample, reason)
            except Exception as exc:
                self._fail(job, f"the request failed after its forward: {type(exc).__name__}: {exc}")

    def _count(self, plan: StepPlan, seconds: float) -> None:
        st = self.stats
        st.steps += 1
        st.step_tokens += plan.size
        st.prompt_tokens += plan.prefill_tokens
        st.busy_seconds += seconds
        if not plan.chunks:
            st.decode_steps += 1
            st.decode_tokens += plan.size
            st.decode_seconds += seconds

    def _finish(self, job: Job, sample: Sample, reason: str) -> None:
        last = self.readout.finish(job, sample, reason)
        # The cache's history stays equal to what the caller sees, kept for the prompt
        # store when the job ends, or dropped.
        self.scheduler.retire(job, sample, retain=reason != "cancelled")
        if job.ended:
            self.scheduler.release(job, retain=True)
            self.readout.complete(job, last)
        else:
            job.handle._emit(last)

    def _fail(self, job: Job, error: str) -> None:
        if job.handle.status in FINISHED:
            return
        self.scheduler.drop(job)
        job.handle._close(Status.FAILED, Event(job.handle.id, 0, error=error), error=error)

    def _fail_all(self, failures: Failures) -> None:
        for job, error in failures:
            self._fail(job, error)


def _seeded(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def open_engine(model: str, kind: str, capacity: Optional[int] = None, max_batch_tokens: Optional[int] = None,
                max_seqs: Optional[int] = None, kv_dtype: Optional[str] = None,
                tokenizer: Optional[str] = None, prompt_cache_tokens: Optional[int] = None,
                group: Any = None, launch: Optional[str] = None) -> Engine:
    """An engine over the program in the .pte file ``model`` (tokenizer, group: see ``load``);
    capacity defaults to room for a few full-context requests at once, the prompt store
    to the whole capacity (retained prompts only use room no request has reserved)."""
    from mlx_pte.interpreter.program import load

    program = load(model, tokenizer=tokenizer, group=group)
    if capacity is None:
        capacity = DEFAULT_CAPACITY_CONTEXTS * int(program.manifest["max_context"])
    return Engine(program, kind, capacity=capacity, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs,
                  kv_dtype=kv_dtype, launch=launch,
                  prompt_cache_tokens=capacity if prompt_cache_tokens is None else prompt_cache_tokens)
