"""A run is resolved once, then frozen (jaxdist.training.run_plan): the mesh, the start, the
microbatches of a resume, the vocabulary and the schedule's length are decided in one place,
the caller's config is left as given, and nothing can change the plan's config afterwards."""

import dataclasses

import pytest

from jaxdist.config import load_config, unfrozen
from jaxdist.data.tokenizers import load_tokenizer
from jaxdist.training.run_plan import resolve_run

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2", "model.mlp_dim=64", "train.seq_len=16"]


def test_the_plan_is_resolved_and_frozen_and_the_callers_config_is_not_touched():
    config = load_config(None, [*TINY, "parallel.mesh=data=-1,tensor=2", "train.steps=7"])
    plan = resolve_run(config, None, num_processes=1, n_devices=8)
    assert plan.config.parallel.mesh == "data=4,tensor=2" and plan.mesh_sizes["data"] == 4
    ids = load_tokenizer("byte").vocab_size  # 256 bytes and the special ids
    assert plan.config.data.tokenizer == "byte" and plan.config.model.vocab_size % 128 == 0
    assert plan.config.model.vocab_size - 128 < ids <= plan.config.model.vocab_size
    assert plan.config.train.schedule_steps == 7 and plan.start == "fresh"
    # the caller's config: as loaded
    assert (config.parallel.mesh, config.model.vocab_size, config.train.schedule_steps, config.data.tokenizer) == (
        "data=-1,tensor=2",
        0,
        0,
        "",
    )
    with pytest.raises(dataclasses.FrozenInstanceError, match="frozen once the run is resolved"):
        plan.config.train.microbatches = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.config.name = "other"
    derived = unfrozen(plan.config)  # a tool that derives another config copies it
    derived.train.steps = 9
    assert plan.config.train.steps == 7


def test_the_start_is_read_from_the_run_directory_and_the_flags(tmp_path):
    config = load_config(None, [*TINY, "parallel.mesh=data=2"])
    assert resolve_run(config, tmp_path).start == "fresh"
    assert resolve_run(config, tmp_path, init_from=str(tmp_path / "elsewhere")).start == "init-from"
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    assert resolve_run(config, tmp_path).start == "resume"  # its own checkpoint wins over --init-from (run.py says so)
    assert resolve_run(config, tmp_path, init_from=str(tmp_path / "elsewhere")).start == "resume"
    assert resolve_run(config, tmp_path, resume="never").start == "fresh"  # (run.py refuses it: the run dir has checkpoints)


def test_only_a_resume_adapts_the_microbatches_to_the_mesh(tmp_path):
    """8 rows in 4 microbatches of 2 cannot split over data=8: a run resuming its own
    checkpoint (saved on another mesh) takes 1 microbatch of 8, the global batch unchanged; a
    fresh run keeps what it was given (check_config_on_mesh refuses it with its own line)."""
    config = load_config(None, [*TINY, "train.global_batch=8", "train.microbatches=4", "parallel.mesh=data=8"])
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    resumed = resolve_run(config, tmp_path)
    assert (resumed.config.train.microbatches, resumed.config.train.global_batch) == (1, 8)
    assert resolve_run(config, tmp_path / "new").config.train.microbatches == 4
    assert config.train.microbatches == 4
