"""`python -m checkpoint.convert`: to-hf / from-hf round trips (one process and FSDP(2)-saved,
bitwise), logits of Hugging Face's LlamaForCausalLM on our export (plain and Llama 3.1 rope
scaling), tied embeddings, shard sizes, refusals, and `inspect` catching truncated and flipped files."""

from __future__ import annotations

import dataclasses
import json
import math
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoint
from checkpoint import convert, hf_conversion
from checkpoint.stateful import ModelState
from models.llama3 import RoPEScalingArgs, Transformer, TransformerModelArgs, llama3_configs, parameter_shapes
from models.llama3 import hf_adapter as hf
from tests.world import run_world

# vocab 97: FSDP(2)'s dim-0 shards of the embedding and output are uneven
ARGS = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=32)
# original context 16 < 32 positions: most frequencies of head_dim 16 are scaled or interpolated
SCALED = dataclasses.replace(
    ARGS, rope_scaling=RoPEScalingArgs(scaling_factor=8, low_freq_factor=1, high_freq_factor=4,
                                       original_max_position_embeddings=16),
)  # fmt: skip


def _model(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    """A model whose every parameter is distinct (norm weights too, which init to ones)."""
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _random_state(args: TransformerModelArgs) -> dict[str, torch.Tensor]:
    """Random weights of `Transformer(args)`'s shapes (cheaper than building a flavor-sized model)."""
    g = torch.Generator().manual_seed(5)
    return {k: torch.randn(shape, generator=g) for k, shape in parameter_shapes(args).items()}


def _metadata(args: TransformerModelArgs) -> dict:
    return {"job_config": {"model": {"name": "llama3", "flavor": "custom"}}, "model_args": hf.model_args_to_json(args)}


def _save_ours(model: Transformer | dict[str, torch.Tensor], directory: Path, **metadata) -> Path:
    """As the trainer saves: the model's FQNs under "model", next to other state."""
    if isinstance(model, Transformer):
        metadata = metadata or _metadata(model.model_args)
        model = model.state_dict()
    return checkpoint.save({"model": model, "train_state": {"step": 3}}, directory, metadata=metadata)


def _saved_model(directory: Path) -> dict[str, torch.Tensor]:
    index = checkpoint.read_index(directory)
    keys = [k for k in index.tensors if k.startswith("model.")]
    return {k.removeprefix("model."): checkpoint.read_tensor(directory, k, index=index) for k in keys}


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"differ: {bad}"


def _run(*argv: str | Path) -> int:
    return convert.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Transformer, Path, Path]:
    """(model, our checkpoint, its HF export)."""
    root = tmp_path_factory.mktemp("convert")
    model = _model(ARGS)
    ours = _save_ours(model, root / "step-3")
    assert _run("to-hf", ours, root / "hf") == 0
    return model, ours, root / "hf"


# ------------------------------------------------------------------------------- layout
def test_to_hf_writes_the_hf_llama_layout(exported) -> None:
    model, _, out = exported
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
    ]  # fmt: skip
    index = json.loads((out / "model.safetensors.index.json").read_text())
    names = {hf.to_hf_name(k) for k in model.state_dict()}
    assert set(index["weight_map"]) == names
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    with safe_open(out / "model-00001-of-00001.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == names
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 176, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["vocab_size"], config["max_position_embeddings"], config["torch_dtype"]) == (97, 32, "float32")
    assert config["tie_word_embeddings"] is False and config["rope_scaling"] is None


def test_to_hf_permutes_only_q_and_k_rows(exported) -> None:
    model, _, out = exported
    sd = model.state_dict()
    with safe_open(out / "model-00001-of-00001.safetensors", framework="pt") as f:
        q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
        v = f.get_tensor("model.layers.1.self_attn.v_proj.weight")
    assert torch.equal(q, hf.permute_to_hf(sd["layers.1.attention.wq.weight"], 4))
    assert torch.equal(k, hf.permute_to_hf(sd["layers.1.attention.wk.weight"], 2))  # n_kv_heads, not n_heads
    assert not torch.equal(k, sd["layers.1.attention.wk.weight"])
    assert torch.equal(v, sd["layers.1.attention.wv.weight"])


