"""`specvox train-draft`: a draft head self-distilled from the target, offline, resumable, on a budget.

0. **Prompts**: the templated corpus (pipeline/llm/draft_corpus.py) and `self_prompts` user
   turns the target writes itself (Magpie), kept in the work folder once written.
1. **Data**: the target's own replies to the prompt corpus,
   sampled in batches (a few temperatures, greedy among them), keeping for every token its
   feature f (the target's final-normed hidden state) and the top `label_top_k` of the
   target's distribution p there. Held-out prompts get greedy replies, what greedy serving
   drafts against. Written in shards under the work folder; a rerun goes on from the
   shards it finds, within `data_minutes` in all.
2. **Draft vocabulary**: the `vocab_size` tokens most often the target's top choice.
3. **Training**: the head learns p (soft cross-entropy over V' against the target's top
   tokens, as in self-distillation) and, for EAGLE, the next feature (smooth L1, the paper's
   regression loss), with `unroll` drafting steps unrolled (`draft_head.eagle_unrolled`).
   AdamW, a cosine schedule over the steps or the `minutes` budget, whichever ends first;
   a checkpoint every `checkpoint_s` seconds, resumed automatically (`fresh` starts over).
4. **Held-out acceptance**: draft chains replayed on the held-out greedy replies: the share of
   positions where drafts 1..s all equal the target's greedy tokens (acceptance by
   position) and the tokens a target pass would commit with drafts of γ (expected accepted
   length). Written to the artifact's card with the data and the training.

Progress with an ETA goes to stderr. Device and the data's dtype are options (a GPU runs
the same command); the head trains in float32.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from pipeline.llm.draft_corpus import PERSONAS, CorpusPrompt, build_corpus, overlapping, usable_user_turn
from pipeline.llm.draft_head import (
    CARD_FILE,
    CARD_FORMAT,
    HEADS_DIR,
    KINDS,
    EagleHead,
    HeadShape,
    MedusaHead,
    eagle_unrolled,
    new_head,
    save_head,
    target_fingerprint,
)
from pipeline.llm.prompts import Task, encode_chat

EVAL_DEPTH = 8  # draft positions the held-out acceptance is reported for
STEP_DECAY = 0.8  # weight of unrolled step s: STEP_DECAY ** (s - 1) (EAGLE-3 weighs later steps less)
REGRESSION_WEIGHT = 0.5  # EAGLE's feature loss beside the token loss (a regulariser here: the tokens are the aim)


@dataclass(frozen=True)
class TrainOptions:
    kind: str = "eagle"
    target: str = "bundled"
    out: str = ""  # the artifact's folder; "": HEADS_DIR/<target>-<kind>
    work: str = ""  # data shards and checkpoints; "": out/train-draft/<artifact name>
    device: str = "cpu"
    data_dtype: str = "float32"  # the target's dtype while it generates the data (the serving one)
    threads: int = 0  # torch threads (0: torch's default)
    seed: int = 0
    prompts: int = 6000  # templated corpus prompts, held-out ones included
    # user turns the target writes itself (Magpie), beside the templated ones; 0: templates only
    self_prompts: int = 1000
    self_prompt_minutes: float = 6.0  # time budget for writing them
    self_prompt_tokens: int = 32  # a turn is cut here (then kept to its last whole sentence)
    self_prompt_temperature: float = 1.0
    heldout_prompts: int = 32
    max_new_tokens: int = 96
    generation_batch: int = 32
    temperatures: tuple[float, ...] = (0.0, 0.0, 0.6, 0.8, 1.0)  # drawn per training prompt
    sample_top_k: int = 50  # sampled replies draw from the target's top 50 at their temperature
    label_top_k: int = 20
    data_minutes: float = 20.0
    vocab_size: int = 8192
    unroll: int = 3
    epochs: int = 3
    steps: int = 0  # a cap on training steps (0: epochs and minutes decide)
    minutes: float = 25.0
    batch_sequences: int = 16
    lr: float = 1e-3
    warmup_steps: int = 30
    checkpoint_s: float = 90.0
    fresh: bool = False
    medusa_heads: int = 4
    storage_dtype: str = "bfloat16"
    # the head's products during training; weights stay float32. "auto": bfloat16 on CUDA, none
    # ("float32") on a CPU, where torch's bfloat16 products without AVX-512 BF16 or AMX ran 55x
    # slower than float32 (AVX2, measured: 4.0 s against 72 ms for [1600, 576] x [576, 5000]).
    autocast: str = "auto"

    def folder(self) -> Path:
        name = f"{Path(self.target).stem if self.target != 'bundled' else 'smollm2-135m'}-{self.kind}"
        return Path(self.out) if self.out else HEADS_DIR / name

    def work_folder(self) -> Path:
        return Path(self.work) if self.work else Path("out") / "train-draft" / self.folder().name


@dataclass
class Reply:
    """One reply as training data: tokens from the prompt's last token but one, their features and labels."""

    tokens: torch.Tensor  # [m] long
    features: torch.Tensor  # [m, D], the data dtype
    top_ids: torch.Tensor  # [m, K] int32: the target's top tokens after token i
    top_p: torch.Tensor  # [m, K] float16: their probabilities
    start: int  # the context position of tokens[0]
    heldout: bool = False


