"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV pool.

The batch is flattened (DESIGN §5.1, ``kvtier.engine.attention.base``): T new tokens of B
sequences, each with its position, go through every layer together; each layer writes its
new K/V into the pool through the backend and then attends over the sequence's pages.
Nothing here loops over tokens or sequences — that is the backend's business.

Module and parameter names mirror Hugging Face's ``*ForCausalLM`` exactly
(``model.layers.0.self_attn.q_proj.weight``, ...), so ``state_dict()`` *is* the checkpoint
layout: the loader checks a checkpoint against it and ``write_random_checkpoint`` writes it.
The numerics (RMSNorm in fp32, RoPE tables in fp32 then cast, llama3 frequency smoothing)
follow transformers line for line, so fp32 logits match it to ~1e-5.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.domain.errors import InvalidArgument
from kvtier.engine.attention.base import AttentionBackend, AttentionMetadata, KvLayer
from kvtier.engine.attention.fp8 import Fp8Pages
from kvtier.engine.model.config import SUPPORTED_ROPE_TYPES, ModelConfig, RopeConfig

# The cos/sin table grows in powers of two from here, capped at max_position_embeddings.
_MIN_ROPE_TABLE_LEN = 256


def _base_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    # Explicit CPU device: the loader builds the model under torch.device("meta").
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (rope.theta**exponents)


def _linear_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    return _base_inv_freq(rope, head_dim) / rope.factor


def _llama3_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Llama 3.1 frequency scaling, as transformers' ``_compute_llama3_parameters``.

    wavelength < old_ctx / high_freq_factor   keep
    wavelength > old_ctx / low_freq_factor    divide by factor
    in between                                interpolate smoothly between the two
    """
    inv_freq = _base_inv_freq(rope, head_dim)
    old_context_len = rope.original_max_position_embeddings
    assert old_context_len is not None, "llama3 rope parsed without original_max_position_embeddings"
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / rope.factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


ROPE_INV_FREQ: dict[str, Callable[[RopeConfig, int], torch.Tensor]] = {
    "default": _base_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}
# config.py decides which rope types parse; every one of them must be computable here.
assert set(ROPE_INV_FREQ) == set(SUPPORTED_ROPE_TYPES), "rope types in config.py and llama.py disagree"


class RotaryEmbedding:
    """cos/sin tables indexed by absolute position, built on demand on the pool's device.

    The table is fp32 (as transformers computes it) and grows to the next power of two
    above the longest context seen, never past ``max_positions``.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        self.inv_freq = ROPE_INV_FREQ[rope.rope_type](rope, head_dim)
        self.max_positions = max_positions
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def cos_sin(
        self, positions: torch.Tensor, num_positions: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for ``positions`` (all < ``num_positions``), each ``[T, head_dim]`` in ``dtype``."""
        if self._cos is None or self._cos.shape[0] < num_positions or self._cos.device != positions.device:
            self._build(max(num_positions, 1), positions.device)
        assert self._cos is not None and self._sin is not None
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)

    def _build(self, num_positions: int, device: torch.device) -> None:
        length = min(max(_MIN_ROPE_TABLE_LEN, 1 << (num_positions - 1).bit_length()), self.max_positions)
        # Normal (not inference) tensors, so a table built under inference_mode stays usable outside it.
        with torch.inference_mode(False):
            pos = torch.arange(length, dtype=torch.int64, device=device).float()
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[T, heads, head_dim]``; ``cos``/``sin`` are ``[T, head_dim]``."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, cast back, then scale: the order transformers uses (matters in bf16).
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, q_dim, kv_dim = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=config.o_bias)
        # Qwen3 normalises each head of q and k before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: KvLayer,
        md: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        backend.write_kv(kv_layer, k, v, md)
        out = backend.forward(q, kv_layer, md, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: KvLayer,
        md: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_layer, md, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """Embeddings, layers and final norm: HF's ``model.*`` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """A causal LM whose attention reads and writes a paged KV pool.

    Call under ``torch.inference_mode()``. ``pool`` is
    ``[num_pages, num_layers, 2, page_size, kv_heads, head_dim]`` (see ``kv_geometry``) in
    any float dtype; each layer writes the K/V of the T new tokens at ``md.slot_mapping``
    before attending, so the pages of ``md.block_tables`` must already hold every cached
    position of each sequence.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        # Tied checkpoints reuse the embedding matrix and carry no lm_head of their own.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)

    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """``(num_layers, kv_heads, head_dim)``: what a KV pool for this model must be shaped by."""
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pool: torch.Tensor | Fp8Pages,
        md: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden_size]`` (after the final norm) for the T new tokens."""
        self._check_inputs(input_ids, positions, pool, md)
        cos, sin = self.rotary.cos_sin(positions, max(md.context_lens_list), self.dtype)
        h = self.model.embed_tokens(input_ids)
        for index, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, pool[:, index], md, backend)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[T, vocab_size]``."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def _check_inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor | Fp8Pages, md: AttentionMetadata
    ) -> None:
        # Host-side shape checks only: nothing here may sync with the device.
        num_tokens = md.num_tokens
        if input_ids.shape != (num_tokens,):
            raise InvalidArgument(
                f"input_ids has shape {tuple(input_ids.shape)}, metadata has {num_tokens} tokens",
                field="input_ids",
            )
        if positions.shape != (num_tokens,):
            raise InvalidArgument(
                f"positions has shape {tuple(positions.shape)}, metadata has {num_tokens} tokens",
                field="positions",
            )
        num_layers, kv_heads, head_dim = self.kv_geometry
        expected = (num_layers, 2, md.page_size, kv_heads, head_dim)
        if pool.dim() != 6 or tuple(pool.shape[1:]) != expected:
            raise InvalidArgument(
                f"pool has shape {tuple(pool.shape)}; expected [num_pages, {', '.join(map(str, expected))}]",
                field="pool",
            )
        longest = max(md.context_lens_list)
        if longest > self.config.max_context_len:
            raise InvalidArgument(
                f"a sequence reaches {longest} tokens; this model is exact up to {self.config.max_context_len}",
                field="context_lens",
            )