# ---------------------------------------------------------------------------- round trips
def test_ours_to_hf_to_ours_is_bitwise(exported, tmp_path) -> None:
    model, _, out = exported
    back = tmp_path / "back"
    assert _run("from-hf", out, back) == 0
    _assert_bitwise(_saved_model(back), model.state_dict())
    index = checkpoint.read_index(back)
    assert set(index.tensors) == {f"model.{k}" for k in model.state_dict()} and not index.values  # model only
    assert index.metadata["job_config"]["model"] == {"name": "llama3", "flavor": "custom"}
    assert hf.model_args_from_json(index.metadata["model_args"]) == ARGS
    fresh = Transformer(ARGS)  # the trainer's initial load: model keys only
    checkpoint.load({"model": fresh.state_dict()}, back)
    _assert_bitwise(fresh.state_dict(), model.state_dict())


def _fsdp_model(seed: int) -> Transformer:
    """ARGS's model sharded with fully_shard on every block and the root over 2 ranks."""
    from parallelisms.fsdp import fully_shard
    from tests.dtensor.harness import get_mesh

    mesh = get_mesh((2,), ("dp_shard",))
    model = _model(ARGS, seed)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _save_fsdp(directory: str) -> list[str]:
    """Rank function: the FSDP(2) model saved as the trainer saves it; its state dict's keys."""
    state = _fsdp_model(seed=0).state_dict()
    checkpoint.save({"model": state}, directory, metadata=_metadata(ARGS))
    return sorted(state)


def _load_fsdp(directory: str) -> list[str]:
    """Rank function: a from-hf checkpoint as the trainer's initial load into FSDP(2) (another
    seed's weights first); the keys that then differ from the seed-0 model."""
    model = _fsdp_model(seed=9)
    checkpoint.load({"model": model.state_dict()}, directory)
    want = _model(ARGS, seed=0).state_dict()
    return [k for k, v in model.state_dict().items() if not torch.equal(v.full_tensor(), want[k])]


def test_fsdp_saved_checkpoint_round_trips_bitwise(tmp_path) -> None:
    saved = tmp_path / "step-1"
    keys = run_world(_save_fsdp, 2, str(saved))
    reference = _model(ARGS).state_dict()
    assert keys == [sorted(reference)] * 2  # plain FQNs under FSDP
    index = checkpoint.read_index(saved)
    assert index.world_size == 2 and len(index.tensors["model.tok_embeddings.weight"].chunks) == 2
    assert _run("to-hf", saved, tmp_path / "hf") == 0
    assert _run("from-hf", tmp_path / "hf", tmp_path / "back") == 0
    _assert_bitwise(_saved_model(tmp_path / "back"), reference)
    assert run_world(_load_fsdp, 2, str(tmp_path / "back")) == [[], []]


def test_to_hf_shards_by_size_and_casts(exported, tmp_path) -> None:
    model, ours, _ = exported
    out = tmp_path / "hf"
    assert _run("to-hf", ours, out, "--dtype", "bfloat16", "--max-shard-size", "30KB") == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    largest = max(p.numel() * 2 for p in model.parameters())
    assert all((out / f).stat().st_size <= max(30_000, largest) + 4096 for f in files)  # + header
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert _run("from-hf", out, tmp_path / "back") == 0
    want = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    _assert_bitwise(_saved_model(tmp_path / "back"), want)


def test_to_hf_without_model_args_uses_the_flavor_corrected_by_shapes(tmp_path) -> None:
    args = dataclasses.replace(llama3_configs["debugmodel"], n_layers=2, vocab_size=97, max_seq_len=64)
    weights = _random_state(args)
    job = {"model": {"name": "llama3", "flavor": "debugmodel"}, "training": {"seq_len": 64}}
    ours = _save_ours(weights, tmp_path / "step-1", job_config=job)
    assert _run("to-hf", ours, tmp_path / "hf") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"], config["max_position_embeddings"]) == (2, 97, 64)
    assert _run("from-hf", tmp_path / "hf", tmp_path / "back") == 0
    _assert_bitwise(_saved_model(tmp_path / "back"), weights)
    # the flavor matches up to vocab_size and max_seq_len, which the trainer sets
    assert checkpoint.read_index(tmp_path / "back").metadata["job_config"]["model"]["flavor"] == "custom"  # 2 layers


