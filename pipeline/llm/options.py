"""The llm stage's settings, apart from the code that reads them.

Importing this module costs no torch: the settings, the gateway (which forwards a session's
sampling options) and the command line load it without the ~125 MB and ~1 s torch takes.
"""

from __future__ import annotations

from dataclasses import dataclass

GRAPH_CACHE_TOKENS = 4096  # capacity of the cache buffers graphs are recorded over (`llm.cuda_graph_tokens`)


@dataclass(frozen=True)
class LlmOptions:
    model: str = "bundled"
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int = 96
    torch_threads: int = 0  # 0: torch's default
    # weights=int4-exact or int4-q8: threads its kernels' loops run on, the calling one included (kernels/pool.h);
    # 0: one per core this process may run on, at most `exact_codes.MAX_KERNEL_THREADS`; `specvox up`,
    # whose asr and tts share those cores, makes 0 one (services/cli/serve.py kernel_threads_beside_other_stages)
    kernel_threads: int = 0
    offline: bool = True  # never reach a model hub unless told to
    # A GGUF target's conversion to transformers' format, made on its first load and read by the
    # later ones (pipeline/llm/gguf_cache.py: ~1 s against ~21 s): "" $XDG_CACHE_HOME/specvox/gguf
    # (~/.cache/specvox/gguf), a folder, or "off" to convert on every load.
    gguf_cache: str = ""
    drafter: str = "suffix"  # the default drafter: none, ngram, suffix, early-exit, quantized, draft
    draft_model: str = ""  # a smaller causal LM sharing the target's tokenizer (path or hub id)
    early_exit_layers: int = 8  # depth of the self-speculative drafter
    # Trained draft heads (pipeline/llm/draft_head.py): a folder of artifacts, the one trained for this
    # target's weights is offered as the `eagle` or `medusa` drafter; "": the shipped ones; "off": none.
    draft_heads: str = ""
    max_draft_tokens: int = 8
    adaptive_draft: bool = True
    # ngram and suffix: up to this many other continuations beside the draft, verified with it as a
    # token tree in one pass (pipeline/llm/token_tree.py), alone or in a batch.
    draft_branches: int = 0
    static_cache: bool = False  # preallocated KV cache per request (rollback by length); slower in eager mode here
    # Llama-architecture targets run through pipeline/llm/lean_llama.py (same arithmetic, fewer
    # operations, MKL-packed float32 products on a CPU); false: through transformers' modules.
    lean_forward: bool = True
    pack_weights: bool = True  # lean_forward on a CPU in float32: MKL-packed weight copies (+1.3× their memory)
    # weights=int4-exact: a decoding pass runs its decoder layers in one C++ call (kernels/lean_step.cpp);
    # false: through torch's operations (the same arithmetic, ~1,200 operations a step)
    fused_step: bool = True
    # On a CUDA device, one reply's decoding steps and verification passes are replayed as CUDA graphs
    # (pipeline/llm/cuda_graph_step.py) where the pass is not row-invariant (float32); false: launched
    # operation by operation.
    cuda_graphs: bool = True
    # the slots of the cache buffers graphs are recorded over (`cuda_graph_step.GRAPH_BUFFERS`, allocated as
    # replies need them); a reply whose prompt and tokens do not fit runs eagerly
    cuda_graph_tokens: int = GRAPH_CACHE_TOKENS
    # "dense": the weights as loaded, in `dtype`. "int4-exact": kept as the 4- and 8-bit codes a
    # quantized checkpoint (the bundled Q4_1 GGUF) stored them in, dequantized exactly to float32 in
    # the kernel (pipeline/llm/exact_codes.py): float32 outputs, a sixth of the memory traffic; needs
    # lean_forward, dtype=float32, an x86-64 CPU with AVX2 or AVX-512. "int4-q8": the same codes, each product's
    # activations quantized to 8 bits per group of 32 and summed as integers, as llama.cpp does (GGUF's Q8_0):
    # cheaper rows (verification passes), outputs the form's own, not float32's; the same needs as int4-exact.
    # "int4": the layers' weights as 4-bit groups of
    # 32 through torch's CPU kernel with bfloat16 activations; needs lean_forward and dtype=bfloat16.
    # "auto": int4-exact where it applies (the outputs are dense float32's either way), else dense;
    # the choice and its reason are logged at load, and `LoadedModel.weights` says which runs.
    weights: str = "auto"
    max_batch_size: int = 8  # concurrent replies verified in one target pass (pipeline/llm/batch.py); 1: one at a time
    # First phrases first (pipeline/llm/batch.py): while a reply in the batch has fewer tokens than
    # urgent_tokens (its first phrase, which a listener waits for), replies with park_min_tokens or
    # more sit the steps out. 0: every reply steps every time.
    urgent_tokens: int = 10
    park_min_tokens: int = 20
    prefix_cache_sessions: int = 8  # sessions whose KV cache is kept between turns (llm/prefix_cache.py); 0: off
    prefix_cache_mb: int = 512  # and the most their KV caches hold together, MiB as allocated; 0: no bound in bytes
    # What the latency budget cuts a late turn to (pipeline/llm/budget.py): "reply_capped", "draft_shortened".
    degraded_max_new_tokens: int = 40
    degraded_max_draft_tokens: int = 3


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off (CTRL, Keskar et al. 2019)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> SamplingOptions:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.repetition_penalty <= 0:
            raise ValueError(f"invalid sampling options: {self}")
        return self
