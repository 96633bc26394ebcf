"""Train the small bundled default model (models/default) on CPython's pydoc topics.

The corpus is `pydoc_data.topics`, the English reference text every CPython install
carries, so the model and its data need no download. A deterministic ~5% of the topics
(chosen by a hash of each topic's name, so the choice does not depend on which other
topics a Python version has) is held out and never seen by the tokenizer or the model.

Usage:
    .venv/bin/python scripts/train_default_model.py --out models/default --steps 600

Writes a Hugging Face checkpoint directory (weights stored as bfloat16), metrics.json
(untrained and trained held-out loss, the held-out topic names, timings, greedy samples)
and loss_curve.png (needs matplotlib, imported only when plotting).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from pydoc_data.topics import topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
HELD_OUT_MODULUS = 20  # one topic in twenty: ~5% of the topics
SAMPLE_PROMPTS = ("The for statement", "A class definition", "The return value of", "Exceptions")
# Role-prefixed turns: the model never saw chat data, so the template only has to be
# well-formed for tools that always apply one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class Recipe:
    """Model shape and optimisation settings (recorded in metrics.json)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 704
    context: int = 256
    batch_size: int = 16
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 25


def is_held_out(topic: str) -> bool:
    """Whether a pydoc topic belongs to the held-out split (stable per topic name)."""
    digest = hashlib.sha256(topic.encode("utf-8")).hexdigest()
    return int(digest, 16) % HELD_OUT_MODULUS == 0


def split_topics() -> tuple[list[str], list[str]]:
    """Returns (train, held_out) topic names, each sorted."""
    names = sorted(topics)
    return [n for n in names if not is_held_out(n)], [n for n in names if is_held_out(n)]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE whose encodings start with BOS (as every training document does)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=Recipe.context,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Concatenates `BOS text EOS` for every document into one int64 stream."""
    ids: list[int] = []
    for text in texts:
        # The backend encoder adds BOS and skips the max-length warning meant for model inputs.
        ids.extend(tokenizer.backend_tokenizer.encode(text).ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def build_model(recipe: Recipe, tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A fresh Llama with tied embeddings (they are a quarter of the weights at this size)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.context,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, stream: torch.Tensor, context: int) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of the stream."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(stream) - 1, context):
        window = stream[start : start + context + 1]
        if len(window) < 2:
            break
        logits = model(window[:-1][None]).logits[0]
        loss = torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum")
        total, count = total + loss.item(), count + len(window) - 1
    model.train()
    return total / count


@dataclass
class TrainResult:
    """Loss curves as (step, loss) pairs; eval covers step 0, every `eval_every` and the last step."""

    train_curve: list[tuple[int, float]]
    eval_curve: list[tuple[int, float]]
    best_step: int

    @property
    def best_loss(self) -> float:
        return dict(self.eval_curve)[self.best_step]


def lr_multiplier(step: int, recipe: Recipe, total_steps: int) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, total_steps - recipe.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return recipe.min_lr_ratio + (1.0 - recipe.min_lr_ratio) * cosine


def train(
    model: LlamaForCausalLM,
    train_stream: torch.Tensor,
    eval_stream: torch.Tensor,
    recipe: Recipe,
    steps: int,
    seed: int,
) -> TrainResult:
    """Trains on random context windows of the training stream, then restores the weights
    of the step with the lowest held-out loss (the corpus is small enough to overfit).
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.peak_lr,
        betas=(0.9, 0.95),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, recipe, steps))
    batches = torch.Generator().manual_seed(seed)
    offsets = torch.arange(recipe.context + 1)
    train_curve: list[tuple[int, float]] = []
    eval_curve = [(0, held_out_loss(model, eval_stream, recipe.context))]
    best_step, best_state = 0, copy.deepcopy(model.state_dict())
    model.train()
    bar = tqdm(range(1, steps + 1), desc="train", dynamic_ncols=True)
    for step in bar:
        starts = torch.randint(0, len(train_stream) - recipe.context - 1, (recipe.batch_size, 1), generator=batches)
        windows = train_stream[starts + offsets]
        logits = model(windows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        schedule.step()
        train_curve.append((step, loss.item()))
        if step % recipe.eval_every == 0 or step == steps:
            eval_curve.append((step, held_out_loss(model, eval_stream, recipe.context)))
            if eval_curve[-1][1] < min(v for _, v in eval_curve[:-1]):
                best_step, best_state = step, copy.deepcopy(model.state_dict())
        bar.set_postfix(loss=f"{loss.item():.3f}", held_out=f"{eval_curve[-1][1]:.3f}")
    model.load_state_dict(best_state)
    return TrainResult(train_curve, eval_curve, best_step)


def greedy_samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, new_tokens: int) -> dict[str, str]:
    """Greedy continuations of SAMPLE_PROMPTS, decoded."""
    model.eval()
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        samples[prompt] = tokenizer.decode(out[0], skip_special_tokens=True)
    return samples


def plot_curves(result: TrainResult, path: Path) -> None:
    """Writes the training and held-out loss curves as a PNG, marking the kept step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(*zip(*result.train_curve), lw=0.8, alpha=0.6, label="train (batch)")
    ax.plot(*zip(*result.eval_curve), marker="o", ms=3, label="held-out topics")
    ax.axvline(result.best_step, color="gray", ls="--", lw=0.8, label=f"kept: step {result.best_step}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("models/default on pydoc_data.topics")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def save_checkpoint(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Saves weights as bfloat16 plus tokenizer files, including the legacy special_tokens_map.json."""
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.to(torch.bfloat16).save_pretrained(out)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    (out / "special_tokens_map.json").write_text(json.dumps(tokenizer.special_tokens_map, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/default"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    recipe = Recipe()
    started = time.perf_counter()
    train_names, held_out_names = split_topics()
    tokenizer = train_tokenizer([topics[n] for n in train_names], recipe.vocab_size)
    train_stream = encode_documents(tokenizer, [topics[n] for n in train_names])
    eval_stream = encode_documents(tokenizer, [topics[n] for n in held_out_names])
    model = build_model(recipe, tokenizer, args.seed)
    result = train(model, train_stream, eval_stream, recipe, args.steps, args.seed)
    train_seconds = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    samples = greedy_samples(model, tokenizer, new_tokens=60)
    save_checkpoint(model, tokenizer, args.out)
    plot_curves(result, args.out / "loss_curve.png")
    metrics = {
        "seed": args.seed,
        "threads": args.threads,
        "steps": args.steps,
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_topics": len(train_names),
        "held_out_topics": held_out_names,
        "train_tokens": len(train_stream),
        "held_out_tokens": len(eval_stream),
        "untrained_held_out_loss": result.eval_curve[0][1],
        "kept_step": result.best_step,
        "kept_held_out_loss": result.best_loss,
        "last_step_held_out_loss": result.eval_curve[-1][1],
        "held_out_curve": result.eval_curve,
        "wall_seconds": round(train_seconds, 1),
        "greedy_samples": samples,
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("held_out_curve", "recipe")}, indent=2))


if __name__ == "__main__":
    main()