def test_from_hf_names_the_matching_flavor(tmp_path) -> None:
    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=97, max_seq_len=16)
    ours = _save_ours(_random_state(args), tmp_path / "step-1", **_metadata(args))
    assert _run("to-hf", ours, tmp_path / "hf") == 0
    assert _run("from-hf", tmp_path / "hf", tmp_path / "back") == 0
    assert checkpoint.read_index(tmp_path / "back").metadata["job_config"]["model"]["flavor"] == "debugmodel"


def _export_without_lm_head(source: Path, out: Path) -> dict[str, torch.Tensor]:
    """A copy of an HF export as a tied model: one model.safetensors without lm_head."""
    out.mkdir()
    with safe_open(source / "model-00001-of-00001.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "lm_head.weight"}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return tensors


def test_a_tied_hf_model_stays_tied_there_and_back(exported, tmp_path) -> None:
    model, _, out = exported
    _export_without_lm_head(out, tmp_path / "tied")
    assert _run("from-hf", tmp_path / "tied", tmp_path / "back") == 0
    got = _saved_model(tmp_path / "back")
    assert "output.weight" not in got  # the embedding once, as a tied Transformer's ModelState saves it
    assert torch.equal(got["tok_embeddings.weight"], model.state_dict()["tok_embeddings.weight"])
    args = hf.model_args_from_json(checkpoint.read_index(tmp_path / "back").metadata["model_args"])
    assert args.tie_word_embeddings
    tied = Transformer(args)
    checkpoint.load({"model": ModelState(tied).state_dict()}, tmp_path / "back")
    assert tied.output.weight is tied.tok_embeddings.weight
    assert torch.equal(tied.output.weight, model.state_dict()["tok_embeddings.weight"])
    assert _run("to-hf", tmp_path / "back", tmp_path / "hf-again") == 0
    config = json.loads((tmp_path / "hf-again" / "config.json").read_text())
    with safe_open(tmp_path / "hf-again" / "model-00001-of-00001.safetensors", framework="pt") as f:
        assert config["tie_word_embeddings"] is True and "lm_head.weight" not in f.keys()


# ------------------------------------------------------------------------------ refusals
def test_to_hf_refuses_a_non_empty_out_and_accepts_an_empty_one(exported, tmp_path, capsys) -> None:
    _, ours, _ = exported
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert _run("to-hf", ours, tmp_path / "full") == 1
    assert "not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    assert _run("to-hf", ours, tmp_path / "empty") == 0
    assert not list(tmp_path.glob("*.tmp-*"))


def test_to_hf_without_any_model_description_says_how_to_fix_it(tmp_path, capsys) -> None:
    ours = _save_ours(_model(ARGS), tmp_path / "step-1", note="no model args")
    assert _run("to-hf", ours, tmp_path / "hf") == 1
    assert "--flavor" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob("hf.tmp-*"))


def test_to_hf_takes_the_flavor_from_the_command_line_when_the_checkpoint_names_none(tmp_path) -> None:
    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=97)
    ours = _save_ours(_random_state(args), tmp_path / "step-1", note="no model args")
    assert _run("to-hf", ours, tmp_path / "hf", "--flavor", "debugmodel") == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 6


def test_to_hf_holds_one_shard_and_one_tensor(exported, tmp_path, monkeypatch) -> None:
    """Every tensor read or converted stays alive only while its shard is being filled."""
    _, ours, _ = exported
    alive: list[weakref.ref] = []
    peak = [0]

    def live_bytes() -> int:
        tensors = {id(t): t for r in alive if (t := r()) is not None}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def tracked(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            alive.append(weakref.ref(out))
            peak[0] = max(peak[0], live_bytes())
            return out

        return wrapper

    monkeypatch.setattr(hf_conversion, "read_tensor", tracked(hf_conversion.read_tensor))
    monkeypatch.setattr(hf, "to_hf_tensor", tracked(hf.to_hf_tensor))
    assert _run("to-hf", ours, tmp_path / "hf", "--max-shard-size", "30KB") == 0
    largest = 176 * 64 * 4  # w1 / w2 / w3 (fp32)
    total = sum(math.prod(t.shape) * 4 for t in checkpoint.read_index(ours).tensors.values())
    assert 0 < peak[0] <= 30_000 + 2 * largest < total / 2


def test_to_hf_refuses_model_args_that_do_not_fit_the_shapes(tmp_path, capsys) -> None:
    ours = _save_ours(_model(ARGS), tmp_path / "step-1", **_metadata(dataclasses.replace(ARGS, n_kv_heads=4)))
    assert _run("to-hf", ours, tmp_path / "hf") == 1
    err = capsys.readouterr().err
    assert "layers.0.attention.wk.weight: saved (32, 64), the model args give (64, 64)" in err


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"attention_bias": True}, "attention_bias=true"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"model_type": "mistral"}, "model_type is 'mistral'"),
        ({"head_dim": 32}, "head_dim=32"),
    ],
)
def test_from_hf_rejects_configs_our_model_cannot_express(exported, tmp_path, capsys, change, needle) -> None:
    _, _, out = exported
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in out.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    assert _run("from-hf", bad, tmp_path / "back") == 1
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "back").exists()


