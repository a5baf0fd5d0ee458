"""Block-causal (document) attention (models/common/documents.py): each packed document's logits equal its logits
alone, in every family; the kernels agree with each other and with FlexAttention's forward; the errors."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.common.documents import block_causal_attention, block_causal_mask, document_ids, masked_attention
from models.deepseek_v3 import DeepSeekV3ModelArgs
from models.deepseek_v3.model import DeepSeekV3Model
from models.llama3 import Transformer, TransformerModelArgs
from models.qwen3 import Qwen3ModelArgs
from models.qwen3.model import Qwen3Model

EOS = 1


def test_an_eos_ends_the_document_it_belongs_to() -> None:
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8], [5, 6, 7, 8, 9, 10]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]  # no EOS: one document


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "llama3": Transformer(TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                                                   max_seq_len=64, attn_mask_type="block_causal", eos_id=EOS)),
        "qwen3": Qwen3Model(Qwen3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=96,
                                           hidden_dim=128, max_seq_len=64, attn_mask_type="block_causal", eos_id=EOS)),
        "deepseek_v3": DeepSeekV3Model(DeepSeekV3ModelArgs(
            vocab_size=96, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_dense_layers=2, n_heads=4,
            q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_seq_len=64,
            attn_mask_type="block_causal", eos_id=EOS)),
    }  # fmt: skip


@pytest.mark.parametrize("family", ["llama3", "qwen3", "deepseek_v3"])
def test_each_packed_document_has_the_logits_it_has_alone(family: str) -> None:
    """[doc A, EOS, doc B, EOS, start of C]: A and B at their offsets give their logits alone (RoPE is relative);
    causal attention over the same row does not."""
    model = _models()[family]
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(2, 96, (1, n), generator=g) for n in (9, 13, 5))
    eos = torch.tensor([[EOS]])
    row = torch.cat([a, eos, b, eos, c], dim=1)
    with torch.no_grad():
        packed = model(row)
        alone_a, alone_b = model(torch.cat([a, eos], dim=1)), model(torch.cat([b, eos], dim=1))
        model.model_args.attn_mask_type = "causal"
        causal = model(row)
    torch.testing.assert_close(packed[:, :10], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 10:24], alone_b, rtol=1e-5, atol=1e-5)
    assert (causal[:, 10:24] - alone_b).abs().max() > 1e-2  # causal: B sees A
    torch.testing.assert_close(causal[:, :10], packed[:, :10])  # the first document is the same either way


def test_block_causal_and_causal_losses_differ_on_the_same_batch() -> None:
    model = _models()["llama3"]
    tokens = torch.randint(2, 96, (2, 33), generator=torch.Generator().manual_seed(2))
    tokens[:, [7, 20]] = EOS
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses = {}
    for mask in ("block_causal", "causal"):
        model.model_args.attn_mask_type = mask
        losses[mask] = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(0, 1)).item()
    # an initialized model's logits are nearly uniform: the masks move its loss by ~1e-4, rounding by ~1e-7
    assert abs(losses["block_causal"] - losses["causal"]) > 1e-5, losses


def _qkv(heads: int, kv_heads: int, v_dim: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    shapes = ((2, heads, 40, 16), (2, kv_heads, 40, 16), (2, kv_heads, 40, v_dim))
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("heads, kv_heads, v_dim", [(4, 4, 16), (4, 2, 16), (4, 4, 8)])
def test_the_per_document_kernel_equals_the_masked_one_forward_and_backward(heads: int, kv_heads: int,
                                                                             v_dim: int) -> None:  # fmt: skip
    tokens = torch.randint(2, 96, (2, 40), generator=torch.Generator().manual_seed(4))
    tokens[0, [3, 17, 18, 39]] = EOS  # an EOS at the end, two in a row (a one-token document)
    documents = document_ids(tokens, EOS)
    results = []
    for kernel in ("segments", "mask"):
        q, k, v = _qkv(heads, kv_heads, v_dim)
        if kernel == "segments":
            out = block_causal_attention(q, k, v, documents, causal=_causal)
        else:
            out = masked_attention(q, k, v, block_causal_mask(documents))
        out.sum().backward()
        results.append([out, q.grad, k.grad, v.grad])
    for seg, masked in zip(*results):
        torch.testing.assert_close(seg, masked, rtol=1e-12, atol=1e-12)


def test_flex_attention_s_forward_equals_the_per_document_kernel() -> None:
    """FlexAttention's mask function, checked on the CPU where torch runs its forward (its backward: CUDA only)."""
    from models.common.documents import _flex_attention

    tokens = torch.randint(2, 96, (2, 40), generator=torch.Generator().manual_seed(5))
    tokens[1, [9, 25]] = EOS
    documents = document_ids(tokens, EOS)
    q, k, v = (t.detach().float() for t in _qkv(4, 2))
    with torch.no_grad():
        flex = _flex_attention(q, k, v, documents, compiled=False)
        segments = block_causal_attention(q, k, v, documents, causal=_causal)
    torch.testing.assert_close(flex, segments, rtol=1e-5, atol=1e-5)


