"""Drawn tokens turned into what the caller sees: events, stops, finishes, completions.

Per token: detokenize (text held back while it could still become a stop string or is
half a character), advance the grammar matcher, decide whether the sample ends (a stop
string or token, eos, a complete grammar, its length, its share of the cache). Per
finished sample: the text released at the end, the tokens cut back to the text kept
before a stop string. The sample's sequence is the scheduler's to retire; the readout
never touches the cache.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from mlx_pte.interpreter.text import TextCodec

from .jobs import Job, Sample
from .requests import Completion, EngineStats, Event, SampleResult, Status

if TYPE_CHECKING:
    from ..sampling.logprobs import TokenLogprob


class Readout:
    def __init__(self, codec: Optional[TextCodec], eos_ids: frozenset[int], stats: EngineStats) -> None:
        self.codec = codec
        self.eos_ids = eos_ids
        self.stats = stats

    def accept(self, job: Job, sample: Sample, token: int, first_token: bool = False,
               logprob: Optional["TokenLogprob"] = None) -> Optional[str]:
        """Emit ``token``'s event; the finish reason if it ends the sample, else None."""
        sample.tokens.append(token)
        if logprob is not None:
            sample.logprobs.append(logprob)
        job.handle.stats.generated_tokens += 1
        self.stats.generated_tokens += 1
        if not first_token:
            job.handle.stats.decoded_tokens += 1
        stop_text = sample.stop_text
        assert stop_text is not None
        piece = stop_text.push(sample.decoder.push(token)) if sample.decoder else ""
        request = job.handle.request
        eos = token in self.eos_ids
        if sample.matcher is not None and not eos:
            sample.matcher.consume(token)
        if stop_text.stopped:
            reason: Optional[str] = "stop"
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
        return reason

    def finish(self, job: Job, sample: Sample, reason: str) -> Event:
        """End ``sample``: its last event, with any text released at the end. Its tokens
        are cut back to those whose text precedes a stop string."""
        sample.finish_reason = reason
        stop_text = sample.stop_text
        assert stop_text is not None
        tail = ""
        if sample.decoder and not stop_text.stopped and reason != "cancelled":
            tail = stop_text.push(sample.decoder.flush()) + stop_text.flush()
        if stop_text.stopped:
            sample.tokens = sample.tokens[: self._kept_tokens(sample)]
            del sample.logprobs[len(sample.tokens):]
        return Event(job.handle.id, sample.index, text=tail, finish_reason=reason)

    @staticmethod
    def complete(job: Job, last: Event) -> None:
        """Close a job whose samples have all finished, ``last`` its final event."""
        if any(s.finish_reason == "cancelled" for s in job.samples):
            job.handle._close(Status.CANCELLED, last)
            return
        samples = [SampleResult(s.index, s.tokens, s.stop_text.text if s.stop_text else "",
                                s.finish_reason or "", tuple(s.logprobs))
                   for s in job.samples]
        job.handle._close(Status.DONE, last, Completion(job.handle.id, job.prompt_len, samples, job.handle.stats))

    def _kept_tokens(self, sample: Sample) -> int:
        """The most tokens whose text fits inside the text kept before the stop string."""
        kept_text = sample.stop_text.text  # type: ignore[union-attr]
        for k in range(len(sample.tokens), -1, -1):
            text = self.codec.decode(sample.tokens[:k])  # type: ignore[union-attr]
            if kept_text.startswith(text):
                return k
        return 0
