"""The training math does not depend on the mesh: sharded losses equal the 1-device run."""

import numpy as np
import pytest

from helpers import train_losses


@pytest.mark.parametrize("mesh", ["data=8", "fsdp=8", "data=2,fsdp=2,tensor=2", "data=2,tensor=4", "8x1", "2x4"])
def test_first_losses_match_single_device(mesh):
    reference = train_losses("data=1")
    sharded = train_losses(mesh)
    assert len(sharded) == len(reference) == 5
    np.testing.assert_allclose(sharded, reference, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["zero1", "dp"])
def test_zero_stages_match_single_device(strategy):
    np.testing.assert_allclose(train_losses("data=4,fsdp=2", (f"parallel.strategy={strategy}",)), train_losses("data=1"), rtol=1e-5)


@pytest.mark.parametrize(
    ("mesh", "strategy"), [("data=2,fsdp=2", "auto"), ("data=4", "dp"), ("data=2,tensor=2", "zero1"), ("tensor=4", "dp")]
)
def test_gradient_accumulation_matches_one_microbatch(mesh, strategy):
    reference = train_losses("data=1")
    accumulated = train_losses(mesh, ("train.microbatches=4", f"parallel.strategy={strategy}"))
    np.testing.assert_allclose(accumulated, reference, rtol=1e-5)


def test_loss_falls():
    losses = train_losses("data=2,fsdp=2,tensor=2", steps=30)
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("remat", ["full", "save_matmuls"])
def test_remat_changes_memory_not_math(remat):
    np.testing.assert_allclose(train_losses("fsdp=4", (f"model.remat={remat}",)), train_losses("data=1"), rtol=1e-5)


def test_layer_loop_matches_the_layer_scan():
    """model.scan_layers=false (a Python loop over the stacked layers) is the same math, sharded too."""
    np.testing.assert_allclose(train_losses("data=2,fsdp=2,tensor=2", ("model.scan_layers=false",)), train_losses("data=1"), rtol=1e-5)


def test_tied_embeddings_shard_like_untied():
    tied = ("model.tie_embeddings=true",)
    np.testing.assert_allclose(train_losses("data=2,tensor=4", tied), train_losses("data=1", tied), rtol=1e-5)


def test_bfloat16_compute_tracks_float32():
    """Mixed precision (fp32 master weights, bf16 compute) stays near the fp32 run and learns."""
    bf16 = train_losses("data=2,fsdp=2,tensor=2", ("model.dtype=bfloat16",), steps=30)
    fp32 = train_losses("data=2,fsdp=2,tensor=2", steps=30)
    np.testing.assert_allclose(bf16, fp32, rtol=0.03)
    assert bf16[-1] < bf16[0] - 1.0