# ------------------------------------------------------------- an HF folder loaded by pipeline stages
def _load_hf_as_two_stages(hf_dir: str) -> dict[str, torch.Tensor] | str:
    """As pipeline stages hold the model, rank 0 the first half of its FQNs and rank 1 the rest, each loads its
    own from `hf_dir` (`checkpoint.initial_load_in_hf`); the error, where one is raised."""
    from checkpoint import hf_state

    fqns = list(parameter_shapes(ARGS).items())
    rank, half = torch.distributed.get_rank(), len(fqns) // 2
    model = {k: torch.zeros(shape) for k, shape in (fqns[:half] if rank == 0 else fqns[half:])}
    files = hf_state.check_hf_folder(Path(hf_dir), "checkpoint.initial_load_path")
    try:
        hf_state.load_hf_model(model, Path(hf_dir), files, ARGS, hf.LLAMA3_HF_ADAPTER)
    except checkpoint.CheckpointError as e:
        return str(e)
    return model


def _edit_hf(source: Path, out: Path, *, drop: str, add: str) -> Path:
    """A copy of the one-file HF folder `source` without tensor `drop`, with a tensor `add`."""
    out.mkdir()
    (out / "config.json").write_bytes((source / "config.json").read_bytes())
    (name,) = [p.name for p in source.glob("*.safetensors")]
    with safe_open(source / name, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != drop}
    save_file({**tensors, add: torch.zeros(2)}, out / name, metadata={"format": "pt"})
    index = json.loads((source / hf_conversion.HF_INDEX_FILE).read_text())
    index["weight_map"] = {k: name for k in [*tensors, add]}
    (out / hf_conversion.HF_INDEX_FILE).write_text(json.dumps(index))
    return out


def test_pipeline_stages_each_load_their_tensors_of_an_hf_folder_that_must_cover_the_model(exported, tmp_path) -> None:
    _, ours, hf_dir = exported
    stages = run_world(_load_hf_as_two_stages, 2, str(hf_dir))
    assert not isinstance(stages[0], str) and not isinstance(stages[1], str), stages
    assert stages[0].keys().isdisjoint(stages[1])
    _assert_bitwise({**stages[0], **stages[1]}, _saved_model(ours))
    # a tensor no stage takes, and one a stage misses: both refused, on both ranks alike
    bad = _edit_hf(hf_dir, tmp_path / "bad", drop="model.norm.weight", add="model.layers.7.mlp.gate_proj.weight")
    errors = run_world(_load_hf_as_two_stages, 2, str(bad))
    assert isinstance(errors[0], str) and errors[0] == errors[1], errors
    assert "(2 problems)" in errors[0] and "model.layers.7.mlp.gate_proj.weight: not a parameter" in errors[0]
    assert "model.norm.weight: missing (for norm.weight)" in errors[0]


# ------------------------------------------------------------------------------- inspect
def test_inspect_lists_the_checkpoint_and_exits_0(exported, capsys) -> None:
    _, ours, _ = exported
    assert _run("inspect", ours) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.attention.wq.weight" in out and "[64, 64]" in out
    assert '"flavor": "custom"' in out and "values: 1: train_state" in out
    assert out.strip().splitlines()[-1].startswith("OK:")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_inspect_fails_on_a_truncated_file_naming_it(exported, tmp_path, capsys) -> None:
    bad = _copy(exported[1], tmp_path / "bad")
    data = (bad / "rank-0.safetensors").read_bytes()
    (bad / "rank-0.safetensors").write_bytes(data[:-100])
    assert _run("inspect", bad) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FAILED") and "rank-0.safetensors" in last and "truncated" in last


