"""What the scheduler hands the runner for one iteration (``Plan``): the step's tokens,
positions, sequences and sampled rows (``StepPlan``), and the requests refused for good.
Plain data with the bookkeeping that reads it; no MLX."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from mlx_pte.runtime.cache import Step

from .jobs import Draw, Job, Sample


@dataclass
class StepPlan:
    """One step's tokens: first one per decoding sample, drawn by the previous forward
    (its index there in ``feeds``), then prompt tokens (``prompt``)."""

    feeds: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    # (token row, job, sample) for each row whose logits are sampled; sample None = the
    # row ending a prompt (its job's samples draw their first tokens from it).
    rows: list[tuple[int, Job, Optional[Sample]]] = field(default_factory=list)
    chunks: list[tuple[Job, int]] = field(default_factory=list)  # prompt tokens per job
    jobs: dict[int, Job] = field(default_factory=dict)  # every job in the step, by id
    feed_owners: list[int] = field(default_factory=list)  # each feed's job id
    prompt_owners: list[int] = field(default_factory=list)  # each prompt token's job id

    @property
    def size(self) -> int:
        return len(self.feeds) + len(self.prompt)

    @property
    def prefill_tokens(self) -> int:
        return sum(count for _, count in self.chunks)

    def step(self) -> Step:
        return Step(tuple(self.seq_ids), tuple(self.positions))

    def draws(self) -> tuple[list[Draw], list[int]]:
        """Every token the step draws, and each one's index into ``rows``: one per
        decoding sample, and one per sample of each prompt the step completes."""
        draws: list[Draw] = []
        draw_rows: list[int] = []
        for k, (_, job, sample) in enumerate(self.rows):
            for s in job.samples if sample is None else [sample]:
                draws.append(Draw(job, s, sample is None))
                draw_rows.append(k)
        return draws, draw_rows

    def add_decode(self, job: Job, sample: Sample) -> None:
        self.rows.append((self.size, job, sample))
        self.feeds.append(sample.pending)  # type: ignore[arg-type]
        self.feed_owners.append(job.handle.id)
        self.positions.append(sample.length)
        self.seq_ids.append(sample.seq_id)  # type: ignore[arg-type]
        self.jobs[job.handle.id] = job

    def add_prompt(self, job: Job, seq_id: int, tokens: Sequence[int], start: int) -> None:
        self.prompt.extend(tokens)
        self.positions.extend(range(start, start + len(tokens)))
        self.seq_ids.extend([seq_id] * len(tokens))
        self.prompt_owners.extend([job.handle.id] * len(tokens))
        self.jobs[job.handle.id] = job

    def only(self, job: Job) -> "StepPlan":
        """The part of this step that belongs to ``job`` (a valid step on its own: a
        subset of each of its sequences' contiguous runs); its feeds still index the
        previous forward's draws."""
        own = job.handle.id
        feeds = [i for i, owner in enumerate(self.feed_owners) if owner == own]
        prompt = [i for i, owner in enumerate(self.prompt_owners) if owner == own]
        keep = feeds + [len(self.feeds) + i for i in prompt]  # token indices, in token order
        row_of = {old: new for new, old in enumerate(keep)}
        return StepPlan(
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

    def absorb(self, part: "StepPlan") -> None:
        """Count ``part`` in this plan (for a flight's accounting: sizes, chunks, jobs)."""
        self.feeds += part.feeds
        self.prompt += part.prompt
        self.chunks += part.chunks
        self.jobs.update(part.jobs)

    def with_prompt_chunk(self, seq_id: int, start: int, count: int) -> Step:
        """This step plus ``count`` prompt tokens of a newly admitted sequence from ``start``."""
        return Step(tuple(self.seq_ids) + (seq_id,) * count,
                    tuple(self.positions) + tuple(range(start, start + count)))


@dataclass
class Plan:
    """What the scheduler decided for one iteration: the step (empty when there is
    nothing to run), and the requests refused for good, each with the reason."""

    step: StepPlan
    refused: list[tuple[Job, str]] = field(default_factory=list)