class Progress:
    """One line on stderr at most every `every_s` seconds: done/total, rate, ETA."""

    def __init__(self, what: str, total: float, every_s: float = 10.0) -> None:
        self.what, self.total, self.every_s = what, total, every_s
        self.started = self.last = time.monotonic()
        self.first = True

    def update(self, done: float, note: str = "", force: bool = False) -> None:
        """Printed on the first update, the last (done = total) and every `every_s` seconds between."""
        now = time.monotonic()
        if not (force or self.first or done >= self.total or now - self.last >= self.every_s):
            return
        self.first = False
        self.last = now
        elapsed = now - self.started
        eta = elapsed / done * (self.total - done) if done > 0 else float("nan")
        print(f"[{self.what}] {done:.0f}/{self.total:.0f} {note} elapsed {_clock(elapsed)} eta {_clock(eta)}",
              file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


# ---- 1. data -------------------------------------------------------------------------------

def corpus_for(options: TrainOptions, excluded: Sequence[str],
               written: Sequence[CorpusPrompt] = ()) -> tuple[list[CorpusPrompt], list[CorpusPrompt]]:
    """(training prompts, held-out prompts): the templated corpus, its first `heldout_prompts` held
    out, and the self-written turns `written` for training; refuses a corpus that overlaps the
    excluded (benchmark) prompts."""
    prompts = build_corpus(options.prompts, options.seed)
    clash = overlapping([*prompts, *written], excluded)
    if clash:
        raise ValueError(f"{len(clash)} corpus prompts overlap the benchmark prompts, e.g. {clash[0]!r}")
    held = max(1, min(options.heldout_prompts, len(prompts) // 4))
    return [*prompts[held:], *written], prompts[:held]


def user_turn_prefix(tokenizer: Any, persona: str) -> list[int]:
    """A chat in the tokenizer's own template up to where the user's first turn begins: its system
    turn (`persona`) and the user turn's opening. Found by rendering a chat whose user text is a
    marker and cutting the text there, so that any chat template works."""
    marker = "SPECVOXUSERTURNMARKER"
    text = tokenizer.apply_chat_template([{"role": "system", "content": persona}, {"role": "user", "content": marker}],
                                         tokenize=False)
    return [int(t) for t in tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)]


def self_written_prompts(options: TrainOptions, loaded: Any, excluded: Sequence[str], work: Path) -> list[CorpusPrompt]:
    """Up to `self_prompts` distinct user turns written by the target under the corpus's personas,
    sampled at `self_prompt_temperature` in batches of at most `self_prompt_tokens`, within
    `self_prompt_minutes`: what of each reads as a turn (`usable_user_turn`), where it shares no run
    of words with an excluded (benchmark) prompt. Kept in the work folder after each batch; a rerun
    goes on from there."""
    wanted = options.self_prompts
    if wanted <= 0:
        return []
    path = work / "self_written.json"
    record: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"batches": 0, "seconds": 0.0,
                                                                                   "written": 0, "turns": []}
    kept = [CorpusPrompt(Task.DIALOGUE, t["text"], t["persona"]) for t in record["turns"]]
    seen = {p.user_text for p in kept}
    progress = Progress("prompts", wanted)
    pad_id = int(getattr(loaded.tokenizer, "pad_token_id", None) or 0)
    writing = dataclasses.replace(options, max_new_tokens=options.self_prompt_tokens, label_top_k=1)
    size = options.generation_batch
    prefixes = {persona: user_turn_prefix(loaded.tokenizer, persona) for persona in PERSONAS}
    while len(kept) < wanted and record["seconds"] < options.self_prompt_minutes * 60:
        index = record["batches"]
        rng = random.Random(options.seed * 7919 + index)
        personas = [rng.choice(PERSONAS) for _ in range(size)]
        started = time.monotonic()
        generator = torch.Generator().manual_seed(options.seed * 1_000_003 + 500_009 + index)
        turns = generate_batch(loaded, [prefixes[p] for p in personas], [options.self_prompt_temperature] * size,
                               writing, pad_id, generator, False)
        # whole sentences only: a sentence cut at self_prompt_tokens is dropped
        texts = [usable_user_turn(loaded.tokenizer.decode(turn.tokens[2:].tolist())) for turn in turns]
        written = [CorpusPrompt(Task.DIALOGUE, text, persona) for persona, text in zip(personas, texts, strict=True)
                   if text]
        clashing = set(overlapping(written, excluded))
        for prompt in written:
            if prompt.user_text not in seen and prompt.user_text not in clashing and len(kept) < wanted:
                seen.add(prompt.user_text)
                kept.append(prompt)
        record["batches"], record["written"] = index + 1, record["written"] + size
        record["seconds"] += time.monotonic() - started
        record["turns"] = [{"text": p.user_text, "persona": p.persona} for p in kept]
        path.write_text(json.dumps(record, indent=1))
        progress.update(len(kept), f"turns kept of {record['written']} written;")
    if len(kept) < wanted:
        print(f"[prompts] {len(kept)} of {wanted} self-written turns within {options.self_prompt_minutes:g} min",
              file=sys.stderr, flush=True)
    return kept


def plan_batches(options: TrainOptions, tokenizer: Any, train: list[CorpusPrompt],
                 heldout: list[CorpusPrompt]) -> list[tuple[list[list[int]], list[float], bool]]:
    """Generation batches: held-out ones first (greedy), then training prompts by length (little
    padding) in a seeded random order of batches (a run cut short by its budget keeps a mix)."""
    rng = random.Random(options.seed + 1)
    encode = [encode_chat(tokenizer, p.messages()) for p in train]
    temps = [rng.choice(options.temperatures) for _ in train]
    order = sorted(range(len(train)), key=lambda i: len(encode[i]))
    size = options.generation_batch
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    rng.shuffle(chunks)
    held = [encode_chat(tokenizer, p.messages()) for p in heldout]
    batches = [(held[i : i + size], [0.0] * len(held[i : i + size]), True) for i in range(0, len(held), size)]
    batches += [([encode[i] for i in c], [temps[i] for i in c], False) for c in chunks]
    return batches


@torch.inference_mode()
def generate_batch(loaded: Any, prompts: list[list[int]], temperatures: list[float], options: TrainOptions,
                   pad_id: int, generator: torch.Generator, heldout: bool) -> list[Reply]:
    """The target's replies to `prompts` in one batch (left-padded), with features and top-k labels.

    Rows that end keep computing (masked, their tokens dropped) until the batch ends: no cache surgery."""
    device, eos = loaded.device, loaded.eos_token_ids
    b, length, n = len(prompts), max(map(len, prompts)), options.max_new_tokens
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    mask = torch.zeros((b, length), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, length - len(p) :] = torch.tensor(p)
        mask[i, length - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    hidden, logits, cache = _pass(loaded, ids, mask, positions, None, 2)  # the prompts' last two tokens
    d, k = hidden.shape[-1], options.label_top_k
    feats = torch.zeros((b, n + 2, d), dtype=hidden.dtype)
    tokens = torch.full((b, n + 2), pad_id, dtype=torch.long)
    top_ids = torch.zeros((b, n + 2, k), dtype=torch.int32)
    top_p = torch.zeros((b, n + 2, k), dtype=torch.float16)
    tokens[:, :2] = ids[:, -2:].cpu()
    temps = torch.tensor(temperatures, device=device)
    live = torch.ones(b, dtype=torch.bool)
    lengths = torch.zeros(b, dtype=torch.long)  # features (and tokens) kept per row
    column = 0  # the index of hidden's first token in each row's sequence
    while True:
        count = hidden.shape[1]
        top = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
        feats[:, column : column + count] = hidden.cpu()
        top_ids[:, column : column + count] = top.indices.to(torch.int32).cpu()
        top_p[:, column : column + count] = top.values.to(torch.float16).cpu()
        column += count
        lengths[live] = column
        if column >= n + 2:  # n reply tokens after the prompt's two
            break
        nxt = _next_tokens(logits[:, -1].float(), temps, options.sample_top_k, generator)  # token `column`
        tokens[:, column] = nxt.cpu()
        live &= torch.tensor([int(t) not in eos for t in nxt.tolist()])  # an EOS needs no feature
        if not bool(live.any()):
            break
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
        positions = positions[:, -1:] + 1
        hidden, logits, cache = _pass(loaded, nxt[:, None], mask, positions, cache, 1)
    return [Reply(tokens[i, : int(lengths[i])].clone(), feats[i, : int(lengths[i])].clone(),
                  top_ids[i, : int(lengths[i])].clone(), top_p[i, : int(lengths[i])].clone(),
                  len(prompts[i]) - 2, heldout) for i in range(b)]


def _pass(loaded: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
          keep: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(features [B, keep, D], logits [B, keep, V], cache) of one batched target pass: through the lean
    pass where the target has one (the serving arithmetic, `LeanOutput.hidden` normed), else transformers'."""
    if loaded.lean is not None:
        out = loaded.lean(input_ids=ids, cache=cache, attention_mask=mask, position_ids=positions, logits_to_keep=keep)
        return loaded.lean.normed(out.hidden), out.logits, out.cache
    out = loaded.model.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    hidden = out.last_hidden_state[:, -keep:]
    return hidden, loaded.model.lm_head(hidden), out.cache


def _next_tokens(logits: torch.Tensor, temps: torch.Tensor, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """Greedy where the temperature is 0, else a draw from the top_k at that temperature."""
    greedy = torch.argmax(logits, dim=-1)
    top = torch.topk(logits, top_k, dim=-1)
    probs = torch.softmax(top.values / temps.clamp(min=1e-4)[:, None], dim=-1)
    drawn = top.indices.gather(1, torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device))[:, 0]
    return torch.where(temps > 0, drawn, greedy)


def make_data(options: TrainOptions, loaded: Any, batches: list[tuple[list[list[int]], list[float], bool]],
              work: Path) -> dict:
    """Generate the shards not yet on disk, within the data budget; returns the progress record."""
    folder = work / "data"
    folder.mkdir(parents=True, exist_ok=True)
    record_path = folder / "progress.json"
    record: dict[str, Any] = (json.loads(record_path.read_text()) if record_path.exists()
                              else {"seconds": 0.0, "done": []})
    done = set(record["done"])
    budget_s = options.data_minutes * 60
    progress = Progress("data", len(batches))
    pad_id = int(getattr(loaded.tokenizer, "pad_token_id", None) or 0)
    for index, (prompts, temps, heldout) in enumerate(batches):
        if index in done:
            continue
        if record["seconds"] >= budget_s and not heldout:
            print(f"[data] budget of {options.data_minutes:g} min reached after {len(done)} batches",
                  file=sys.stderr, flush=True)
            break
        started = time.monotonic()
        generator = torch.Generator().manual_seed(options.seed * 1_000_003 + index)
        sequences = generate_batch(loaded, prompts, temps, options, pad_id, generator, heldout)
        finite = [s for s in sequences if bool(torch.isfinite(s.features.float()).all())]
        record["dropped_nonfinite"] = record.get("dropped_nonfinite", 0) + len(sequences) - len(finite)
        sequences = finite
        torch.save([dataclasses.asdict(s) for s in sequences], folder / f"shard-{index:05d}.pt")
        record["seconds"] += time.monotonic() - started
        done.add(index)
        record["done"] = sorted(done)
        record_path.write_text(json.dumps(record))
        tokens = sum(len(s.features) for s in sequences)
        progress.update(len(done), f"batches; last {tokens} tokens at {tokens / (time.monotonic() - started):.0f}/s;"
                        f" budget used {record['seconds'] / max(budget_s, 1e-9):.0%}")
    return record


def load_data(work: Path) -> list[Reply]:
    out = []
    for shard in sorted((work / "data").glob("shard-*.pt")):
        out += [Reply(**s) for s in torch.load(shard)]
    return out


def draft_vocab(sequences: Sequence[Reply], size: int, eos: frozenset[int]) -> torch.Tensor:
    """The `size` tokens most often the target's top choice in the training data (and the EOS tokens)."""
    counts = torch.bincount(torch.cat([s.top_ids[1:, 0].long() for s in sequences]))
    chosen = torch.argsort(counts, descending=True)[: min(size, int((counts > 0).sum()))]
    extra = [e for e in sorted(eos) if e not in set(chosen.tolist())]
    return torch.cat((chosen, torch.tensor(extra, dtype=torch.long))).sort().values


def coverage(sequences: Sequence[Reply], vocab: torch.Tensor) -> float:
    """The share of the target's top choices in `sequences` that `vocab` holds."""
    top = torch.cat([s.top_ids[1:, 0].long() for s in sequences])
    return float(torch.isin(top, vocab).float().mean())


# ---- 2. training ---------------------------------------------------------------------------

@dataclass
class Batch:
    features: torch.Tensor  # [B, n, D] f_i, float32
    next_embeds: torch.Tensor  # [B, n, D] e(x_{i+1})
    positions: torch.Tensor  # [B, n]
    targets: torch.Tensor  # [B, n, D] f_{i+1}
    label_index: torch.Tensor  # [B, n + H, K] draft-vocab index of the target's top tokens after i+1 (0 if none)
    label_p: torch.Tensor  # [B, n + H, K] their probabilities (0 where not in V')
    top1: torch.Tensor  # [B, n + H] the target's top token after i + 1 (-1 past the end)
    valid: torch.Tensor  # [B, n] bool


def make_batch(sequences: Sequence[Reply], embed: torch.Tensor, to_draft: torch.Tensor, device: torch.device,
               extra: int = 0) -> Batch:
    """Inputs i = 0..m-2 of each sequence, padded; labels reach `extra` positions further (Medusa)."""
    n = max(len(s.features) - 1 for s in sequences)
    b, d, k = len(sequences), sequences[0].features.shape[1], sequences[0].top_ids.shape[1]
    features, targets = torch.zeros(b, n, d), torch.zeros(b, n, d)
    next_ids = torch.zeros(b, n, dtype=torch.long)
    positions = torch.zeros(b, n, dtype=torch.long)
    label_ids = torch.zeros(b, n + extra, k, dtype=torch.long)
    label_p = torch.zeros(b, n + extra, k)
    top1 = torch.full((b, n + extra), -1, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    for r, s in enumerate(sequences):
        m = len(s.features) - 1
        features[r, :m] = s.features[:m].float()
        targets[r, :m] = s.features[1 : m + 1].float()
        next_ids[r, :m] = s.tokens[1 : m + 1]
        positions[r, :m] = torch.arange(s.start, s.start + m)
        label_ids[r, :m] = s.top_ids[1 : m + 1].long()
        label_p[r, :m] = s.top_p[1 : m + 1].float()
        top1[r, :m] = s.top_ids[1 : m + 1, 0].long()
        valid[r, :m] = True
    index = to_draft[label_ids]
    label_p = torch.where(index >= 0, label_p, 0.0)
    return Batch(features.to(device), embed[next_ids.to(embed.device)].float().to(device), positions.to(device),
                 targets.to(device), index.clamp(min=0).to(device), label_p.to(device), top1.to(device),
                 valid.to(device))


def head_outputs(head: torch.nn.Module, batch: Batch, steps: int) -> list[torch.Tensor]:
    """Per drafting step (EAGLE: unrolled step s; Medusa: head s), the predicted feature [B, n, D]."""
    if isinstance(head, EagleHead):
        return eagle_unrolled(head, batch.features, batch.next_embeds, batch.positions, steps)
    assert isinstance(head, MedusaHead)
    return head(batch.features)[:steps]


def step_labels(head: torch.nn.Module, batch: Batch, step: int) -> tuple[slice, torch.Tensor]:
    """Where step `step`'s predictions are scored (positions j of the outputs) and the label offset."""
    n = batch.valid.shape[1]
    if isinstance(head, EagleHead):  # step s at j predicts the token after j + 1, from j ≥ s - 1
        return slice(step - 1, n), torch.tensor(0)
    return slice(0, n), torch.tensor(step - 1)  # Medusa head s at j: the token after j + s


def loss_of(head: torch.nn.Module, batch: Batch, readout: torch.Tensor, steps: int) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy against the target's top tokens over V' (+ EAGLE's feature regression),
    weighted STEP_DECAY ** (s - 1) over the steps; and step 1's top-1 agreement."""
    total, weights, agree = torch.zeros((), device=readout.device), 0.0, 0.0
    for s, g in enumerate(head_outputs(head, batch, steps), start=1):
        where, offset = step_labels(head, batch, s)
        n = batch.valid.shape[1]
        shift = int(offset)
        valid = batch.valid[:, where] & (batch.top1[:, shift : shift + n][:, where] >= 0)
        logp = torch.log_softmax((g[:, where] @ readout.T).float(), dim=-1)
        labels = batch.label_index[:, shift : shift + n][:, where]
        probs = batch.label_p[:, shift : shift + n][:, where]
        ce = -(probs * logp.gather(-1, labels)).sum(-1)
        loss = ce[valid].mean() if bool(valid.any()) else ce.sum() * 0
        if isinstance(head, EagleHead):
            reg = F.smooth_l1_loss(g[:, where].float(), batch.targets[:, where], reduction="none").mean(-1)
            loss = loss + REGRESSION_WEIGHT * (reg[valid].mean() if bool(valid.any()) else reg.sum() * 0)
        w = STEP_DECAY ** (s - 1)
        total, weights = total + w * loss, weights + w
        if s == 1 and bool(valid.any()):
            agree = float((logp.argmax(-1) == labels[..., 0])[valid & (probs[..., 0] > 0)].float().mean())
    return total / weights, agree


@dataclass
class TrainState:
    step: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)


def batches_of(sequences: list[Reply], size: int, seed: int, epoch: int) -> list[list[int]]:
    """Epoch `epoch`'s batches: sequences of similar length together, batch order shuffled."""
    rng = random.Random(seed * 7919 + epoch)
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i].features), rng.random()))
    batches = [order[i : i + size] for i in range(0, len(order), size)]
    rng.shuffle(batches)
    return batches


