"""The prompt store against a brute-force model: a list of (seq id, tokens), oldest first."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mlx_pte.serving.engine.prompt_store import PromptStore

TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=12)  # a small alphabet: many shared prefixes


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class StoreMachine(RuleBasedStateMachine):
    @initialize(budget=st.integers(0, 30))
    def start(self, budget):
        self.released: list[int] = []
        self.store = PromptStore(budget, self.released.append)
        self.model: list[tuple[int, list[int]]] = []  # oldest first
        self.budget = budget
        self.next_id = 0
        self.expected_released: list[int] = []

    def model_drop(self, index: int) -> None:
        seq_id, _ = self.model.pop(index)
        self.expected_released.append(seq_id)

    @rule(tokens=TOKENS, prompt_len=st.integers(0, 12))
    def add(self, tokens, prompt_len):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.store.add(seq_id, tokens, min(prompt_len, len(tokens)))
        longer = [i for i, (_, t) in enumerate(self.model) if t[: len(tokens)] == tokens]
        if longer or not 0 < len(tokens) <= self.budget:
            if longer:  # the first (oldest) such entry is used instead
                self.model.append(self.model.pop(longer[0]))
            self.expected_released.append(seq_id)
            return
        for seq, old in list(self.model):
            if old == tokens[: len(old)]:
                self.model_drop([s for s, _ in self.model].index(seq))
        self.model.append((seq_id, list(tokens)))
        while sum(len(t) for _, t in self.model) > self.budget:
            self.model_drop(0)

    @rule(prompt=TOKENS)
    def match_and_use(self, prompt):
        found = [(m.entry.seq_id, m.length) for m in self.store.matches(prompt)]
        limit = len(prompt) - 1
        expected = [(seq_id, common_prefix(tokens, prompt[:max(limit, 0)])) for seq_id, tokens in reversed(self.model)]
        expected = sorted([e for e in expected if e[1] > 0], key=lambda e: -e[1])
        assert found == expected
        if found:
            best = self.store.matches(prompt)[0].entry
            self.store.touch(best)
            index = [s for s, _ in self.model].index(best.seq_id)
            self.model.append(self.model.pop(index))

    @rule(data=st.data())
    def take(self, data):
        if not self.model:
            return
        entry = data.draw(st.sampled_from(list(self.store)))
        assert self.store.take(entry) == entry.seq_id
        assert entry not in self.store
        self.model.pop([s for s, _ in self.model].index(entry.seq_id))  # gone, not released

    @rule()
    def evict(self):
        evicted = self.store.evict_lru()
        assert evicted == bool(self.model)
        if self.model:
            self.model_drop(0)

    @invariant()
    def same_entries(self):
        if not hasattr(self, "store"):
            return
        assert [(e.seq_id, list(e.tokens)) for e in self.store] == self.model
        assert self.store.tokens == sum(len(t) for _, t in self.model) <= self.budget
        assert self.released == self.expected_released


TestPromptStore = StoreMachine.TestCase
TestPromptStore.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_evicting_spares_the_entry_asked_for():
    released: list[int] = []
    store = PromptStore(100, released.append)
    store.add(1, [1, 2, 3], 2)
    store.add(2, [4, 5], 1)
    keep = next(iter(store))
    assert store.evict_lru(keep) and released == [2]
    assert not store.evict_lru(keep) and len(store) == 1
    assert keep in store


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        PromptStore(-1, lambda seq_id: None)
