"""Which attention implementation one forward pass runs: the rules behind
``attention_impl="auto"``, as a pure function of static facts about the call.

Implementations (``ModelConfig.attention_impl``):

* ``dense``, ``chunked``: :mod:`pmd_jax.models.attention` (pure JAX, every backend).
* ``cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn")``, cuDNN's fused
  flash attention (NVIDIA GPUs). Causal via ``is_causal``, GQA natively, the sliding window via
  ``local_window_size``. Key padding of right-padded rows (each row's real tokens are slots
  [0, n): ``forward(..., right_padded=True)``, as the train step's batches are) as sequence
  lengths, ``query_seq_lengths`` / ``key_value_seq_lengths`` (cuDNN's ``PADDING_CAUSAL``
  mask, computed inside the kernel: no mask array, no bias, no ``dbias``). Packed segments,
  the shared-prefix layout (segment 0 seen by every segment of its row) and padding not known
  to be right padding (left padding: lengths cannot say where a row starts) via a boolean
  ``mask`` [B, 1, T, S], which JAX hands to cuDNN as an additive bias: one [B, T, S] array in
  the compute dtype per forward, and cuDNN's backward then also writes its gradient
  ``dbias`` (JAX's ``should_export_dbias`` is always True), a T x S output nobody reads.
* ``cudnn_xla``: the very same call with ``implementation="xla"``: runs anywhere, so the CPU
  tests check the cuDNN path's masks, lengths, window and layout against the dense
  reference (the xla implementation builds its mask from the lengths itself).
* ``splash``: the Pallas Splash attention kernel
  (``jax.experimental.pallas.ops.tpu.splash_attention``) on TPU: causal / sliding window as a
  static block-sparse mask, key padding and packed segments as its segment ids (padding tokens
  are a segment of their own). Off TPU it runs in Pallas interpret mode (slow; for tests).

Rules for ``auto`` (MaxText's ``autoselected`` where it has one):

1. Not a GPU or TPU backend (CPU): the rule of before, unchanged (:func:`legacy_rule`: chunked
   when one row's T x S scores exceed 1024^2 entries, else dense).
2. With a KV cache (sampler prefill and decode): rule 1. The queries start at a traced cache
   slot, which neither kernel's static causal mask can express (MaxText: autoregressive ->
   dot_product).
3. Fewer than 128 queries: rule 1 (MaxText: ``length < 128`` -> dot_product).
4. GPU: ``cudnn``, unless the compute dtype is not bf16/fp16 (cuDNN flash attention takes half
   types only), the head dim is not a multiple of 8 or exceeds 128 (256 from Hopper, compute
   capability 9.0), the call needs a mask (segments, the shared prefix, or key padding not
   known to be right padding) and T or S is odd (cuDNN's backward with a bias needs even
   lengths; sequence lengths alone carry no such limit), or the device is not a CUDA device
   (ROCm). Then rule 1.
5. TPU: ``splash``, unless the shared-prefix layout is asked for (Splash segment ids express
   "same segment" only, not "segment 0 is seen by all"): then rule 1.

An explicit fused implementation is honoured or refused with the reason (``ConfigError``),
never silently replaced, except with a KV cache, where every implementation means rule 1
(a training config asking for ``cudnn`` still samples with the KV-cache attention).
"""

from __future__ import annotations

import dataclasses

from pmd_jax.models.config import ATTENTION_IMPLS, ConfigError