def train_head(options: TrainOptions, head: torch.nn.Module, train: list[Reply], embed: torch.Tensor,
               readout: torch.Tensor, to_draft: torch.Tensor, device: torch.device, checkpoint: Path) -> TrainState:
    optimizer = torch.optim.AdamW(head.parameters(), lr=options.lr, weight_decay=0.0, betas=(0.9, 0.95))
    state = TrainState()
    if checkpoint.exists() and not options.fresh:
        saved = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        state = TrainState(**saved["state"])
        print(f"[train] resumed from {checkpoint} at step {state.step}", file=sys.stderr, flush=True)
    per_epoch = -(-len(train) // options.batch_sequences)
    total = per_epoch * options.epochs
    if options.steps:
        total = min(total, options.steps)
    budget_s = options.minutes * 60
    progress = Progress("train", total)
    extra = options.medusa_heads if options.kind == "medusa" else 0
    steps = options.unroll if options.kind == "eagle" else options.medusa_heads
    last_saved = time.monotonic()
    autocast = autocast_dtype(options.autocast, device)
    head.train()
    for step, indices in _schedule(train, options, state.step, total):
        started = time.monotonic()
        share = max(step / total, state.seconds / budget_s if budget_s else 0.0)
        if share >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = _lr(options, step, share)
        batch = make_batch([train[i] for i in indices], embed, to_draft, device, extra)
        with torch.autocast(device.type, dtype=getattr(torch, autocast), enabled=autocast != "float32"):
            loss, agree = loss_of(head, batch, readout, steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        state.step, state.seconds = step + 1, state.seconds + time.monotonic() - started
        if state.step % 10 == 0 or state.step == 1:
            state.history.append({"step": state.step, "loss": round(loss.item(), 4), "agree1": round(agree, 4)})
        left_s = budget_s - state.seconds
        progress.update(state.step, f"steps; loss {loss.item():.3f}, step-1 agreement {agree:.2f}, "
                        f"{state.seconds / state.step:.1f} s/step, budget left {_clock(left_s)}")
        if time.monotonic() - last_saved > options.checkpoint_s:
            _save_checkpoint(checkpoint, head, optimizer, state)
            last_saved = time.monotonic()
    _save_checkpoint(checkpoint, head, optimizer, state)
    head.eval()
    return state


def _schedule(train: list[Reply], options: TrainOptions, start: int, total: int) -> Iterator[tuple[int, list[int]]]:
    per_epoch = -(-len(train) // options.batch_sequences)
    epoch, order = -1, []
    for step in range(start, total):
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            order = batches_of(train, options.batch_sequences, options.seed, epoch)
        yield step, order[step % per_epoch]


def autocast_dtype(setting: str, device: torch.device) -> str:
    """The training products' dtype: `setting`, or for "auto" bfloat16 on CUDA and float32 elsewhere."""
    if setting != "auto":
        return setting
    return "bfloat16" if device.type == "cuda" else "float32"


def _lr(options: TrainOptions, step: int, share: float) -> float:
    """Linear warm-up, then cosine from lr to lr / 10 over the run's share done."""
    warm = min(1.0, (step + 1) / max(1, options.warmup_steps))
    return options.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, share))))


