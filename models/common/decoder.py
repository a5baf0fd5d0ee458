"""The frame every decoder-only family shares: tokens -> embedding -> blocks -> norm -> output (imports only torch).

A family subclasses `Decoder`, builds its blocks and says how its rotary table is computed; the frame does the
rest the same way for all of them:
- module names `tok_embeddings`, `layers.N` (a ModuleDict keyed "0".."n-1", so FQNs survive removing blocks),
  `norm`, `output`: the TP plans', the pipeline split's, the checkpoint's and the HF adapters' keys;
- the rotary table as the non-persistent buffer `freqs_cis` (derived from the args; never saved);
- tied embeddings (`args.tie_word_embeddings`): the output projection uses the embedding's weight;
- a pipeline part (models/common/pipeline_split.py) lacks some modules; their meta stand-ins run their fills
  (writing nothing), so every part draws the random stream exactly as the whole model does.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import nn

from .documents import document_ids
from .feed_forward import FeedForward
from .moe import MoE
from .rms_norm import RMSNorm


class DecoderArgs(Protocol):
    """What the frame reads of a family's args."""

    dim: int
    n_layers: int
    vocab_size: int
    norm_eps: float

    @property
    def tie_word_embeddings(self) -> bool: ...


class Block(Protocol):
    """A residual block: (B, T, D) hidden states and the rotary table -> (B, T, D)."""

    def __call__(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor: ...
    def init_weights(self, buffer_device: torch.device | None = None) -> None: ...


class PreNormBlock(nn.Module):
    """A pre-norm block: h = x + attention(norm(x)), then h + ffn(norm(h)), where the FFN is a dense SwiGLU
    (`feed_forward`) or a mixture of experts (`moe`, with `moe_enabled`). Qwen3 and DeepSeek-V3 blocks are this
    with their attention; `weight_init_std` scales the residual branches' output projections (torchtitan's)."""

    def __init__(
        self, attention: nn.Module, ffn: FeedForward | MoE, dim: int, norm_eps: float, init_std: float
    ) -> None:
        super().__init__()
        self.attention = attention
        self.moe_enabled = isinstance(ffn, MoE)
        self.moe: MoE | None = ffn if isinstance(ffn, MoE) else None
        self.feed_forward: FeedForward | None = ffn if isinstance(ffn, FeedForward) else None
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.weight_init_std = init_std

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """torchtitan's: norms to ones, then attention and the FFN (or the MoE and its buffers) at this depth's std."""
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)  # type: ignore[operator]
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        if self.feed_forward is not None:
            self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, documents=documents)
        ffn = self.moe if self.moe is not None else self.feed_forward
        assert ffn is not None  # exactly one of them is built
        return h + ffn(self.ffn_norm(h))


def depth_init_std(layer_id: int, n_layers: int, depth_init: bool = True) -> float:
    """The std of a block's residual-branch output projections, scaled down with depth (GPT-2 / torchtitan's
    depth_init: by the block's depth, else by the number of blocks)."""
    return 0.02 / (2 * (layer_id + 1 if depth_init else n_layers)) ** 0.5


class Decoder(nn.Module):
    """A decoder-only language model: tokens (B, T) -> logits (B, T, vocab_size)."""

    freqs_cis: torch.Tensor

    def __init__(self, args: Any, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.model_args = args
        frame = cast(DecoderArgs, args)
        self.tok_embeddings = nn.Embedding(frame.vocab_size, frame.dim)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(frame.dim, eps=frame.norm_eps)
        self.output = nn.Linear(frame.dim, frame.vocab_size, bias=False)  # tied by init_weights when args say so
        self.register_buffer("freqs_cis", self.rotary_table(), persistent=False)
        self.init_weights()

    def document_ids(self, tokens: torch.Tensor, eos_id: int | None) -> torch.Tensor:
        """(B, T) document ids of `tokens`, each document ending at `eos_id` (default: the args')."""
        eos_id = getattr(self.model_args, "eos_id", None) if eos_id is None else eos_id
        if eos_id is None:
            raise ValueError(
                "attn_mask_type='block_causal' needs the end-of-document token: call model(tokens, eos_id=...) with "
                "the tokenizer's EOS id, or set the model args' eos_id"
            )
        if tokens.is_floating_point():
            raise ValueError(
                "attn_mask_type='block_causal': this pipeline stage gets hidden states, not tokens; pass "
                "documents=document_ids(tokens, eos_id) (models/common/documents.py) from the first stage's tokens"
            )
        return document_ids(tokens, eos_id)

    def rotary_table(self) -> torch.Tensor:
        """The family's RoPE rotations e^{i m f_j}, (max_seq_len, rotary_dim / 2) complex64."""
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Make the output projection use the embedding's weight (again, after a parallelization that
        distributed them one by one: both are (vocab, dim), split on vocab under TP)."""
        if self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialize every parameter and buffer, e.g. after building the model on meta (torchtitan's
        scheme: embedding N(0, 1), blocks their own, output N(0, dim^-1/2) cut at 3 std)."""
        args = cast(DecoderArgs, self.model_args)
        if args.tie_word_embeddings:  # to_empty gives plain tied parameters one copy per module
            self.tie_weights()
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = self.rotary_table()
        absent = self.__dict__.get("pipeline_absent", {})
        embedding = self.tok_embeddings or absent["tok_embeddings"]
        if not args.tie_word_embeddings:  # tied: the output's init below (N(0, 1) logits would be huge)
            nn.init.normal_(cast(torch.Tensor, embedding.weight))
        for i in range(args.n_layers):
            layer = self.layers[str(i)] if str(i) in self.layers else absent[f"layers.{i}"]
            layer.init_weights(buffer_device)  # type: ignore[operator]
        if self.norm is not None:
            self.norm.reset_parameters()
        # tied: the output's init fills the embedding (a first pipeline stage holds only the embedding)
        output = self.output or (self.tok_embeddings if args.tie_word_embeddings else None) or absent["output"]
        std = args.dim**-0.5
        cutoff = 3.0
        nn.init.trunc_normal_(cast(torch.Tensor, output.weight), mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)

    def forward(
        self, tokens: torch.Tensor, *, eos_id: int | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (B, T, V) of tokens (B, T); a pipeline part without the embedding takes the previous
        stage's hidden states (B, T, D) instead, and one without the output returns its own.

        With `attn_mask_type = "block_causal"` attention stays inside documents (models/common/documents.py): their
        ids are `documents` (B, T), or are read from the tokens, each ending at `eos_id` (default: the args')."""
        if documents is None and getattr(self.model_args, "attn_mask_type", "causal") == "block_causal":
            documents = self.document_ids(tokens, eos_id)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, D)  S(1) under SP
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis) if documents is None else layer(h, self.freqs_cis, documents)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h  # (B, T, V)   S(-1) under loss parallelism
