"""A multi-turn conversation through the official ``openai`` client: later turns report
the prompt tokens they reused, and still get exactly what a cold run generates."""
from __future__ import annotations

import pytest
from openai import OpenAI

from mlx_pte.interpreter.text import TextCodec
from mlx_pte.ir.manifest import Manifest
from mlx_pte.serving.openai.app import create_app
from mlx_pte.serving.engine import Engine
from tests.serving.live_server import serving

MODEL = "tiny-llama"
MAX_TOKENS = 6


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("kind", ("batched-sequence", "batched-cell"))
def test_a_conversations_later_turns_report_cached_tokens_and_equal_cold_runs(program, oracle, kind):  # noqa: F811
    codec = TextCodec(Manifest.from_dict(program.manifest))
    engine = Engine(program, kind, capacity=600, max_batch_tokens=24, prompt_cache_tokens=600)
    with serving(create_app(engine, MODEL)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        options = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        messages = [{"role": "user", "content": "What does a context manager do?"}]
        held: list[int] = []  # what the previous turn's sequence holds
        for turn in range(3):
            prompt_text = codec.render_chat(messages)
            prompt = codec.encode(prompt_text)
            cold = oracle(prompt_text, MAX_TOKENS)
            if turn == 1:  # streamed, with the usage chunk
                chunks = list(client.chat.completions.create(
                    messages=messages, stream=True, stream_options={"include_usage": True}, **options))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
            else:
                reply = client.chat.completions.create(messages=messages, **options)
                text, usage = reply.choices[0].message.content, reply.usage
            assert text == cold.text
            assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == MAX_TOKENS
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached == shared_prefix(prompt, held)
            if turn:  # most of the history is reused (retokenized replies may differ at the end)
                assert cached > len(held) // 2
            held = prompt + cold.tokens[: MAX_TOKENS - 1]
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then {turn}?"}]

        # A plain completion continuing the last chat reuses it too.
        prompt_text = codec.render_chat(messages[:-1], add_generation_prompt=False)
        completion = client.completions.create(prompt=prompt_text, **options)
        prompt = codec.encode(prompt_text)
        assert completion.choices[0].text == oracle(prompt_text, MAX_TOKENS).text
        assert completion.usage.prompt_tokens_details.cached_tokens == shared_prefix(prompt, held) > 0
    assert engine.stats.prefix_hits == 3