def _save_checkpoint(path: Path, head: torch.nn.Module, optimizer: Any, state: TrainState) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "state": dataclasses.asdict(state)},
               tmp)
    tmp.replace(path)


# ---- 3. held-out acceptance ----------------------------------------------------------------

@torch.inference_mode()
def heldout_acceptance(head: torch.nn.Module, sequences: list[Reply], embed: torch.Tensor,
                       readout: torch.Tensor, vocab: torch.Tensor, to_draft: torch.Tensor, device: torch.device,
                       depth: int = EVAL_DEPTH) -> dict:
    """Chains of drafts replayed at every position of the held-out greedy replies.

    At a drafting point m (features known up to m, as the engine has them), draft s is step s's
    output at j = m + s - 1 (EAGLE) or head s's at m (Medusa), right when it is the target's top
    token there. acceptance_by_position[s-1]: the share of points where drafts 1..s are all right;
    expected_accepted_length[γ-1] = 1 + Σ_{s≤γ} of those: tokens per target pass with drafts of γ.
    """
    depth = depth if isinstance(head, EagleHead) else min(depth, len(head.blocks))  # type: ignore[arg-type]
    hits = torch.zeros(depth)
    points = torch.zeros(depth)
    extra = depth if isinstance(head, MedusaHead) else 0
    for start in range(0, len(sequences), 16):
        batch = make_batch(sequences[start : start + 16], embed, to_draft, device, extra)
        outputs = head_outputs(head, batch, depth)
        n = batch.valid.shape[1]
        right = []
        for s, g in enumerate(outputs, start=1):
            chosen = vocab[torch.argmax(g @ readout.T, dim=-1)]  # [B, n]
            if isinstance(head, EagleHead):  # draft s from point m sits at j = m + s - 1
                shifted = torch.full_like(chosen, -2)
                shifted[:, : n - s + 1] = chosen[:, s - 1 :]
                truth = torch.full_like(chosen, -1)
                truth[:, : n - s + 1] = batch.top1[:, s - 1 : n]
                right.append((shifted == truth) & (truth >= 0))
            else:
                truth = batch.top1[:, s - 1 : s - 1 + n]
                right.append((chosen == truth) & (truth >= 0))
        exists = [torch.zeros_like(batch.valid) for _ in range(depth)]
        for s in range(1, depth + 1):  # point m has a draft s when its position is inside the reply
            length = batch.valid.sum(1)
            exists[s - 1] = torch.arange(n, device=device)[None, :] + s - 1 < length[:, None]
        chain = torch.ones_like(batch.valid)
        for s in range(depth):
            chain = chain & right[s]
            hits[s] += float((chain & exists[s]).sum())
            points[s] += float(exists[s].sum())
    by_position = (hits / points.clamp(min=1)).tolist()
    expected = [1 + sum(by_position[:gamma]) for gamma in range(1, depth + 1)]
    conditional = [by_position[0]] + [b / a if a else 0.0 for a, b in zip(by_position, by_position[1:], strict=False)]
    return {"positions": int(points[0]), "acceptance_by_position": [round(x, 4) for x in by_position],
            "top1_by_position": [round(x, 4) for x in conditional],
            "expected_accepted_length": [round(x, 3) for x in expected]}