def test_block_causal_without_an_eos_or_with_an_unknown_mask_is_an_error_naming_the_fix() -> None:
    args = TransformerModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=96, max_seq_len=16,
                                attn_mask_type="block_causal")  # fmt: skip
    with pytest.raises(ValueError, match=r"call model\(tokens, eos_id=\.\.\.\) with the tokenizer's EOS id"):
        Transformer(args)(torch.zeros(1, 8, dtype=torch.long))
    assert Transformer(args)(torch.zeros(1, 8, dtype=torch.long), eos_id=EOS).shape == (1, 8, 96)
    with pytest.raises(ValueError, match=r"attn_mask_type='document': expected one of \('causal', 'block_causal'\)"):
        dataclasses.replace(args, attn_mask_type="document")


def test_compiled_block_causal_blocks_equal_eager() -> None:
    """While compiled, the masked SDPA runs (traceable); its loss and gradients equal the per-document kernel's."""
    from models.llama3.parallelize import apply_compile

    eager = _models()["llama3"]
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, "aot_eager")
    tokens = torch.randint(2, 96, (2, 33), generator=torch.Generator().manual_seed(6))
    tokens[:, [5, 19]] = EOS
    results = []
    for model in (eager, compiled):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(0, 1))
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# the trainer with Llama 3's debugmodel_flex_attn flavor (block-causal; FlexAttention runs on CUDA only, so the
# per-document SDPA here)
_FLEX_JOB = ["--model.flavor", "debugmodel_flex_attn", "--training.seq_len", "128"]
_SAME_BATCH = ["--training.global_batch_size", "4", "--training.local_batch_size", "2"]  # on 1 rank: accumulated
_LAYOUTS = {
    "fsdp2": (2, []),
    "tp2_async": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                      "--parallelism.enable_async_tensor_parallel"]),
    # the ids of the whole rows, gathered from the cp shares of the tokens; ring attention skips unshared blocks
    "cp2_allgather": (2, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                          "1"]),
    "cp2_alltoall": (2, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                         "1", "--parallelism.context_parallel_rotate_method", "alltoall"]),
    # every stage's forward gets each microbatch's document ids (the later stages see hidden states)
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--parallelism.pipeline_parallel_microbatch_size", "1"]),
}  # fmt: skip


def test_block_causal_training_follows_one_process_under_fsdp_async_tp_cp_and_pp(tmp_path: Path) -> None:
    from tests.trainer.test_train import _SHORT_DEBUG_JOB, _losses, _train_rank
    from tests.world import run_world

    argv = [*_SHORT_DEBUG_JOB, *_FLEX_JOB, *_SAME_BATCH]
    one = _losses(run_world(_train_rank, 1, [*argv, "--job.dump_folder", str(tmp_path / "one")])[0])
    assert len(one) == 3, one
    for name, (world, flags) in _LAYOUTS.items():
        other = _losses(run_world(_train_rank, world, [*argv, *flags, "--job.dump_folder", str(tmp_path / name)])[0])
        assert other == pytest.approx(one, abs=2e-4), (name, one, other)  # logged to 4 decimals


def test_the_dry_run_prices_a_block_causal_flavor_as_causal() -> None:
    """Fake tokens hold no documents: the dry run traces causal attention, whose FLOPs bound block-causal's."""
    from tests.trainer.test_estimate import estimate_json

    flavors = ("debugmodel_flex_attn", "debugmodel")
    flex, causal = (estimate_json("debug_model", 1, "--model.flavor", flavor) for flavor in flavors)
    assert flex["ranks"][0]["executed_flops_per_step"] == causal["ranks"][0]["executed_flops_per_step"] > 0