# "auto" on CPU picks chunked when one row's score matrix T x S has more entries than this
# (1024 x 1024). On XLA:CPU (9 heads, hd 64, chunks of 512) chunked was already faster from
# T = S = 512 (forward 224 vs 291 ms for 8 rows; forward + backward at 1024: 0.4 vs 0.9 s,
# at 4096: 3.0 vs 21.6 s), and above this size the dense float32 scores dominate memory.
AUTO_CHUNKED_MIN_SCORES = 1024 * 1024
FUSED_MIN_QUERIES = 128  # MaxText's autoselected: dot_product below 128 queries
FUSED_IMPLS: tuple[str, ...] = ("cudnn", "cudnn_xla", "splash")
GPU_BACKENDS: tuple[str, ...] = ("gpu", "cuda")
CUDNN_DTYPES: tuple[str, ...] = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The static facts about one attention call that decide its implementation."""

    backend: str  # jax.default_backend(): "cpu" | "gpu" | "tpu" | ...
    T: int  # queries per row
    S: int  # keys per row (the cache length with a cache)
    dtype: str = "float32"  # compute dtype of q, k, v
    head_dim: int = 64
    has_cache: bool = False
    key_padding: bool = False  # an attention mask was given (some keys may be padding)
    segments: bool = False  # packed segment ids
    shared_prefix: bool = False  # segment 0 is seen by every segment of its row
    gpu_compute_capability: str | None = None  # "9.0" on H100/H200; None: not a CUDA device
    right_padded: bool = False  # the key padding is a suffix of each row (lengths express it)

    @property
    def seq_lengths(self) -> bool:
        """The key padding goes to the fused kernel as per-row lengths (no mask)."""
        return (self.key_padding and self.right_padded and not self.segments
                and not self.shared_prefix)

    @property
    def needs_mask(self) -> bool:
        """The fused kernel needs a [B, 1, T, S] mask (cuDNN: a bias, and its dbias)."""
        return (self.key_padding and not self.seq_lengths) or self.segments or \
            self.shared_prefix


@dataclasses.dataclass(frozen=True)
class Choice:
    impl: str  # "dense" | "chunked" | "cudnn" | "cudnn_xla" | "splash"
    reason: str


def legacy_rule(T: int, S: int) -> str:
    """``auto`` on CPU (and every fallback): chunked when T * S > 1024^2, else dense."""
    return "chunked" if T * S > AUTO_CHUNKED_MIN_SCORES else "dense"


def _legacy(call: AttentionCall, why: str) -> Choice:
    impl = legacy_rule(call.T, call.S)
    size = f"T*S = {call.T * call.S} {'>' if impl == 'chunked' else '<='} 1024^2"
    return Choice(impl, f"{why}: {impl} ({size})")


def cudnn_max_head_dim(compute_capability: str | None) -> int:
    """cuDNN flash attention's largest head dim: 256 from Hopper (9.0) on, else 128 (JAX's
    ``check_is_flash_attention``)."""
    if compute_capability is None:
        return 128
    major = int(str(compute_capability).split(".")[0])
    return 256 if major >= 9 else 128


def cudnn_refusal(call: AttentionCall) -> str | None:
    """Why cuDNN flash attention cannot run this call (None: it can)."""
    if call.backend not in GPU_BACKENDS or call.gpu_compute_capability is None:
        return f"cuDNN needs a CUDA GPU (backend {call.backend!r})"
    if call.dtype not in CUDNN_DTYPES:
        return f"cuDNN flash attention takes bf16/fp16, the compute dtype is {call.dtype}"
    hmax = cudnn_max_head_dim(call.gpu_compute_capability)
    if call.head_dim % 8 or call.head_dim > hmax:
        return (f"cuDNN flash attention needs head_dim a multiple of 8 and <= {hmax} "
                f"(compute capability {call.gpu_compute_capability}), got {call.head_dim}")
    return _mask_refusal(call)


def _mask_refusal(call: AttentionCall) -> str | None:
    if call.needs_mask and (call.T % 2 or call.S % 2):
        return (f"cuDNN's backward with a mask (bias) needs even lengths, got T={call.T} "
                f"S={call.S}")
    return None


def splash_refusal(call: AttentionCall) -> str | None:
    """Why the Splash kernel cannot express this call (None: it can)."""
    if call.shared_prefix:
        return ("Splash segment ids express 'same segment' only; the shared-prefix layout "
                "(segment 0 seen by every segment) needs a per-row mask")
    if call.T != call.S:
        return f"Splash here runs self-attention without a cache (T={call.T} != S={call.S})"
    return None


def select(requested: str, call: AttentionCall) -> Choice:
    """The implementation ``requested`` (``ModelConfig.attention_impl``) means for ``call``,
    and why. Raises ``ConfigError`` for an unknown name or an explicit fused implementation
    that cannot express the call."""
    if requested not in ATTENTION_IMPLS:
        raise ConfigError(f"attention_impl={requested!r} is not one of {ATTENTION_IMPLS}")
    if requested in ("dense", "chunked"):
        return Choice(requested, "requested")
    if call.has_cache:
        return _legacy(call, f"attention_impl={requested}, KV cache (queries start at a "
                             "traced slot; fused kernels run cache-free passes only)")
    if requested == "auto":
        return _auto(call)
    if requested == "cudnn":
        why = cudnn_refusal(call)
        if why:
            raise ConfigError(f"attention_impl='cudnn': {why}; use 'auto' (falls back) or "
                              "'cudnn_xla' (the same call on XLA)")
        return Choice("cudnn", "requested")
    if requested == "cudnn_xla":
        return Choice("cudnn_xla", "requested")
    why = splash_refusal(call)
    if why:
        raise ConfigError(f"attention_impl='splash': {why}; use 'auto' (falls back)")
    return Choice("splash", "requested" if call.backend == "tpu"
                  else "requested; off TPU it runs in Pallas interpret mode (slow)")


def _auto(call: AttentionCall) -> Choice:
    if call.backend in GPU_BACKENDS:
        kernel, refusal = "cudnn", cudnn_refusal(call)
    elif call.backend == "tpu":
        kernel, refusal = "splash", splash_refusal(call)
    else:
        return _legacy(call, f"auto on {call.backend}")
    if call.T < FUSED_MIN_QUERIES:
        return _legacy(call, f"auto on {call.backend}, T={call.T} < {FUSED_MIN_QUERIES} "
                             "queries")
    if refusal:
        return _legacy(call, f"auto on {call.backend}, not {kernel}: {refusal}")
    what = ["causal"]
    if call.key_padding:
        what.append("key padding")
    if call.shared_prefix:
        what.append("shared-prefix segments")
    elif call.segments:
        what.append("packed segments")
    via = ""
    if kernel == "cudnn" and call.needs_mask:
        via = " (mask as a [B, 1, T, S] bias)"
    elif kernel == "cudnn" and call.seq_lengths:
        via = " (padding as sequence lengths: no mask, no bias)"
    return Choice(kernel, f"auto on {call.backend}: {kernel} fused attention, "
                          f"{', '.join(what)}{via}")