# ---- the command ---------------------------------------------------------------------------

def train(options: TrainOptions, excluded: Sequence[str] = (), loaded: Any = None) -> dict:
    """Data, vocabulary, training, held-out acceptance, artifact; returns the card. `loaded`: the
    target already loaded (a `LoadedModel` of `options.target`; its transformers model generates)."""
    from pipeline.llm.model import load_model
    from pipeline.llm.options import LlmOptions

    if options.kind not in KINDS:
        raise ValueError(f"unknown kind {options.kind!r}: choose one of {', '.join(KINDS)}")
    if options.threads:
        torch.set_num_threads(options.threads)
    torch.manual_seed(options.seed)
    work, folder = options.work_folder(), options.folder()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    fingerprint = target_fingerprint(options.target)
    if loaded is None:  # as the engine serves it: the lean pass's features are the drafter's input
        loaded = load_model(LlmOptions(model=options.target, device=options.device, dtype=options.data_dtype))
    model, tokenizer = loaded.model, loaded.tokenizer
    options = dataclasses.replace(options, data_dtype=str(model.lm_head.weight.dtype).removeprefix("torch."))
    written = self_written_prompts(options, loaded, excluded, work)
    train_prompts, held_prompts = corpus_for(options, excluded, written)
    batches = plan_batches(options, tokenizer, train_prompts, held_prompts)
    record = make_data(options, loaded, batches, work)
    data = load_data(work)
    train_set = [s for s in data if not s.heldout and len(s.features) > 1]
    held_set = [s for s in data if s.heldout and len(s.features) > 1]
    if not train_set or not held_set:
        raise RuntimeError("no training or held-out data was generated (raise --data-minutes)")
    vocab = draft_vocab(train_set, options.vocab_size, loaded.eos_token_ids)
    device = torch.device(options.device)
    embed = model.model.embed_tokens.weight.detach().float().to(device)
    readout = model.lm_head.weight.detach().float()[vocab.to(model.lm_head.weight.device)].to(device)
    to_draft = torch.full((embed.shape[0],), -1, dtype=torch.long)
    to_draft[vocab] = torch.arange(len(vocab))
    shape = HeadShape.of(model.config, options.medusa_heads)
    head = new_head(options.kind, shape)
    _initialise(head, model)
    head = head.to(device)
    checkpoint = work / f"checkpoint-{options.kind}.pt"
    vocab_path = work / f"vocab-{options.kind}.pt"
    if checkpoint.exists() and not options.fresh and vocab_path.exists():
        vocab = torch.load(vocab_path)  # the vocabulary the checkpoint was trained over
        readout = model.lm_head.weight.detach().float()[vocab.to(model.lm_head.weight.device)].to(device)
        to_draft = torch.full((embed.shape[0],), -1, dtype=torch.long)
        to_draft[vocab] = torch.arange(len(vocab))
    torch.save(vocab, vocab_path)
    state = train_head(options, head, train_set, embed, readout, to_draft, device, checkpoint)
    held = heldout_acceptance(head, held_set, embed, readout, vocab.to(device), to_draft, device)
    covered = {"train": round(coverage(train_set, vocab), 4), "heldout": round(coverage(held_set, vocab), 4)}
    card = _card(options, fingerprint, record, train_set, held_set, len(train_prompts), len(held_prompts), vocab,
                 covered, shape, state, held, time.monotonic() - started, len(written))
    save_head(folder, head, vocab, card, getattr(torch, options.storage_dtype))
    print(f"[done] {folder}: expected accepted length by draft length {held['expected_accepted_length']}",
          file=sys.stderr, flush=True)
    return card


