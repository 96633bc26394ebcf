"""The engine's host state of each request it holds: a job and its samples.

No MLX: the scheduler plans over these alone (its tests build them without a model). The
per-sample pieces the runner and the readout use (key chain, stop matcher, detokenizer,
grammar matcher) ride along, opaque to the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from .requests import RequestHandle

if TYPE_CHECKING:
    from ..sampling.device import TokenStream
    from ..sampling.grammar import Matcher
    from ..sampling.logprobs import TokenLogprob
    from ..text.detokenizer import IncrementalDecoder
    from ..text.stops import StopText


@dataclass
class Sample:
    index: int
    stream: Optional["TokenStream"] = None
    stop_text: Optional["StopText"] = None
    decoder: Optional["IncrementalDecoder"] = None
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
class Job:
    handle: RequestHandle
    ids: list[int]
    cap: int  # the most positions each sample's sequence may hold
    footprint: int  # reserved capacity units
    samples: list[Sample]
    fed: int = 0  # prompt tokens in its sequence (forked or prefilled)
    # Finished samples' sequences with the tokens they hold, kept until the job ends.
    finished: list[tuple[int, list[int]]] = field(default_factory=list)
    # Admitted beside a running prompt it shares ``length`` tokens with, not yet written:
    # (that job, length). It forks that job's sequence once the shared part is in.
    share: Optional[tuple["Job", int]] = None

    @property
    def prompt_len(self) -> int:
        return len(self.ids)

    @property
    def max_tokens(self) -> int:
        return self.handle.request.max_tokens

    @property
    def live(self) -> list[Sample]:
        return [s for s in self.samples if s.finish_reason is None and s.seq_id is not None]

    @property
    def ended(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass(frozen=True)
class Draw:
    """One token a step draws: for ``sample`` of ``job``; ``first`` when it is the sample's
    first (drawn from the row ending the prompt)."""

    job: Job
    sample: Sample
    first: bool


# Requests a stage failed, each with the reason its caller is told: stages return them
# as data and the loop fails exactly those requests.
Failures = list[tuple[Job, str]]
