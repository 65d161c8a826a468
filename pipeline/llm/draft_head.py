"""Trained draft heads on the target's own features: EAGLE and Medusa, their artifact, their drafter.

Both read the target's feature f_t: the final-normed hidden state of token t, what the
target's output matrix W multiplies to give p_{t+1} (the lean pass hands it out,
`LeanOutput.hidden`, normed by `LeanLlama.normed`). Both read out through W cut to a
draft vocabulary V' (the tokens the target's replies used most, as FR-Spec does);
verification stays over the whole vocabulary, so the output is the target's whatever the
head proposes.

- **EAGLE** (Li, Wei, Zhang & Zhang 2024, "EAGLE: Speculative Sampling Requires Rethinking
  Feature Uncertainty", arXiv 2401.15077): one decoder layer, autoregressive over
  features. Its input at position i is fc([f_i; e(x_{i+1})]) (the feature and the *next*
  token's embedding, which resolves the feature's uncertainty, the paper's §3), and its
  output g_i predicts f_{i+1} (paper eq. f̂_{i+1} = Head(f_{≤i}, e_{≤i+1})), read out as
  q = softmax(W' g_i). Drafting feeds its own g back: fc([g_i; e(d)]) for the drafted d.
- **Medusa** (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
  Multiple Decoding Heads", arXiv 2401.10774): K residual heads on the last feature,
  head k giving p̂ for the token k + 1 places ahead (paper eq. 1:
  p_t^(k) = softmax(W_2^(k) (SiLU(W_1^(k) h_t) + h_t)), with W_2 the target's W' here).

Training is pipeline/llm/train_draft.py. The artifact is a folder with `head.safetensors`
(the head's weights and the draft vocabulary) and `card.json` (the target's weights' hash,
the data, the training, the held-out acceptance); `load_head` refuses a card whose target
hash is not the target's. `HEADS_DIR` holds the artifacts the engine offers by default.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pipeline.llm.cuda_graph_step import Stopwatch
from pipeline.llm.drafters import EMPTY, Draft
from pipeline.llm.eagle_graph import DraftChain, head_graphs_apply
from pipeline.llm.kv_cache import KVCache
from pipeline.llm.options import GRAPH_CACHE_TOKENS, SamplingOptions
from pipeline.llm.sampling import RandomSource, generator_at, greedy_tokens, logits_to_probs, sample

log = logging.getLogger(__name__)

KINDS = ("eagle", "medusa")
CARD_FILE, WEIGHTS_FILE = "card.json", "head.safetensors"
CARD_FORMAT = 1
HEADS_DIR = Path(__file__).resolve().parent / "heads"  # the artifacts shipped with the engine
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin")
_FINGERPRINTS: dict[tuple[str, int, float], str] = {}


class DraftHeadMismatchError(ValueError):
    """A draft head was trained for another target than the one it is loaded against."""


@dataclass(frozen=True)
class HeadShape:
    """The head's sizes: the target's (a head layer is shaped like one of the target's layers)."""

    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    eps: float
    rope_theta: float
    medusa_heads: int = 4

    @classmethod
    def of(cls, config: Any, medusa_heads: int = 4) -> HeadShape:
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        return cls(hidden, heads, int(config.num_key_value_heads), int(getattr(config, "head_dim", None) or
                   hidden // heads), int(config.intermediate_size), float(config.rms_norm_eps), theta, medusa_heads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos, sin [..., head_dim] of rotary embeddings (Su et al. 2021) at `positions`, rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class EagleHead(nn.Module):
    """EAGLE's draft head: fc over [feature; next token's embedding], then one Llama decoder layer
    whose output, normed, is the predicted next feature g (read out by the caller through W')."""

    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        d, hd = shape.hidden_size, shape.head_dim
        self.shape = shape
        self.fc = nn.Linear(2 * d, d)
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, (shape.heads + 2 * shape.kv_heads) * hd, bias=False)
        self.o = nn.Linear(shape.heads * hd, d, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * shape.intermediate_size, bias=False)
        self.down = nn.Linear(shape.intermediate_size, d, bias=False)
        self.out_norm = nn.Parameter(torch.ones(d))  # set to the target's final norm before training

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [..., head_dim] at `positions`: the target's rotary embedding."""
        return rotary(positions, self.shape.head_dim, self.shape.rope_theta, dtype)

    def block(self, features: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              past: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(g [B, T, D], this pass's keys and values [B, KV, T, hd]) for inputs [B, T, D] each.

        Queries attend to `past` keys then their own; `mask` [T, P + T] (True: attend) or None
        (causal over this pass, everything past)."""
        new: list[torch.Tensor] = []

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            new.extend((k, v))
            keys, values = (k, v) if past is None else (torch.cat((past[0], k), 2), torch.cat((past[1], v), 2))
            t, seen = q.shape[2], mask
            if seen is None and t > 1:
                seen = torch.ones(t, keys.shape[2], dtype=torch.bool, device=q.device).tril(keys.shape[2] - t)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=seen,
                                                  enable_gqa=self.shape.heads != self.shape.kv_heads)

        g = self.layer(features, embeds, cos, sin, attend)
        return g, new[0], new[1]

    def layer(self, features: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """g [B, T, D] for inputs [B, T, D]: fc, then the decoder layer, whose attention is
        `attend(q, k, v)` ([B, H, T, hd] queries, this pass's rotated keys and values) wherever the
        keys are kept (`block`'s concatenation, or a cache buffer written in place: `eagle_graph`)."""
        s = self.shape
        b, t, _ = features.shape
        x = self.fc(torch.cat((features, embeds), dim=-1))
        q_k_v = self.qkv(rms_norm(x, self.attn_norm, s.eps)).view(b, t, s.heads + 2 * s.kv_heads, s.head_dim)
        q_k_v = q_k_v.transpose(1, 2)
        q = _rotate(q_k_v[:, : s.heads], cos, sin)
        k = _rotate(q_k_v[:, s.heads : s.heads + s.kv_heads], cos, sin)
        attended = attend(q, k, q_k_v[:, s.heads + s.kv_heads :])
        h = x + self.o(attended.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))
        gate, up = self.gate_up(rms_norm(h, self.mlp_norm, s.eps)).chunk(2, dim=-1)
        h = h + self.down(F.silu(gate) * up)
        return rms_norm(h, self.out_norm, s.eps)


def unroll_mask(steps: int, length: int, device: torch.device) -> torch.Tensor:
    """[length, steps · length]: what query j of unrolled step `steps` sees among the keys of steps 1..steps.

    Drafting step s from a prefix known up to position m computes its query at j = m + s - 1
    over the keys of the known positions (step 1's, from true features: positions ≤ j - s + 1)
    and the keys its own earlier draft steps appended (step r's at position j - s + r). So
    training on every position at once with this mask is what drafting does (EAGLE-3's
    "training-time test", Li et al. 2025, arXiv 2503.01840), not only its first step.
    """
    j = torch.arange(length, device=device)[:, None]
    i = torch.arange(length, device=device)[None, :]
    blocks = [i <= j - steps + 1] + [i == j - steps + r for r in range(2, steps + 1)]
    return torch.cat(blocks, dim=1)


def eagle_unrolled(head: EagleHead, features: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                   steps: int) -> list[torch.Tensor]:
    """g of unrolled steps 1..steps at every position [B, T, D] (train_draft trains and evaluates on these).

    Step 1 reads the true features; step s reads step s - 1's prediction of the feature at
    each position (its output one position back) and attends as `unroll_mask` says; every
    step reads the true next token (a draft whose earlier tokens are wrong is rejected anyway)."""
    s = head.shape
    cos, sin = rotary(positions, s.head_dim, s.rope_theta, features.dtype)
    cos, sin = cos[:, None], sin[:, None]
    outs: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    inputs = features
    for step in range(1, steps + 1):
        if step > 1:
            inputs = torch.cat((torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]), dim=1)
        mask = unroll_mask(step, features.shape[1], features.device)
        past = (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None
        g, k, v = head.block(inputs, next_embeds, cos, sin, past, mask)
        outs.append(g)
        keys.append(k)
        values.append(v)
    return outs


class MedusaHead(nn.Module):
    """Medusa's heads: head k (1..K) maps f_t to f_t + SiLU(W_k f_t + b_k), read out through W'."""

    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        self.shape = shape
        self.blocks = nn.ModuleList(nn.Linear(shape.hidden_size, shape.hidden_size) for _ in range(shape.medusa_heads))
        for block in self.blocks:  # zero: every head starts as the target's own next-token readout
            assert isinstance(block, nn.Linear)
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> list[torch.Tensor]:
        return [features + F.silu(block(features)) for block in self.blocks]


def new_head(kind: str, shape: HeadShape) -> EagleHead | MedusaHead:
    if kind == "eagle":
        return EagleHead(shape)
    if kind == "medusa":
        return MedusaHead(shape)
    raise ValueError(f"unknown draft head kind {kind!r}: choose one of {', '.join(KINDS)}")


def weight_files(model: str) -> list[Path]:
    """The target's weight files (a GGUF, or a folder's safetensors/bin/gguf files), for its hash."""
    from pipeline.models import resolve_llm

    ref = resolve_llm(model)
    if ref.gguf_file:
        return [Path(ref.name_or_path) / ref.gguf_file]
    folder = Path(ref.name_or_path)
    files = sorted(p for p in folder.glob("*") if p.suffix in WEIGHT_SUFFIXES) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no local weight files for {model!r} to hash")
    return files


def target_fingerprint(model: str) -> str:
    """sha256 over the target's weight files, in name order (computed once per file version)."""
    digest = hashlib.sha256()
    for path in weight_files(model):
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime)
        if key not in _FINGERPRINTS:
            file_hash = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    file_hash.update(chunk)
            _FINGERPRINTS[key] = file_hash.hexdigest()
        digest.update(path.name.encode() + b"\0" + _FINGERPRINTS[key].encode())
    return digest.hexdigest()


def save_head(folder: Path, head: nn.Module, vocab: torch.Tensor, card: dict, dtype: torch.dtype) -> None:
    """Write the artifact: weights (in `dtype`, the vocabulary as int32) and the card."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(dtype).contiguous().cpu() for name, t in head.state_dict().items()}
    tensors["draft_vocab"] = vocab.to(torch.int32).cpu()
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")


def read_card(folder: Path) -> dict:
    card = json.loads((folder / CARD_FILE).read_text())
    if card.get("format") != CARD_FORMAT or card.get("kind") not in KINDS:
        raise ValueError(f"{folder / CARD_FILE} is not a draft head card of format {CARD_FORMAT}")
    return card


class TrainedHead:
    """A loaded head beside its target: the head in the target's dtype, the draft vocabulary and W'."""

    def __init__(self, card: dict, head: EagleHead | MedusaHead, vocab: torch.Tensor, target: Any,
                 folder: Path) -> None:
        """`target`: the target's transformers model (its embedding, final norm and output matrix)."""
        self.card, self.kind, self.head, self.folder = card, str(card["kind"]), head, folder
        self.vocab = vocab  # [V'] token ids
        self.embed = target.model.embed_tokens.weight  # [V, D]
        self.readout = target.lm_head.weight.detach()[vocab].clone()  # [V', D]: W' (the tied W's rows)
        self.final_norm = target.model.norm.weight.detach()
        self.eps = float(target.config.rms_norm_eps)
        self.vocab_size = int(self.embed.shape[0])
        self.coded: CodedEagle | None = None  # set by `run_on`: the head through the target's kernels
        self.chain: DraftChain | None = None  # set by `run_on`: greedy chains as CUDA graphs

    def run_on(self, lean: Any) -> bool:
        """Draft through the kernels of the target's lean pass `lean` where it has them (an EAGLE head
        beside a coded target: `CodedEagle`); whether it does. On a CUDA device where the lean pass
        records graphs (`llm.cuda_graphs`), an EAGLE head's greedy chains are graphs too (`DraftChain`)."""
        head = self.head
        if isinstance(head, EagleHead) and CodedEagle.applies(lean):
            self.coded = CodedEagle(head, self.readout, lean)
        if isinstance(head, EagleHead) and lean is not None and head_graphs_apply(self.embed.device, lean.graphs):
            self.chain = DraftChain(head, self.embed, self.readout, self.vocab.to(self.embed.device),
                                    getattr(lean, "graph_tokens", GRAPH_CACHE_TOKENS))
        return self.coded is not None

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final norm of its last layer's output: the feature f the head reads."""
        return rms_norm(hidden, self.final_norm, self.eps)

    def drafter(self, sampling: SamplingOptions, generator: RandomSource = None) -> HeadDrafter:
        return HeadDrafter(self, sampling, generator)


def load_head(folder: Path, target: Any, target_sha256: str) -> TrainedHead:
    """The head in `folder` for `target` (a transformers model), if it was trained for weights with
    this hash; else DraftHeadMismatchError, which names both hashes."""
    from safetensors.torch import load_file

    card = read_card(folder)
    trained_for = card["target"]["sha256"]
    if trained_for != target_sha256:
        raise DraftHeadMismatchError(
            f"the {card['kind']} head in {folder} was trained for target weights {trained_for[:16]}… "
            f"({card['target'].get('model', '?')}), not for this target's {target_sha256[:16]}…: "
            "train one for it with `specvox train-draft`")
    tensors = load_file(str(folder / WEIGHTS_FILE))
    vocab = tensors.pop("draft_vocab").long()
    shape = HeadShape(**card["shape"])
    if shape.hidden_size != int(target.config.hidden_size):
        raise DraftHeadMismatchError(f"the head's hidden size {shape.hidden_size} is not the target's")
    head = new_head(card["kind"], shape)
    head.load_state_dict(tensors)
    embed = target.model.embed_tokens.weight
    head = head.to(device=embed.device, dtype=embed.dtype).eval().requires_grad_(False)
    return TrainedHead(card, head, vocab.to(embed.device), target, folder)


def find_heads(model: str, target: Any, heads_dir: str | Path = "") -> dict[str, TrainedHead]:
    """The heads under `heads_dir` ("": `HEADS_DIR`) trained for this target's weights, by kind (the
    first folder in name order of each kind); a head trained for another target is passed over, and
    said so in the log."""
    folder = Path(heads_dir) if heads_dir else HEADS_DIR
    cards = sorted(folder.glob(f"*/{CARD_FILE}")) if folder.is_dir() else []
    if not cards:
        return {}
    try:
        fingerprint = target_fingerprint(model)
    except (OSError, ValueError, RuntimeError) as e:
        log.info("draft heads: cannot hash the target's weights (%s); none offered", e)
        return {}
    heads: dict[str, TrainedHead] = {}
    for card in cards:
        try:
            head = load_head(card.parent, target, fingerprint)
        except DraftHeadMismatchError as e:
            log.info("draft heads: %s", e)
            continue
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            log.warning("draft heads: %s does not load (%s: %s)", card.parent, type(e).__name__, e)
            continue
        heads.setdefault(head.kind, head)
    return heads


def head_cache(shape: HeadShape, like: torch.Tensor) -> KVCache:
    """The EAGLE head's keys and values: one layer in the target's cache layout [1, 1, KV, S, hd] (the
    fused pass's, `CodedEagle`, and the graph buffers', `eagle_graph`); rollback moves its `length`."""
    return KVCache(1, 1, shape.kv_heads, shape.head_dim, like.dtype, like.device)


class CodedEagle:
    """An EAGLE head run through the target's kernels (`exact_codes`; a target in `llm.weights=int4-exact`
    or `int4-q8`): its matrices rounded to GGUF's Q8_0 grid, its decoder layer one fused C++ pass
    (`kernels/lean_step.cpp`, one layer of 8-bit records) and W' the target's own 8-bit output rows.

    In float32 torch operations a draft token read the head's 31 MB of weights and W' and ran ~40
    operations, about a third of what a target step costs here; as codes it reads a quarter of the
    bytes in a handful of calls. Q8_0's rounding changes the head's predictions a little, never the
    output: verification decides every token, and a sampled draft's q is what this head computed.
    """

    def __init__(self, head: EagleHead, readout: torch.Tensor, lean: Any) -> None:
        from pipeline.llm import exact_codes

        s = head.shape
        q8 = bool(getattr(lean.linear, "int8_activations", False))
        self.lean, self.shape = lean, s
        self.kernels = exact_codes.kernels()

        def records(weight: torch.Tensor) -> torch.Tensor:
            return exact_codes.int8_records(*exact_codes.q8_0_codes(weight.detach()), int8_activations=q8).records

        self.fc, self.fc_bias = records(head.fc.weight), head.fc.bias.detach().float()
        self.step = self.kernels.LeanStep(
            [head.attn_norm.detach().float().contiguous()], [records(head.qkv.weight)], [records(head.o.weight)],
            [head.mlp_norm.detach().float().contiguous()], [records(head.gate_up.weight)], [records(head.down.weight)],
            s.heads, s.kv_heads, s.head_dim, s.eps, q8)
        self.out_norm = head.out_norm.detach().float()
        rows = readout.shape[0]
        padded = torch.cat((readout, readout.new_zeros(-rows % exact_codes.LANES, readout.shape[1])))  # 16 a block
        # the target's own codes where W' is Q8_0 (the bundled GGUF's: its codes round to themselves)
        self.readout, self.rows = records(padded), rows
        self._product = self.kernels.int8_q8_linear if q8 else self.kernels.int8_linear

    @classmethod
    def applies(cls, lean: Any) -> bool:
        """Whether `lean` (the target's `LeanLlama`, or None) runs the kernels a coded head needs."""
        return lean is not None and getattr(lean, "step", None) is not None

    def block(self, features: torch.Tensor, embeds: torch.Tensor, first: int, cache: KVCache) -> torch.Tensor:
        """EagleHead.block over features and embeds [1, T, D] at positions first..., its keys and values
        written after the cache's `length` live slots (which the caller then advances); g [1, T, D]."""
        t = features.shape[1]
        x = torch.cat((features, embeds), dim=-1)[0].float().contiguous()
        x = self._product(x, self.fc)
        x += self.fc_bias
        cache.reserve(cache.length + t)
        self.lean._grow_rotary_table(first + t)
        positions = torch.arange(first, first + t)[None]
        x = self.step.forward(x, cache.keys, cache.values, cache.length, self.lean._cos, self.lean._sin, positions,
                              None, None)
        return rms_norm(x, self.out_norm, self.shape.eps)[None]

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """W' g for g [D]: the head's logits over the draft vocabulary [V']."""
        return self._product(g[None].float().contiguous(), self.readout)[0, : self.rows]


class HeadDrafter:
    """Drafts with a trained head from the target's features of the verified positions.

    The engine hands over the features of each pass's verified positions (`observe`); they
    always cover the context but its last token (the one the last pass chose), which is what
    the head needs: from f_{T-2} and e(x_{T-1}) it predicts f_{T-1}, hence x_T, and goes on
    from its own predictions. Until the first features arrive (a prefill that handed none)
    it proposes nothing. EAGLE keeps a KV cache of its layer over the positions drafted from
    true features and drops what it appended while drafting; Medusa needs only f_{T-2}.
    Sampled drafts are drawn from q over V' (zero elsewhere), so the verifier's rule keeps
    the target's distribution. `steady_pass_s`: the last `propose`'s time per draft token, its
    catch-up included (a few rows of one layer: a draft token's price for the draft-length model).

    Token trees (greedy only, `branches` > 0): besides its chain of top-1 tokens the head offers,
    at each depth, up to `branches` other tokens of its top-k as siblings of that depth's chain
    token, each valued at the head's probability of the path to it (the chain's probabilities
    down to its parent times its own). Only siblings worth more than `min_value` are offered,
    the most valuable first: the dynamic draft tree of EAGLE-2 (Li et al. 2024, arXiv
    2406.16858, §4: expand and rerank by the draft's confidence), over one drafting pass per
    depth. The engine sets `min_value` to the verification cost of one more row as a share of a
    plain step, so a node joins the tree only where its chance of being accepted pays its row.
    Under sampling the head drafts a chain, whose q the rejection rule uses.
    """

    model_free = False
    steady_pass_s: float | None = None
    branches = 0  # siblings a depth at most, for a token tree (greedy only)
    min_value = 0.0  # a sibling's path probability must exceed this to be offered

    def __init__(self, trained: TrainedHead, sampling: SamplingOptions, generator: RandomSource = None) -> None:
        self.trained, self.sampling, self.generator = trained, sampling, generator
        self.name = trained.kind
        self.start = -1  # the context position of the first feature held
        self.features: list[torch.Tensor] = []  # normed features [D] of positions start, start + 1, …
        shape = trained.head.shape
        self._cache = head_cache(shape, trained.readout) if self.name == "eagle" else None

    def observe(self, first: int, hidden: torch.Tensor) -> None:
        """The target's last-layer outputs (before its final norm) [m, D] of positions first..first+m-1."""
        rows = list(self.trained.normed(hidden).unbind(0))
        end = self.start + len(self.features)
        if self.start < 0 or first > end or first < self.start:  # a gap: start over from these
            self.start, self.features = first, rows
            if self._cache is not None:
                self._cache.length = 0
            return
        del self.features[first - self.start :]
        self.features += rows
        if self._cache is not None:
            self._cache.length = min(self._cache.length, first - self.start)

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        last = len(context) - 2  # the position whose feature drafting starts from
        if k < 1 or self.start < 0 or not self.start <= last < self.start + len(self.features):
            return EMPTY
        del self.features[last - self.start + 1 :]
        started = Stopwatch()  # a graph's recording is not a draft token's price
        draft = self._medusa(context, k) if self._cache is None else self._eagle(context, k)
        self.steady_pass_s = started.seconds / max(1, len(draft.tokens))  # host-synced by reading the tokens
        return draft

    def _eagle(self, context: Sequence[int], k: int) -> Draft:
        trained, cache = self.trained, self._cache
        assert cache is not None
        head = trained.head
        assert isinstance(head, EagleHead)
        # drop what the last draft appended; the last true position is rerun (its output is the first draft's)
        cache.length = min(cache.length, len(self.features) - 1)
        chain = trained.chain if self.sampling.greedy else None
        if chain is not None and not chain.place(cache, len(self.features) + k):
            chain = None  # every graph buffer is taken, or the reply outgrew them: this chain drafts eagerly
        first = self.start + cache.length  # positions first..T-2 have true features not yet in the cache
        features = torch.stack(self.features[cache.length :])[None]
        embeds = trained.embed[torch.tensor(context[first + 1 :], device=features.device)][None]
        g = self._block(head, features, embeds, first)[:, -1:]
        true_length = cache.length
        siblings: list[tuple[float, tuple[int, ...]]] = []  # (path probability, path) of the tree's other nodes
        if chain is not None:
            tokens, top_p, top_tokens = chain.draft(g, len(context) - 1, cache, k, self.branches)
            chain_p = 1.0
            for i in range(k if self.branches else 0):
                chain_p = self._siblings(top_p[i], top_tokens[i], tuple(tokens[:i]), chain_p, siblings)
            rows: list[torch.Tensor] = []
        else:
            tokens, rows = self._eager_chain(g, context, k, siblings)
        cache.length = true_length
        branches = tuple(path for _, path in sorted(siblings, key=lambda s: -s[0]))
        return Draft(tuple(tokens), torch.stack(rows) if rows else None, branches=branches)

    def _eager_chain(self, g: torch.Tensor, context: Sequence[int], k: int,
                     siblings: list[tuple[float, tuple[int, ...]]]) -> tuple[list[int], list[torch.Tensor]]:
        """The draft tokens and, when sampling, their q rows, one operation at a time from the head's
        output g [1, 1, D] at the last true position; a greedy tree's siblings go to `siblings`."""
        trained, head = self.trained, self.trained.head
        assert isinstance(head, EagleHead)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        chain_p = 1.0  # the head's probability of the chain so far
        for i in range(k):
            logits = trained.coded.logits(g[0, 0]) if trained.coded is not None else g[0, 0] @ trained.readout.T
            token, q = self._choose(logits, len(context) + i)
            if self.branches and self.sampling.greedy:
                top = torch.topk(torch.softmax(logits.float(), dim=-1), min(1 + self.branches, logits.numel()))
                chain_p = self._siblings(top.values.tolist(), trained.vocab[top.indices].tolist(), tuple(tokens),
                                         chain_p, siblings)
            tokens.append(token)
            if q is not None:
                rows.append(q)
            if i + 1 < k:
                g = self._block(head, g, trained.embed[token][None, None], len(context) - 1 + i)
        return tokens, rows

    def _siblings(self, top_p: list[float], top_tokens: list[int], chain: tuple[int, ...], chain_p: float,
                  out: list[tuple[float, tuple[int, ...]]]) -> float:
        """Add the alternatives to the chain's next token (the head's top-k after its top-1: their
        probabilities and token ids) worth more than `min_value` to `out`; returns the chain's
        probability through its own next token (the top-1)."""
        values = [chain_p * p for p in top_p]
        for value, token in zip(values[1:], top_tokens[1:], strict=True):
            if value > self.min_value:
                out.append((value, (*chain, int(token))))
        return values[0]

    def _block(self, head: EagleHead, features: torch.Tensor, embeds: torch.Tensor, first: int) -> torch.Tensor:
        cache = self._cache
        assert cache is not None
        coded = self.trained.coded
        if coded is not None:
            g = coded.block(features, embeds, first, cache)
            cache.length += features.shape[1]
            return g
        positions = torch.arange(first, first + features.shape[1], device=features.device)
        cos, sin = head.rotary(positions, features.dtype)
        past = (cache.layers[0].keys, cache.layers[0].values) if cache.length else None
        g, k, v = head.block(features, embeds, cos, sin, past)
        cache.write(0, cache.extend(features.shape[1]), k, v)
        return g

    def _medusa(self, context: Sequence[int], k: int) -> Draft:
        trained = self.trained
        heads = trained.head(self.features[-1][None])[:k]
        tokens, rows = [], []
        for i, h in enumerate(heads):
            token, q = self._choose(h[0] @ trained.readout.T, len(context) + i)
            tokens.append(token)
            if q is not None:
                rows.append(q)
        return Draft(tuple(tokens), torch.stack(rows) if rows else None)

    def _choose(self, logits: torch.Tensor, index: int) -> tuple[int, torch.Tensor | None]:
        """The draft token from the head's logits over V' and, when sampling, q over the whole vocabulary."""
        vocab = self.trained.vocab
        if self.sampling.greedy:
            return int(vocab[int(greedy_tokens(logits))]), None
        probs = logits_to_probs(logits.float()[None], self.sampling)[0]
        choice = sample(probs, generator_at(self.generator, index))
        q = probs.new_zeros(self.trained.vocab_size)
        q[vocab] = probs
        return int(vocab[choice]), q

    def commit(self, context: Sequence[int]) -> None:
        self.start, self.features = -1, []
        if self._cache is not None:
            self._cache.length = 0