def _initialise(head: torch.nn.Module, target: Any) -> None:
    """EAGLE's output norm starts as the target's final norm (g in the features' scale), and its
    layer as the identity on fc's output (attention and MLP outputs zero)."""
    if isinstance(head, EagleHead):
        with torch.no_grad():
            head.out_norm.copy_(target.model.norm.weight.detach().float())
            torch.nn.init.zeros_(head.o.weight)
            torch.nn.init.zeros_(head.down.weight)


def _card(options: TrainOptions, fingerprint: str, record: dict, train_set: list[Reply],
          held_set: list[Reply], train_prompts: int, held_prompts: int, vocab: torch.Tensor, covered: dict,
          shape: HeadShape, state: TrainState, held: dict, seconds: float, self_written: int = 0) -> dict:
    reply_tokens = sum(len(s.features) - 2 for s in train_set)
    return {
        "format": CARD_FORMAT,
        "kind": options.kind,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "target": {"model": options.target, "sha256": fingerprint},
        "shape": dataclasses.asdict(shape),
        "draft_vocab": {"size": len(vocab), "coverage_of_top1": covered},
        "data": {"corpus_prompts": train_prompts + held_prompts, "self_written_prompts": self_written,
                 "train_replies": len(train_set),
                 "train_reply_tokens": reply_tokens, "heldout_replies": len(held_set),
                 "heldout_reply_tokens": sum(len(s.features) - 2 for s in held_set), "seed": options.seed,
                 "temperatures": list(options.temperatures), "max_new_tokens": options.max_new_tokens,
                 "dtype": options.data_dtype, "generation_s": round(record["seconds"], 1),
                 "prompts_planned": train_prompts, "label_top_k": options.label_top_k,
                 "dropped_nonfinite": record.get("dropped_nonfinite", 0)},
        "training": {"steps": state.step, "seconds": round(state.seconds, 1), "unroll": options.unroll,
                     "autocast": autocast_dtype(options.autocast, torch.device(options.device)),
                     "batch_sequences": options.batch_sequences, "lr": options.lr, "epochs": options.epochs,
                     "device": options.device, "threads": torch.get_num_threads(), "history": state.history[-20:]},
        "heldout": held,
        "total_s": round(seconds, 1),
    }


