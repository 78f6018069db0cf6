"""Optimizer state in host memory (``train.optimizer_offload``): the same steps as with the
state on the devices, the state's arrays in pinned host memory between steps, one line on
CPU (whose devices have no memory apart from the host's); in XLA:GPU's program for an H100
the state crosses the host link after the backward, asynchronously, and the device's peak
drops by the state's size. XLA's own peak counts host arguments: ``device_peak`` leaves them out.
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from jaxdist.config import load_config
from jaxdist.data.sources import resolve_vocab
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.training.run import build_trainer

from helpers import TINY, first_batch

MESH = "data=2,fsdp=2"


def _three_steps(*overrides: str):
    config = load_config(None, [*TINY, *overrides])
    resolve_vocab(config)
    sizes = parse_mesh(MESH)
    trainer = build_trainer(config, sizes, jax.devices()[: mesh_device_count(sizes)])
    state = trainer.init_state(0)
    batch = first_batch(config, trainer.layout)
    losses = []
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


def test_the_state_in_host_memory_takes_the_same_steps_and_cpu_says_it_saves_nothing(capsys):
    _, on_device, losses = _three_steps()
    capsys.readouterr()
    trainer, offloaded, offloaded_losses = _three_steps("train.optimizer_offload=true")
    assert offloaded_losses == losses
    chex.assert_trees_all_equal(nnx.to_pure_dict(offloaded.params), nnx.to_pure_dict(on_device.params))
    chex.assert_trees_all_equal(offloaded.opt_state, on_device.opt_state)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(offloaded.opt_state)}
    assert kinds == {"pinned_host"}, kinds
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(offloaded.params)} == {"device"}
    lines = [x for x in capsys.readouterr().err.splitlines() if "train.optimizer_offload" in x]
    assert len(lines) == 1 and "cpu devices have no memory apart from the host's" in lines[0], lines


def test_diloco_refuses_it_in_one_line():
    from jaxdist.errors import ConfigError
    from jaxdist.layout.validate import check_config_on_mesh

    config = load_config(None, [*TINY, "parallel.diloco_inner_steps=2", "train.optimizer_offload=true"])
    with pytest.raises(ConfigError, match="train.optimizer_offload with DiLoCo"):
        check_config_on_mesh(config, parse_mesh("replica=2,data=2"))


def _target_devices(n: int):
    pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")
    from jaxdist.plan.gpu_target import target_devices, target_hardware

    return target_devices(target_hardware("h100"), n, 8)


def test_device_peak_leaves_out_what_lives_in_host_memory():
    """One 256 MiB argument in host memory, doubled on the device and sent back: XLA:GPU's
    peak_memory_in_bytes counts the host argument too; on the device the step holds the two
    256 MiB temporaries and the small device argument and output."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxdist.inspect.step_report import device_peak

    mesh = Mesh(np.array(_target_devices(1)), ("x",))
    host, device = (NamedSharding(mesh.abstract_mesh, PartitionSpec(), memory_kind=k) for k in ("pinned_host", "device"))
    mib = 2**20

    def step(on_host, small):
        return jax.device_put(jax.device_put(on_host, device) * 2, host), small + 1

    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(step, in_shardings=(host, device), out_shardings=(host, device), donate_argnums=(0,))
            .lower(jax.ShapeDtypeStruct((256 * mib // 4,), jnp.float32), jax.ShapeDtypeStruct((16 * mib // 4,), jnp.float32))
            .compile()
        )
    stats = compiled.memory_analysis()
    assert stats.host_argument_size_in_bytes == 256 * mib
    assert device_peak(compiled) == stats.peak_memory_in_bytes - 256 * mib
    assert 2 * 256 * mib <= device_peak(compiled) <= 2 * 256 * mib + 2 * 16 * mib + mib


@pytest.mark.heavy
def test_the_h100_program_brings_the_state_after_the_backward_and_its_device_peak_drops():
    """A 4-layer decoder of width 256 at seq 1024 on fsdp=8: Adam's two f32 moments (8 bytes a
    parameter, 1/8 per device) move to host memory; XLA:GPU's program reads them after the
    layers' backward loops (asynchronously, each way), the step's device arguments shrink by
    them and its device peak drops by at least nine tenths of them."""
    _target_devices(8)
    from jaxdist.inspect.hlo import parse_hlo
    from jaxdist.plan.gpu_target import compile_for_target, target_hardware, target_report

    words = [
        *TINY,
        "model.dtype=bfloat16",
        "model.n_layers=4",
        "model.d_model=256",
        "train.seq_len=1024",
        "train.global_batch=8",
        "train.latency_profile=off",
    ]
    hardware, reports, programs = target_hardware("h100"), {}, {}
    for offload in ("false", "true"):
        config = load_config(None, [*words, f"train.optimizer_offload={offload}"])
        resolve_vocab(config)
        trainer, compiled, options = compile_for_target(config, parse_mesh("fsdp=8"), hardware, 8, 8)
        reports[offload], programs[offload] = target_report(trainer, compiled, hardware, options, 8), compiled.as_text()
    moments = 2 * 4 * trainer.n_params // 8
    plain, moved = reports["false"]["memory_per_device_bytes"], reports["true"]["memory_per_device_bytes"]
    assert "host" not in plain and moved["host"] == pytest.approx(moments, rel=1e-3)  # + Adam's step counts
    assert plain["arguments"] - moved["arguments"] == pytest.approx(moments, rel=1e-3)
    assert moved["peak"] <= plain["peak"] - 0.9 * moments, (plain["peak"], moved["peak"])
    transfers = reports["true"]["host_offload"]
    for direction in ("from_host", "to_host"):
        assert transfers[direction]["count"] == transfers[direction]["async"] > 0
        assert transfers[direction]["bytes"] == pytest.approx(moments, rel=1e-3)
    module = parse_hlo(programs["true"])
    order = [i.opcode for i in module.computations[module.entry]]
    last_loop = max(k for k, op in enumerate(order) if op == "while")
    first_copy = min(k for k, op in enumerate(order) if op == "copy-start")
    assert first_copy > last_loop  # the copies wait for the gradients (the layers' backward loop)


def test_the_planner_tries_the_state_on_host_beside_full_remat_and_screens_it_8_bytes_a_parameter_lower():
    """A GPU target's search (llama3-8b on 8 GPUs) adds each full-remat layout (full and
    offload_layer_inputs) with the optimizer state in host memory, and nothing else; its
    screened memory is lower by Adam's two f32 moments of the parameters a device holds."""
    import dataclasses

    from jaxdist.models.counts import count_params
    from jaxdist.plan.search import OFFLOAD_REMATS, REMATS, enumerate_candidates, estimated_memory

    config = load_config("llama3-8b", ["model.vocab_size=32768"])
    plain = enumerate_candidates(config, 8, 8, remats=REMATS + OFFLOAD_REMATS)
    offered = enumerate_candidates(config, 8, 8, remats=REMATS + OFFLOAD_REMATS, optimizer_offload=True)
    moved = [c for c in offered if c.optimizer_offload]
    assert {c.remat for c in moved} == {"full", "offload_layer_inputs"} and len(offered) == len(plain) + len(moved)
    n = count_params(config.model)
    for candidate in moved:
        twin = dataclasses.replace(candidate, optimizer_offload=False)
        assert twin in plain and "train.optimizer_offload=true" in candidate.overrides()
        held = n / (candidate.sizes["fsdp"] * candidate.sizes["context"] * candidate.sizes["tensor"] * candidate.sizes["pipe"])
        saved = estimated_memory(config, twin, n, True) - estimated_memory(config, candidate, n, True)
        assert saved == pytest.approx(8 * held, rel=1e-9)