def test_inspect_fails_on_a_flipped_bit_naming_the_file(exported, tmp_path, capsys) -> None:
    bad = _copy(exported[1], tmp_path / "bad")
    data = bytearray((bad / "rank-0.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x10
    (bad / "rank-0.safetensors").write_bytes(bytes(data))
    assert _run("inspect", bad) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "rank-0.safetensors" in last and "(block 0)" in last


def test_inspect_fails_on_a_missing_file_and_on_a_non_checkpoint(exported, tmp_path, capsys) -> None:
    bad = _copy(exported[1], tmp_path / "bad")
    (bad / "rank-0.safetensors").unlink()
    assert _run("inspect", bad) == 1
    assert "rank-0.safetensors: missing" in capsys.readouterr().out
    (bad / "index.json").write_text("{not json")
    assert _run("inspect", bad) == 1
    assert "not valid JSON" in capsys.readouterr().out


def test_inspect_says_what_a_folder_that_is_no_checkpoint_is_once(exported, tmp_path, capsys) -> None:
    """A missing path, the folder of step-N checkpoints, a Hugging Face folder: each named for what it is, not
    as an interrupted save, which a '.tmp-' or index-less step folder still is."""
    _, ours, hf_dir = exported
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    for name in ("step-4", "step-2", "step-10"):
        _copy(ours, folder / name)
    (folder / "step-12.tmp-0123").mkdir()  # an interrupted save is not a checkpoint to pass
    (folder / "step-10.model-only").mkdir()  # nor is a set-aside one
    index_less = _copy(ours, tmp_path / "step-5")
    (index_less / "index.json").unlink()
    said = {
        tmp_path / "nowhere": f"{tmp_path / 'nowhere'} does not exist",
        folder: f"{folder} holds step-2, step-4 and step-10 (checkpoints): pass one of them",
        hf_dir: f"{hf_dir} is a Hugging Face model folder: use from-hf to convert it",
        folder / "step-12.tmp-0123": "is not a committed checkpoint (an interrupted save leaves only a '.tmp-'",
        index_less: "is not a committed checkpoint (an interrupted save leaves only a '.tmp-'",
    }
    for path, message in said.items():
        assert _run("inspect", path) == 1
        out = capsys.readouterr().out
        assert message in out.strip().splitlines()[-1] and out.count(message) == 1, out
        assert ("interrupted save" in out) == (message.startswith("is not a committed")), out
    assert _run("to-hf", folder, tmp_path / "out") == 1  # the other commands say the same
    assert f"{folder} holds step-2, step-4 and step-10 (checkpoints)" in capsys.readouterr().err


# ------------------------------------------------------------------- Hugging Face's model
@pytest.mark.parametrize("args", [ARGS, SCALED], ids=["rope", "llama3_rope_scaling"])
def test_hf_llama_gives_our_logits(args, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    model = _model(args, seed=1)
    assert _run("to-hf", _save_ours(model, tmp_path / "step-1"), tmp_path / "hf") == 0
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, hf_logits = model(tokens), theirs(tokens).logits
    torch.testing.assert_close(hf_logits, ours, atol=1e-5, rtol=1e-5)
    if args.rope_scaling is not None:  # the scaling is live: without it the logits differ
        plain = Transformer(dataclasses.replace(args, rope_scaling=None))
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (plain(tokens) - ours).abs().max() > 1e-4


def test_from_hf_reads_hf_save_pretrained_tied(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(3)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    assert _run("from-hf", tmp_path / "hf", tmp_path / "ours") == 0
    meta = checkpoint.read_index(tmp_path / "ours").metadata
    ours = Transformer(hf.model_args_from_json(meta["model_args"]))
    assert ours.output.weight is ours.tok_embeddings.weight
    checkpoint.load({"model": ModelState(ours).state_dict()}, tmp_path / "ours")
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-5, rtol=1e-5)