# ---- the engine on the benchmark's prompts --------------------------------------------------

def evaluate(options: TrainOptions, prompts: dict[str, list[str]], limit: int, max_new_tokens: int = 128,
             draft_tokens: int = 8, adaptive: bool = True) -> dict:
    """The artifact as the engine serves it (float32, `llm.weights=auto`): greedy replies to the first
    `limit` prompts of each set with the head and without, identical or not, and the head's
    acceptance by draft position and tokens per target pass (the engine's own counts). `adaptive`:
    the draft length and the guard adapt as they do in service; False: drafts of `draft_tokens` always."""
    from pipeline.llm.engine import GenerationRequest, GenerationStats, Generator
    from pipeline.llm.model import load_model
    from pipeline.llm.options import LlmOptions
    from pipeline.llm.prompts import chat_messages

    llm = LlmOptions(model=options.target, device=options.device, dtype="float32",
                     draft_heads=str(options.folder().parent))
    loaded = load_model(llm)
    generator = Generator.from_options(loaded, llm)
    if options.kind not in generator.draft_heads:
        raise RuntimeError(f"no {options.kind} head for this target under {options.folder().parent}")
    out: dict[str, Any] = {"weights": loaded.weights, "max_new_tokens": max_new_tokens,
                           "max_draft_tokens": draft_tokens, "adaptive_draft": adaptive}
    for workload, texts in prompts.items():
        total, identical = GenerationStats(), 0
        for text in texts[:limit]:
            ids = tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, text)))
            replies = []
            for drafter in ("none", options.kind):
                request = GenerationRequest(ids, max_new_tokens, drafter, max_draft_tokens=draft_tokens,
                                            adaptive_draft=adaptive)
                replies.append([t for step in generator.steps(request) for t in step.token_ids])
            identical += replies[0] == replies[1]
            _add_stats(total, generator.last_stats)
        stats = total.as_dict()
        out[workload] = {"prompts": len(texts[:limit]), "identical_to_plain": identical,
                         **{k: stats[k] for k in ("mean_accepted_len", "acceptance_by_position", "acceptance_rate",
                                                  "drafted_tokens", "new_tokens", "steps", "draft_to_target_cost")}}
        print(f"[evaluate] {workload}: {json.dumps(out[workload])}", file=sys.stderr, flush=True)
    card_path = options.folder() / CARD_FILE
    card = json.loads(card_path.read_text())
    card["benchmark_prompts" if adaptive else f"benchmark_prompts_fixed_{draft_tokens}"] = out  # never trained on
    card_path.write_text(json.dumps(card, indent=2) + "\n")
    return out


def _add_stats(total: Any, stats: Any) -> None:
    total.steps += stats.steps
    total.new_tokens += stats.new_tokens
    total.drafted_tokens += stats.drafted_tokens
    total.accepted_draft_tokens += stats.accepted_draft_tokens
    total.target_s += stats.target_s
    total.draft_s += stats.draft_s
    grow = max(0, len(stats.drafted_at) - len(total.drafted_at))
    total.drafted_at += [0] * grow
    total.accepted_at += [0] * grow
    for i, (d, a) in enumerate(zip(stats.drafted_at, stats.accepted_at, strict=True)):
        total.drafted_at[i] += d
        total.accepted_at[i] += a
