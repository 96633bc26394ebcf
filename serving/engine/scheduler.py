"""Which tokens the next forward carries: queues, limits, admission, chunking, prefix reuse.

Pure Python over the cache's control face (``runtime.cache.CacheControl``): it plans on
any backend, the neutral byte-less one included, and never touches a tensor.

Each plan is ONE step: the pending token of every decoding sample first, then prefill
chunks of admitted requests in arrival order, then the first chunk of each newly admitted
request, up to the token budget. Requests are admitted strictly first-in first-out.

Admission reserves each request's worst-case footprint (every sample grown to its final
length, ``cache.footprint``) against the capacity, and one decode slot per sample against
the token budget. So a running sample always has room for its next token and a place in
the next step, and nothing is ever preempted; the cache's own ``check_step`` is the final
gate for every admission. A request that could never fit is refused when submitted
(``limits``), one refused by an empty cache fails with the reason, and one that waits
carries the reason on its handle (``waiting_reason``).

With a prompt store, a finished request's sequences stay in the cache keyed by the tokens
they hold; a later prompt sharing a prefix forks one (``seq_clone``) and prefills only the
rest, or, where it continues that conversation, takes the sequence over (``rewind``).
Retained sequences use only room no admitted request has reserved: admission evicts
them, least recently used first, before a request would have to wait (so whether and when
a request starts is decided as without the store) and before a new sequence would make
the cache allocate storage (``new_seq_allocates``).

Requests admitted beside a running prompt that shares at least ``MIN_SHARE`` leading
tokens with theirs (more than any retained sequence) prefill that part once: admitted as
usual (the same reservation), such a request carries ``share`` and waits without a
sequence until its source has written the shared part, then forks the source's sequence
there and prefills the rest. If the source ended first, or cannot fork, it starts cold.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from mlx_pte.runtime.cache import ALLOWED, CacheControl, CacheRefused, Verdict

from .jobs import Draw, Failures, Job, Sample
from .step_plan import Plan, StepPlan
from .prompt_store import Match, PromptStore, Retained
from .requests import EngineStats, RequestHandle, RequestRejected, SequenceState, Status


# The fewest shared prompt tokens worth waiting for: a request admitted beside a running
# prompt that shares fewer computes them itself rather than wait for them to be written.
MIN_SHARE = 4


@dataclass(frozen=True)
class Limits:
    """The engine's fixed limits: tokens per step, cache capacity, context, sequences."""

    token_budget: int
    capacity: int
    max_context: int
    max_seqs: Optional[int]


