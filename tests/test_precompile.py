"""The steps compiled ahead for in-process recovery (``training.precompile``): held per mesh
and taken once, a failed compile said in one line when its mesh is needed, what the
background trainer builds said only when their step is used, the number held bounded.
The multi-process path (a kill, the survivors taking the held step, the replacement's grow)
is ``test_recovery.py``'s killed-process test."""

import logging
import threading

import jax
import jax.numpy as jnp

from jaxdist.training import precompile


class _Trainer:
    """What the compile ahead needs of a trainer: its step compiled for abstract inputs, and those inputs."""

    def __init__(self, scale: float, say: str = ""):
        if say:
            logging.getLogger("jaxdist.training.step").warning(say)
        self.train_step = jax.jit(lambda x, b: x * scale + b)

    def compiled_train_step(self, state, batch):
        return self.train_step.lower(state, batch).compile()

    def abstract_state(self):
        return jax.ShapeDtypeStruct((4,), jnp.float32)

    def abstract_batch(self, batch_size: int):
        return jax.ShapeDtypeStruct((batch_size,), jnp.float32)


def _failing():
    raise ValueError("the mesh does not divide the batch\nsecond line")


def test_a_held_step_is_compiled_in_the_background_and_taken_once(capsys):
    ahead = precompile.AheadOfTime()
    key_a, key_b = ((0, 1), (0, 1)), ((0, 2), (0, 2))
    ahead.start([(key_a, lambda: _Trainer(2.0, say="a note about mesh a")), (key_b, _failing)], batch_size=4)
    held = ahead.take(key_a)
    assert ahead.thread.name == precompile.THREAD_NAME != threading.current_thread().name
    assert held is not None and held.seconds > 0
    out = held.compiled(jnp.ones(4), jnp.full(4, 0.5))
    assert out.tolist() == [2.5] * 4  # the compiled program is the trainer's step
    err = capsys.readouterr().err
    assert err.count("a note about mesh a") == 1, err  # said when taken (once), not while compiling in the background
    assert ahead.take(key_b) is None
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and "could not be compiled ahead (ValueError: the mesh does not divide the batch); compiling it now" in lines[0]
    assert ahead.take(((0,), (0,))) is None  # a mesh nobody compiled: nothing to wait for
    ahead.stop()
    assert ahead.take(key_a) is None and ahead.thread is None  # taken once; stopped


def test_more_meshes_than_held_are_said_and_the_rest_compile_when_needed(capsys):
    ahead = precompile.AheadOfTime()
    layouts = [(((0, k), (k,)), lambda k=k: _Trainer(float(k))) for k in range(precompile.MAX_HELD + 2)]
    ahead.start(layouts, batch_size=4)
    err = capsys.readouterr().err
    assert f"{precompile.MAX_HELD + 2} meshes a death could leave; the steps of the first {precompile.MAX_HELD} are compiled ahead" in err
    assert ahead.take(layouts[precompile.MAX_HELD - 1][0]) is not None
    assert ahead.take(layouts[precompile.MAX_HELD][0]) is None
    ahead.stop()


def test_a_new_start_drops_what_the_last_one_held():
    ahead = precompile.AheadOfTime()
    old = ((0, 1, 2), (0, 1, 2))
    ahead.start([(old, lambda: _Trainer(1.0))], batch_size=4)
    assert ahead.take(old) is not None
    new = ((0, 1), (0, 1))
    ahead.start([(new, lambda: _Trainer(3.0))], batch_size=4)
    assert ahead.take(old) is None and ahead.take(new) is not None
    ahead.stop()
