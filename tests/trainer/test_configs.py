"""The production configs: each passes the pre-flight for its world, and its flavor builds on the meta
device and parallelizes under its degrees (rank 0 of a fake world) with the published parameter count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {  # config -> (world size, published parameter count)
    "llama3_1b": (1, 1_235_814_400),  # Llama-3.2-1B, lm_head tied to the embedding
    "llama3_8b": (8, 8_030_261_248),
    "llama3_70b": (64, 70_553_706_496),
    "llama3_405b": (512, 405_853_388_800),
}
# the Llama 3 tokenizer is not shipped: the byte tokenizer stands in (vocab_size 128256 pads it)
_NO_TOKENIZER = ["--model.tokenizer_path", ""]


def build_on_meta(config: str, world_size: int) -> dict:
    """In a fresh interpreter: rank 0 of a fake `world_size` world builds and parallelizes the flavor."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from models.llama3.parallelize import parallelize_llama
    from parallelisms.dtensor import DTensor
    from trainer.build import build_model
    from trainer.config import load_config
    from trainer.preflight import build_parallel_dims

    cfg = load_config(["--job.config_file", str(REPO / "configs" / f"{config}.toml"), *_NO_TOKENIZER])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    dims = build_parallel_dims(cfg.parallelism, world_size)
    model = build_model(cfg, cfg.model.vocab_size)
    parallelize_llama(model, dims, dims.build_mesh("cpu"), loss_parallel=True, ac_mode=cfg.activation_checkpoint.mode)
    params = list(model.parameters())
    return {
        "global": sum(p.numel() for p in params),
        "local": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "meta": all(p.is_meta for p in params),
        "mesh": [dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp],
    }


@pytest.mark.parametrize("config", list(CONFIGS))
def test_production_config_passes_preflight_for_its_world(config: str) -> None:
    from trainer.config import load_config
    from trainer.preflight import check_config

    world_size, _ = CONFIGS[config]
    cfg = load_config(["--job.config_file", str(REPO / "configs" / f"{config}.toml"), *_NO_TOKENIZER])
    check_config(cfg, world_size)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_production_flavor_builds_and_shards_on_meta_with_its_parameter_count(config: str) -> None:
    world_size, published = CONFIGS[config]
    call = f"build_on_meta({config!r}, {world_size})"
    code = f"import json; from tests.trainer.test_configs import build_on_meta; print(json.dumps({call}))"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["global"] == published, report
    assert report["meta"], "a parameter left the meta device"
    dp_replicate, dp_shard, tp, pp = report["mesh"]
    assert dp_replicate * dp_shard * tp * pp == world_size
    # the whole model parallelized (a PP rank keeps only its stages of it): one rank holds ~1/(dp x tp)
    assert report["local"] <= published // (dp_shard * tp) * 1.01 + 2**20, report