class Scheduler:
    def __init__(self, cache: CacheControl, limits: Limits, prompt_store: PromptStore,
                 stats: Optional[EngineStats] = None) -> None:
        self.cache = cache
        self.limits = limits
        self.prompt_store = prompt_store
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []  # admitted, in admission order
        self.reserved = 0  # capacity units reserved by admitted jobs
        self.slots = 0  # decode slots (samples) reserved by admitted jobs
        self.stats = stats if stats is not None else EngineStats()  # its prefix reuse totals

    # -- submitting -----------------------------------------------------------------------
    def sizes(self, prompt_len: int, n: int, max_tokens: int) -> tuple[int, int]:
        """The most positions each of ``n`` samples may hold, and the capacity units the
        request reserves when admitted.

        Raises:
            RequestRejected: it could never run within these limits (the reason says why).
        """
        lim = self.limits
        if n > lim.token_budget:
            raise RequestRejected(
                f"{n} samples need {n} decode tokens per step, but a step carries at most "
                f"{lim.token_budget}; lower n or raise max_batch_tokens"
            )
        if lim.max_seqs is not None and n > lim.max_seqs:
            raise RequestRejected(f"{n} samples need {n} sequences, the cache allows {lim.max_seqs}; lower n")
        # Each sample's fair share of the cache, so n samples never outgrow it together.
        cap = min(lim.max_context, self.cache.sample_share(prompt_len, n))
        if prompt_len + 1 > cap:
            raise RequestRejected(
                f"the prompt has {prompt_len} tokens, but each of its {n} sample(s) may hold at most "
                f"{cap} positions (cache capacity {lim.capacity}, model context {lim.max_context}); "
                "shorten the prompt, lower n or raise the capacity"
            )
        # The last sampled token is never fed, so a sample holds at most prompt + max - 1.
        final_len = min(prompt_len + max_tokens - 1, cap)
        return cap, self.cache.footprint(prompt_len, n, final_len)

    def enqueue(self, jobs: Sequence[Job]) -> None:
        self.waiting.extend(jobs)

    # -- planning -------------------------------------------------------------------------
    def plan(self) -> Plan:
        """The next step: decodes, continuing prefills, then admissions while room allows."""
        budget = self.limits.token_budget
        plan = Plan(StepPlan())
        step = plan.step
        for job in self.active:
            for sample in job.live:
                if sample.pending is not None:
                    step.add_decode(job, sample)
        for job in self.active:
            if job.fed < job.prompt_len and step.size < budget:
                if job.share is not None and self._take_share(job, step) is None:
                    continue  # its shared prefix is not written yet
                self._add_chunk(step, job, job.samples[0].seq_id)  # type: ignore[arg-type]
        while self.waiting and step.size < budget:
            head = self.waiting[0]
            if self._admit(head, step):
                self.waiting.popleft()
                continue
            if self.active:
                break
            # Refused by an empty cache: it never will be admitted.
            self.waiting.popleft()
            plan.refused.append((head, f"the request cannot start: {head.handle.waiting_reason}"))
        return plan

    def _chunk_len(self, job: Job, step: StepPlan) -> int:
        return min(job.prompt_len - job.fed, self.limits.token_budget - step.size)

    def _add_chunk(self, step: StepPlan, job: Job, seq_id: int) -> None:
        count = self._chunk_len(job, step)
        step.add_prompt(job, seq_id, job.ids[job.fed : job.fed + count], job.fed)
        if job.fed + count == job.prompt_len:
            step.rows.append((step.size - 1, job, None))
        step.chunks.append((job, count))

    def _admit(self, job: Job, step: StepPlan) -> bool:
        """Admit the head of the queue into ``step`` if room allows; else say why it waits."""
        reason = self._room_for(job)
        if reason is None:
            share = self._running_share(job)
            if share is not None:
                # The prefix is being prefilled by a running request: wait for it, then
                # fork it, rather than computing it twice. Its reservation starts now, so
                # retained prompts give way now, as they do for a request admitted cold.
                self._shrink_store(job.footprint, len(job.samples))
                job.share = share
                self._start(job, None)
                return True
            seq_id, verdict = self._first_chunk_in(step, job, self._open_sequence(job))
            if verdict:
                self._start(job, seq_id)
                self._add_chunk(step, job, seq_id)
                return True
            self.cache.seq_rm(seq_id)
            job.fed = 0
            reason = verdict.reason
        job.handle.waiting_reason = reason
        return False

    def _room_for(self, job: Job) -> Optional[str]:
        """Why the reservations leave no room for ``job`` now; None when they do."""
        lim, n = self.limits, len(job.samples)
        if self.slots + n > lim.token_budget:
            return (f"all {lim.token_budget} decode slots of a step are taken ({self.slots} samples "
                    f"running); it starts when some finish")
        if lim.max_seqs is not None and self.slots + n > lim.max_seqs:
            return f"all {lim.max_seqs} cache sequences are taken; it starts when some finish"
        if self.reserved + job.footprint > lim.capacity:
            return (f"it may grow to {job.footprint} of the cache's {lim.capacity} units, and running "
                    f"requests have reserved {self.reserved}; it starts when some finish")
        return None

    def _running_share(self, job: Job) -> Optional[tuple[Job, int]]:
        """The running request whose prompt shares the longest prefix with ``job``'s (at
        least ``MIN_SHARE`` tokens, more than any retained sequence offers), and that
        length; None when there is none."""
        best: Optional[tuple[Job, int]] = None
        limit = job.prompt_len - 1  # the prompt's last token is always computed, for its logits
        for other in self.active:
            length = _common_prefix(other.ids, job.ids, limit)
            if length >= MIN_SHARE and (best is None or length > best[1]):
                best = (other, length)
        if best is None:
            return None
        retained = self.prompt_store.matches(job.ids)
        return best if not retained or retained[0].length < best[1] else None

    def _take_share(self, job: Job, step: StepPlan) -> Optional[Verdict]:
        """Give a job waiting on a shared prefix its sequence once the prefix is written:
        a fork of its source's, or (the source gone, or unable to fork) a new one. None
        while it must still wait; else ALLOWED (its first chunk may go in this step)."""
        source, length = job.share  # type: ignore[misc]
        seq = source.samples[0].seq_id
        running = source in self.active
        if running and (source.share is not None or (seq is not None and source.fed < length)):
            return None
        alive = running and seq is not None
        seq_id = None
        self._room_for_a_sequence()
        if alive and self.cache.can_clone(seq, length):  # type: ignore[arg-type]
            seq_id = self.cache.seq_clone(seq, length)  # type: ignore[arg-type]
            job.fed = length
            if not self._check_first_chunk(step, job, seq_id):  # as a request admitted alone: cold
                self.cache.seq_rm(seq_id)
                seq_id, job.fed = None, 0
        if seq_id is None:
            seq_id, verdict = self._first_chunk_in(step, job, self.cache.seq_new())
            if not verdict:
                self.cache.seq_rm(seq_id)  # the cache cannot take it yet: wait, as queued requests do
                return None
        job.share = None
        job.samples[0].seq_id = seq_id
        job.samples[0].length = job.fed
        if job.fed:
            job.handle.stats.cached_tokens = job.fed
            self.stats.prefix_hits += 1
            self.stats.cached_tokens += job.fed
        return ALLOWED

    def _start(self, job: Job, seq_id: Optional[int]) -> None:
        job.samples[0].seq_id = seq_id
        job.samples[0].length = job.fed
        self.active.append(job)
        self.reserved += job.footprint
        self.slots += len(job.samples)
        handle = job.handle
        handle.status = Status.PREFILL
        handle.waiting_reason = None
        handle.stats.admitted = time.perf_counter()
        if job.fed:
            handle.stats.cached_tokens = job.fed
            self.stats.prefix_hits += 1
            self.stats.cached_tokens += job.fed

    def _first_chunk_in(self, step: StepPlan, job: Job, seq_id: int) -> tuple[int, Verdict]:
        """Check ``job``'s first chunk in ``seq_id``; where the cache refuses it and
        retained prompts (or a fork of one) hold room, retry cold without them, since
        retained prompts never cost a request its start. Returns the sequence to use (the
        caller removes it when the verdict refuses) and the verdict."""
        verdict = self._check_first_chunk(step, job, seq_id)
        if not verdict and (job.fed or len(self.prompt_store)):
            self.cache.seq_rm(seq_id)
            self.prompt_store.clear()
            job.fed = 0
            seq_id = self.cache.seq_new()
            verdict = self._check_first_chunk(step, job, seq_id)
        return seq_id, verdict

    def _check_first_chunk(self, step: StepPlan, job: Job, seq_id: int) -> Verdict:
        return self.cache.check_step(step.with_prompt_chunk(seq_id, job.fed, self._chunk_len(job, step)))

    def _open_sequence(self, job: Job) -> int:
        """The sequence ``job``'s prompt starts in (``job.fed`` set to what it already
        holds): the retained sequence sharing its longest prefix, taken over where the
        prompt continues that conversation (``_continues``), else a fork of it where the
        cache can fork, else a new one. Retained sequences are evicted first as far as the
        request's reservation needs; the one it reuses goes last."""
        matches = self.prompt_store.matches(job.ids)
        self._shrink_store(job.footprint, len(job.samples), keep=matches[0].entry if matches else None)
        seq_id = None
        for match in matches:
            entry = match.entry
            if entry not in self.prompt_store:
                continue
            if _continues(match) and self.cache.can_rewind(entry.seq_id, match.length):
                seq_id = self.prompt_store.take(entry)
                self.cache.rewind(seq_id, match.length)
            elif self.cache.can_clone(entry.seq_id, match.length):
                self._room_for_a_sequence(keep=entry)
                seq_id = self.cache.seq_clone(entry.seq_id, match.length)
                self.prompt_store.touch(entry)
            else:
                continue
            job.fed = match.length
            break
        self._shrink_store(job.footprint, len(job.samples))
        if seq_id is None:
            self._room_for_a_sequence()
            seq_id = self.cache.seq_new()
        return seq_id

    def _room_for_a_sequence(self, keep: Optional[Retained] = None) -> None:
        """Evict retained sequences (least recently used first, ``keep`` spared) while one
        more sequence would make the cache allocate storage: retained prompts live in
        memory the cache already holds and never make it grow (in batched-sequence a
        sequence is a pool row as long as the longest history, in every layer)."""
        while self.cache.new_seq_allocates() and self.prompt_store.evict_lru(keep):
            pass

    def _shrink_store(self, units: int = 0, seqs: int = 0, keep: Optional[Retained] = None) -> None:
        """Evict retained sequences (least recently used first, ``keep`` spared) until they
        fit beside the running requests' reservations plus ``units`` capacity units and
        ``seqs`` sequences more."""
        store, lim = self.prompt_store, self.limits
        while (self.reserved + units + store.tokens > lim.capacity
               or (lim.max_seqs is not None and self.slots + seqs + len(store) > lim.max_seqs)):
            if not store.evict_lru(keep):
                return

    # -- accounting -----------------------------------------------------------------------
    def advance(self, step: StepPlan, draws: Sequence[Draw], first_draw: int = 0) -> Failures:
        """The host's account of a dispatched step: positions held, forks, draws (the
        ``i``-th of ``draws`` is draw ``first_draw + i`` of the forward's ids). Returns
        the jobs whose prompt could not be forked for their extra samples; every other
        job's account is complete."""
        for job, count in step.chunks:
            job.fed += count
            job.samples[0].length = job.fed
        failures: Failures = []
        for _, job, sample in step.rows:
            if sample is not None:
                sample.length += 1
                continue
            try:  # the prompt is in: one sequence per extra sample
                self._fork_samples(job)
            except (CacheRefused, RuntimeError) as exc:  # MLX reports a failed copy as RuntimeError
                failures.append((job, f"forking the prompt for the request's other samples failed: {exc}"))
        for i, d in enumerate(draws):
            sample = d.sample
            sample.drawn += 1
            # Fed next step unless it is the last token or its sequence is full.
            more = sample.drawn < d.job.max_tokens and sample.length + 1 <= d.job.cap
            sample.pending = first_draw + i if more else None
        return failures

    def _fork_samples(self, job: Job) -> None:
        first = job.samples[0]
        for fork in job.samples[1:]:
            self._room_for_a_sequence()
            fork.seq_id = self.cache.seq_clone(first.seq_id, job.prompt_len)  # type: ignore[arg-type]
            fork.length = job.prompt_len

    def retire(self, job: Job, sample: Sample, retain: bool) -> None:
        """A finished sample's sequence: cut back to what the caller sees, then kept for
        the prompt store when the job ends (``retain``) or removed now."""
        sample.pending = None
        if sample.seq_id is None:
            return
        kept = min(job.prompt_len + len(sample.tokens), sample.length)
        if kept < sample.length and self.cache.can_rewind(sample.seq_id, kept):
            self.cache.rewind(sample.seq_id, kept)
            sample.length = kept
        if retain and self.prompt_store.budget and sample.length == kept:
            job.finished.append((sample.seq_id, job.ids + sample.tokens[: kept - job.prompt_len]))
        else:
            self.cache.seq_rm(sample.seq_id)
        sample.seq_id = None

    def release(self, job: Job, retain: bool = False) -> None:
        """Give back what ``job`` reserved; its finished sequences go to the prompt store
        (``retain``) or are removed."""
        if job in self.active:
            self.active.remove(job)
            self.reserved -= job.footprint
            self.slots -= len(job.samples)
        for seq_id, tokens in job.finished:
            if retain:
                self.prompt_store.add(seq_id, tokens, job.prompt_len)
            else:
                self.cache.seq_rm(seq_id)
        job.finished.clear()
        self._shrink_store()

    def drop(self, job: Job) -> None:
        """A failed job out of the queue and the cache, whatever state it was in."""
        for sample in job.samples:
            if sample.seq_id is not None:  # still in the cache, even if it failed while finishing
                self.cache.seq_rm(sample.seq_id)
                sample.seq_id = None
            sample.finish_reason = sample.finish_reason or "error"
        if job in self.waiting:
            self.waiting.remove(job)
        self.release(job)

    def take_cancelled(self) -> list[Job]:
        """Queued jobs whose caller cancelled them, out of the queue."""
        gone = [j for j in self.waiting if j.handle._cancelled.is_set()]
        for job in gone:
            self.waiting.remove(job)
        return gone

    # -- views ----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def jobs(self) -> list[Job]:
        return list(self.waiting) + list(self.active)

    def sequences(self) -> list[SequenceState]:
        """Every live cache sequence with the length the engine accounts to it."""
        return [SequenceState(job.handle.id, s.index, s.seq_id, s.length, s.drawn - len(s.tokens))
                for job in self.active for s in job.samples
                if s.seq_id is not None and s.finish_reason is None]

    def waiting_handles(self) -> list[RequestHandle]:
        return [job.handle for job in self.waiting]


def _continues(match: Match) -> bool:
    """Whether a prompt continues the retained conversation it matches: it shares the
    whole of the entry's prompt. The entry's tokens past the match are then the tail of a
    reply the new prompt does not repeat (a reply retokenized, or cut where generation
    stopped), which only a prompt repeating that exact reply would reuse; so the request
    takes the sequence over, rewound to the match, instead of forking it: no copy and no
    second sequence (in batched-sequence, no second pool row)."""
    return match.length >= match.entry.prompt_len


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
