"""``model.remat``: what each layer keeps for the backward, recomputes, or keeps in host memory.

The offload policies move what the backward keeps to pinned host memory in the forward and
back for the backward (JAX's offload checkpoint policies): XLA:GPU makes each transfer an
async copy overlapped with the layers around it, so the device holds one layer's worth in
flight instead of every layer's. XLA:CPU has no separate host memory: there the same
program keeps them in place (the run says so in one line).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

LAYER_INPUT = "layer_input"  # the name a layer's input carries, for offload_layer_inputs
POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_matmuls": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    # full remat whose one kept value per layer, its input, waits on host
    "offload_layer_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT], offload_src="device", offload_dst="pinned_host"
    ),
}
OFFLOAD_POLICIES = tuple(name for name in POLICIES if name.startswith("offload_"))


def name_layer_input(h: jax.Array) -> jax.Array:
    """``h`` named as a layer's input (no effect unless a policy names it): every use inside the
    layer reads the named value, so an offload policy keeps that copy and not ``h`` itself."""
    return checkpoint_name(h, LAYER_INPUT)


def rematted(layer: Callable, policy: str, in_scan: bool = True) -> Callable:
    """``layer`` under ``model.remat=policy`` (as it is for none). ``in_scan``: the layer is a
    scan's body, where XLA cannot merge the backward's recomputation with the forward it
    repeats; called in a Python loop (``model.scan_layers=false``) it could, and did: XLA:GPU
    compiled every policy to none's program (llama3-8b on fsdp=8 with full remat peaked at
    56.7 GiB, 22.0 in the scan). There the recomputation is kept apart from the forward
    (``prevent_cse``): 34.4 GiB."""
    if policy == "none":
        return layer
    return jax.checkpoint(layer, policy=POLICIES[policy], prevent_cse=not in_scan)


# on a platform without a host memory of its own, what each offload policy computes the same as
KEPT_IN_PLACE = {"offload_matmuls": "save_matmuls", "offload_layer_inputs": "full"}


def offload_note(policy: str, platform: str) -> str | None:
    """The one line a run whose offload policy moves nothing prints (None otherwise)."""
    if policy not in OFFLOAD_POLICIES or platform == "gpu":
        return None
    return (
        f"model.remat={policy}: {platform} devices have no memory apart from the host's, so nothing is offloaded; "
        f"it trains as model.remat={KEPT_IN_PLACE[policy]} (the same values, kept in place)"
    )


def unscanned_note(policy: str, scan_layers: bool, platform: str) -> str | None:
    """The one line a run whose policy keeps what ``none`` keeps says: XLA:CPU's program of the
    layers in a Python loop computes each recomputation with the forward it repeats (the same
    temporaries under none, full and save_matmuls), so there the policy only adds work."""
    if policy == "none" or scan_layers or platform == "gpu":
        return None
    return (
        f"model.remat={policy} with model.scan_layers=false: on {platform} devices XLA keeps what model.remat=none keeps "
        "(it recomputes alongside the forward); the layer scan (model.scan_layers=true) keeps less"
    )
