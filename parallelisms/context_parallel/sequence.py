"""How a sequence is split over the cp ranks (pure math; nothing here touches a process group).

Under causal attention, query t attends to keys 0..t, so the contiguous split (rank i holds chunk i of cp)
gives the last rank cp times the first one's work. The head-tail split cuts the sequence into 2*cp chunks
and gives rank i chunks i and 2*cp-1-i: an early and a late chunk, the same work on every rank. The
attention itself is order-free, so only RoPE needs to know each token's global position (`positions`).

The trainer shards every batch once, through `SequenceSharding.shard`; the loss is a sum over tokens and
does not care about their order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallelisms.dtensor.device_mesh import DeviceMesh


def chunks_of_rank(rank: int, cp: int, load_balance: bool) -> tuple[int, ...]:
    """The chunks rank `rank` holds, in order: (rank, 2cp-1-rank) of 2*cp chunks, or (rank,) of cp."""
    return (rank, 2 * cp - 1 - rank) if load_balance else (rank,)


def num_chunks(cp: int, load_balance: bool) -> int:
    return 2 * cp if load_balance else cp


def rank_positions(seq_len: int, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """Global positions (int64, ascending) of the seq_len / cp tokens rank `rank` holds."""
    n = num_chunks(cp, load_balance)
    if seq_len % n:
        raise ValueError(
            f"a sequence of {seq_len} tokens cannot be split into {n} equal chunks (context parallel degree "
            f"{cp}{', load-balanced: 2 chunks per rank' if load_balance else ''}); make the sequence length "
            f"divisible by {n}"
        )
    c = seq_len // n
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in chunks_of_rank(rank, cp, load_balance)])


def permutation(seq_len: int, cp: int, load_balance: bool) -> torch.Tensor:
    """The global positions of rank 0's tokens, then rank 1's, ...: sharding is `x[perm]` cut in cp pieces."""
    return torch.cat([rank_positions(seq_len, cp, r, load_balance) for r in range(cp)])


def inverse_permutation(seq_len: int, cp: int, load_balance: bool) -> torch.Tensor:
    """Undoes `permutation`: the rank-ordered concatenation of shards, indexed by it, is the sequence."""
    return torch.argsort(permutation(seq_len, cp, load_balance))


def causal_pairs(seq_len: int, cp: int, rank: int, load_balance: bool) -> int:
    """Query-key pairs rank `rank` computes under causal attention: sum over its queries of (position + 1)."""
    return int((rank_positions(seq_len, cp, rank, load_balance) + 1).sum())


@dataclass(frozen=True)
class SequenceSharding:
    """This rank's share of every sequence: `cp` ranks, this one `rank`, head-tail when `load_balance`."""

    cp: int
    rank: int
    load_balance: bool = True
    _positions: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, cp_mesh: DeviceMesh) -> SequenceSharding:
        """The sharding of this rank on `cp_mesh` (1-D), load-balanced: meshtrain's attention is causal."""
        return cls(cp_mesh.size(), cp_mesh.get_local_rank())

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x` along `dim` (the sequence dim: 1 for (B, T) inputs and labels)."""
        index = rank_positions(x.shape[dim], self.cp, self.rank, self.load_balance)
        return x.index_select(dim, index.to(x.device))

    def unshard(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The sequence from every rank's shard (rank order), e.g. after an all-gather: `shard`'s inverse."""
        whole = torch.cat(shards, dim=dim)
        inverse = inverse_permutation(whole.shape[dim], self.cp, self.load_balance).to(whole.device)
        return whole.index_select(dim, inverse)

    def positions(self, local_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of this rank's `local_len` tokens (of a sequence of local_len * cp); cached, except
        while torch.compile traces (the graph computes them; a cache write inside a checkpointed region is a
        side effect it refuses)."""
        device = device or torch.device("cpu")
        key = (local_len, device)
        if torch.compiler.is_compiling() and key not in self._positions:
            return rank_positions(local_len * self.cp, self.cp, self.rank, self.load_balance).to(device)
        if key not in self._positions:
            self._positions[key] = rank_positions(local_len * self.cp, self.cp, self.rank, self.load_balance).to(device)
        return self._positions[key]
