"""``train.objective=dpo`` on ``data.source=preference``.

The loss and TRL's four reward metrics against numpy, from log-probabilities of the plain
model's logits on each row alone; the same losses and metrics on sharded meshes as on one
device; an interrupted run resumed equals the uninterrupted one exactly; a run learns a rule the
rejected answers break, from an SFT checkpoint, until greedy answers follow it; the pairs' layout; bad input in one line.
Reference log-probabilities stored once (``data.reference_logps``) train as the reference model
kept in the state does; a stale, foreign or hostile file is refused in one line.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist import train as train_cli
from jaxdist.config import ParallelConfig, load_config
from jaxdist.data.preference import preference_pairs
from jaxdist.data.reference_logps import KEY
from jaxdist.data.sources import resolve_vocab
from jaxdist.data.tokenizers import load_tokenizer
from jaxdist.errors import JaxdistError
from jaxdist.inference.generation import generate_ids
from jaxdist.inference.loading import load
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.training.dpo import REWARD_METRICS, pair_terms
from jaxdist.training.run import build_trainer, run
from jaxdist.training.weights import checkpoint_config

from helpers import TINY, first_batch, subprocess_env

LETTERS = "abcdefgh"
BYTE_TEMPLATE = "{% for m in messages %}{{ m.role[0] }}:{{ m.content }};{% endfor %}{% if add_generation_prompt %}a:{% endif %}"


def rule_pairs(n: int, seed: int = 0) -> list[dict]:
    """The rule: the chosen answer repeats the prompt's word; the rejected one is another word."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        word, other = ("".join(rng.choice(LETTERS) for _ in range(3)) for _ in range(2))
        records.append({"prompt": f"{word}=", "chosen": word, "rejected": other})
    return records


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def dpo_overrides(path: str, *more: str) -> tuple[str, ...]:
    return (*TINY, "train.objective=dpo", "data.source=preference", f"data.path={path}", *more)


def metrics(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", rule_pairs(96))


# ---------------------------------------------------------------------------------------------
# the loss and the metrics


def _numpy_logps(model, batch, rows: np.ndarray) -> np.ndarray:
    """Each row's answer log-probability: the plain model's logits on the row alone (its real
    tokens only, no padding, no segment ids), numpy's log-softmax, the answer's targets summed."""
    forward = jax.jit(lambda tokens: model(tokens))
    out = []
    for row in rows:
        mask = np.asarray(batch["loss_mask"][row])
        n = int(np.nonzero(mask)[0][-1]) + 1  # the row's real targets end with its answer
        logits = np.asarray(forward(np.asarray(batch["inputs"][row][:n])[None]), np.float64)[0]
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        target_logp = logp[np.arange(n), np.asarray(batch["targets"][row][:n])]
        out.append((target_logp * mask[:n]).sum())
    return np.asarray(out)


def _numpy_dpo(policy, reference, counts, beta, smoothing, loss):
    pc, pr, rc, rr = policy[0::2], policy[1::2], reference[0::2], reference[1::2]
    delta = (pc - rc) - (pr - rr)
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)  # noqa: E731
    if loss == "ipo":  # each answer's log-ratio per token; the rewards stay the sums' (TRL)
        losses = ((pc - rc) / counts[0::2] - (pr - rr) / counts[1::2] - 1 / (2 * beta)) ** 2
    else:
        losses = -(1 - smoothing) * log_sigmoid(beta * delta) - smoothing * log_sigmoid(-beta * delta)
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    return losses.mean(), {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).mean(),
        "rewards/margins": (chosen - rejected).mean(),
    }


CIRCULAR = ("model.n_layers=4", "parallel.schedule=circular", "parallel.virtual_stages=2")


@pytest.mark.parametrize(
    ("loss", "smoothing", "mesh", "more"),
    [("sigmoid", 0.2, "data=1", ()), ("ipo", 0.0, "data=1", ()), ("sigmoid", 0.2, "data=2,pipe=2", ()), ("ipo", 0.0, "pipe=2", CIRCULAR)],
    ids=["sigmoid", "ipo", "gpipe", "circular"],
)
def test_loss_and_reward_metrics_equal_numpy(pairs_file, loss, smoothing, mesh, more):
    """Step 2 (the policy moved by step 1, the reference still the initial weights): the step's
    loss and metrics against numpy from each row's log-probabilities computed apart. On a pipe
    axis the rows' log-probabilities (the policy's and the reference's) come through GPipe's
    schedule: its activations move between stages by collective-permutes."""
    overrides = dpo_overrides(pairs_file, f"train.dpo_loss={loss}", "train.dpo_beta=0.5", "train.lr=1e-2", "train.warmup_steps=0")
    config = load_config(None, [*overrides, *more, *([f"train.dpo_label_smoothing={smoothing}"] if smoothing else [])])
    resolve_vocab(config)
    sizes = parse_mesh(mesh)
    trainer = build_trainer(config, sizes, jax.devices()[: mesh_device_count(sizes)])
    state = trainer.init_state(0)
    batch = jax.device_get(first_batch(config, trainer.layout))
    permutes = trainer.train_step.lower(state, batch).as_text().count("collective_permute")
    assert (permutes > 0) == (sizes.get("pipe", 1) > 1)
    state, first = trainer.train_step(state, batch)
    at_zero = np.log(2.0) if loss == "sigmoid" else (1 / (2 * 0.5)) ** 2
    assert float(first["loss"]) == pytest.approx(at_zero, abs=1e-6)  # policy == reference: margin 0
    policy_params, reference_params = jax.device_get(state.params), jax.device_get(state.reference)
    _, step2 = trainer.train_step(state, batch)

    rows = np.arange(config.train.global_batch)
    policy = _numpy_logps(nnx.merge(trainer.graphdef, policy_params), batch, rows)
    reference = _numpy_logps(nnx.merge(trainer.graphdef, reference_params), batch, rows)
    counts = np.asarray(batch["loss_mask"]).sum(-1)
    want_loss, want = _numpy_dpo(policy, reference, counts, 0.5, smoothing, loss)
    assert abs(want["rewards/margins"]) > 1e-3  # the policy did move
    np.testing.assert_allclose(float(step2["loss"]), want_loss, atol=1e-5, rtol=1e-5)
    for key in REWARD_METRICS:
        np.testing.assert_allclose(float(step2[key]), want[key], atol=1e-5, rtol=1e-5, err_msg=key)


def test_pair_terms_match_the_formulas_at_known_margins():
    """Hand values: margin 2 at beta 0.5 is sigmoid loss log(1 + e^-1); IPO's (2 - 1)^2."""
    policy, reference = np.array([1.0, -1.0], np.float32), np.zeros(2, np.float32)
    losses, sums = pair_terms(policy, reference, beta=0.5, label_smoothing=0.0, loss="sigmoid")
    assert float(losses[0]) == pytest.approx(np.log1p(np.exp(-1.0)), rel=1e-6)
    smoothed, _ = pair_terms(policy, reference, beta=0.5, label_smoothing=0.25, loss="sigmoid")
    assert float(smoothed[0]) == pytest.approx(0.75 * np.log1p(np.exp(-1.0)) + 0.25 * np.log1p(np.exp(1.0)), rel=1e-6)
    ipo, ipo_sums = pair_terms(policy, reference, beta=0.5, label_smoothing=0.0, loss="ipo")
    assert float(ipo[0]) == pytest.approx(1.0)
    per_token, per_token_sums = pair_terms(policy, reference, beta=0.5, label_smoothing=0.0, loss="ipo", counts=np.array([2.0, 4.0]))
    assert float(per_token[0]) == pytest.approx((0.5 + 0.25 - 1.0) ** 2)  # log-ratios 1/2 and -1/4 per token
    assert {k: float(v) for k, v in per_token_sums.items()} == {k: float(v) for k, v in ipo_sums.items()}  # rewards: the sums
    assert {k: float(v) for k, v in sums.items()} == pytest.approx(
        {"rewards/chosen": 0.5, "rewards/rejected": -0.5, "rewards/accuracies": 1.0, "rewards/margins": 1.0}
    )


# ---------------------------------------------------------------------------------------------
# the data


def test_a_pair_is_two_adjacent_rows_with_the_loss_on_the_answer(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab=", "chosen": "ab", "rejected": "xyz"}, *rule_pairs(3)])
    config = load_config(None, ["train.objective=dpo", "data.source=preference", f"data.path={path}", "train.seq_len=8"])
    resolve_vocab(config)
    pair = preference_pairs(config)[0]
    eod = 256
    chosen, rejected = [*b"ab=ab", eod], [*b"ab=xyz", eod]
    for side, tokens in enumerate((chosen, rejected)):
        n = len(tokens) - 1
        assert list(pair["inputs"][side][:n]) == tokens[:-1] and list(pair["targets"][side][:n]) == tokens[1:]
        want = np.zeros(8, np.float32)
        want[2:n] = 1  # targets 2.. are the answer's tokens (the prompt is 3 tokens), its end-of-document id included
        np.testing.assert_array_equal(pair["loss_mask"][side], want)
        np.testing.assert_array_equal(pair["segment_ids"][side], [0] * n + [1] * (8 - n))


def test_chat_pairs_render_with_the_chat_template(tmp_path):
    (tmp_path / "t.jinja").write_text(BYTE_TEMPLATE)
    record = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yo"}], "rejected": "no"}
    path = write_jsonl(tmp_path / "p.jsonl", [record])
    config = load_config(
        None, ["train.objective=dpo", "data.source=preference", f"data.path={path}", f"data.chat_template={tmp_path / 't.jinja'}"]
    )
    resolve_vocab(config)
    pair = preference_pairs(config)[0]
    for side, text in enumerate((b"u:hi;a:yo;", b"u:hi;a:no;")):
        n = len(text) - 1
        assert bytes(pair["inputs"][side][:n].astype(np.uint8)) == text[:-1]
        assert pair["loss_mask"][side].tolist() == [0.0] * 6 + [1.0] * 3 + [0.0] * (64 - 9)  # "yo;" / "no;" after "u:hi;a:"


# ---------------------------------------------------------------------------------------------
# meshes, resume, learning


def _run(path: str, mesh: str, run_dir, *more: str) -> list[dict]:
    sizes = parse_mesh(mesh)
    config = load_config(None, dpo_overrides(path, "train.steps=3", "train.lr=1e-2", "train.warmup_steps=0", *more))
    run(config, sizes, run_dir, devices=jax.devices()[: mesh_device_count(sizes)], progress=False)
    return metrics(run_dir)


@pytest.fixture(scope="module")
def one_device(pairs_file, tmp_path_factory):
    return _run(pairs_file, "data=1", tmp_path_factory.mktemp("one") / "run")


@pytest.mark.parametrize("mesh", ["data=2", "fsdp=2,tensor=2", "data=2,pipe=2"])
def test_sharded_runs_equal_one_device(pairs_file, one_device, mesh, tmp_path):
    """The rewards are differences of summed log-probabilities (tens of nats): float32 rounding of
    those sums in another reduction order is ~1e-6 in a reward, hence the absolute tolerance. At
    step 1 every margin is 0 up to that rounding, so which side wins (the accuracy) is noise there."""
    sharded = _run(pairs_file, mesh, tmp_path / "run")
    for key in ("loss", *REWARD_METRICS):
        first = 1 if key == "rewards/accuracies" else 0
        got, want = [r[key] for r in sharded[first:]], [r[key] for r in one_device[first:]]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=key)
    assert one_device[-1]["rewards/margins"] != 0.0


def test_resume_equals_the_uninterrupted_run(pairs_file, one_device, tmp_path):
    run_dir = tmp_path / "run"
    first = _run(pairs_file, "data=1", run_dir, "train.stop_after_step=1")
    assert [r["step"] for r in first] == [1]
    resumed = _run(pairs_file, "data=1", run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("loss", *REWARD_METRICS):
        assert [r[key] for r in resumed] == [r[key] for r in one_device], key


def reversal_pairs(n: int, seed: int) -> list[dict]:
    """The rule: the chosen answer repeats the prompt's word, the rejected one reverses it (never
    the same word: first and last letters differ)."""
    rng = random.Random(seed)
    records = []
    while len(records) < n:
        word = "".join(rng.choice(LETTERS) for _ in range(3))
        if word[0] != word[-1]:
            records.append({"prompt": f"{word}=", "chosen": word, "rejected": word[::-1]})
    return records


def _greedy_answers(run_dir, prompts: list[str]) -> list[str]:
    """Each prompt's 3-byte greedy answer from the run's last checkpoint."""
    step_dir = max((d for d in (run_dir / "checkpoints").iterdir() if d.name.isdigit()), key=lambda d: int(d.name))
    config = checkpoint_config(step_dir)
    config.parallel = ParallelConfig(mesh="data=1")
    loaded = load(config, step_dir)
    tokenizer = load_tokenizer(None)
    ids = jnp.asarray(np.array([tokenizer.encode(p) for p in prompts], np.int32))
    out, _ = jax.jit(lambda model, ids: generate_ids(model, ids, 3))(nnx.merge(loaded.trainer.graphdef, loaded.params), ids)
    return [tokenizer.decode([int(t) for t in row]) for row in np.asarray(out)]


@pytest.mark.heavy
def test_dpo_from_an_sft_checkpoint_makes_greedy_answers_follow_the_rule(tmp_path):
    """Supervised fine-tuning on both answers of every pair (the chosen and the rejected one as
    text) leaves greedy decoding undecided between them; DPO from that checkpoint (the reference
    is the SFT model) lifts the reward accuracy over 0.9 and makes the greedy answers to held-out
    prompts follow the rule."""
    pairs = reversal_pairs(512, seed=0)
    sft_text = [{"text": p["prompt"] + p[side]} for p in pairs for side in ("chosen", "rejected")]
    common = (*TINY, "train.global_batch=32", "train.seq_len=16", "train.lr=5e-3", "checkpoint.every_steps=0")
    sft = ("data.source=text", f"data.path={write_jsonl(tmp_path / 'sft.jsonl', sft_text)}", "data.text_unit=line", "train.steps=80")
    run(load_config(None, (*common, *sft)), parse_mesh("data=1"), tmp_path / "sft", devices=jax.devices()[:1], progress=False)
    dpo = dpo_overrides(write_jsonl(tmp_path / "pairs.jsonl", pairs), "train.steps=40")
    config = load_config(None, (*dpo, *common[len(TINY) :]))
    run(config, parse_mesh("data=1"), tmp_path / "dpo", devices=jax.devices()[:1], progress=False, init_from=str(tmp_path / "sft"))

    records = metrics(tmp_path / "dpo")
    assert records[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-4)  # the policy starts as the reference
    assert np.mean([r["rewards/accuracies"] for r in records[-5:]]) > 0.9, [r["rewards/accuracies"] for r in records]
    held_out = reversal_pairs(64, seed=99)
    prompts = [p["prompt"] for p in held_out]
    follows = {
        name: np.mean([a == p["chosen"] for a, p in zip(_greedy_answers(tmp_path / name, prompts), held_out, strict=True)])
        for name in ("sft", "dpo")
    }
    assert follows["sft"] < 0.75 and follows["dpo"] > 0.9, follows


# ---------------------------------------------------------------------------------------------
# bad input


GOOD = {"prompt": "ab=", "chosen": "ab", "rejected": "cd"}


@pytest.mark.parametrize(
    ("records", "more", "expected"),
    [
        ([GOOD, {"prompt": "a=", "chosen": "a"}], (), "p.jsonl: record 2: no field 'rejected'"),
        ([GOOD, {**GOOD, "chosen": ""}], (), "p.jsonl: record 2: field 'chosen' is empty"),
        ([GOOD, {**GOOD, "rejected": []}], (), "record 2: field 'rejected' is a list of messages but 'prompt' is text"),
        ([GOOD, {**GOOD, "prompt": "x" * 40}], (), "record 2: the prompt's 40 tokens leave no room for an answer in train.seq_len=32"),
        ([GOOD, "{not json"], (), "record 2: not JSON"),
        ([GOOD], ("train.objective=lm",), "train.objective=dpo trains on data.source=preference"),
        ([GOOD], ("--mesh", "data=2,pipe=2", "parallel.schedule=1f1b"), "a pipe axis runs parallel.schedule=gpipe or circular, not 1f1b"),
        ([GOOD], ("train.microbatches=2",), "train.objective=dpo does not support train.microbatches=2 yet"),
        ([GOOD], ("--mesh", "data=2", "train.global_batch=6"), "gives 3 rows per device, which would split a chosen/rejected pair"),
        ([GOOD], ("train.eval_every=5",), "train.objective=dpo has no held-out evaluation yet"),
    ],
    ids=[
        "missing field",
        "empty side",
        "mixed forms",
        "prompt too long",
        "not JSON",
        "lm objective",
        "pipe 1f1b",
        "microbatches",
        "odd rows",
        "eval",
    ],  # fmt: skip
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, records, more, expected):
    path = write_jsonl(tmp_path / "p.jsonl", records)
    argv = ["--run-dir", str(tmp_path / "run"), "--steps", "1", "train.objective=dpo", "data.source=preference", f"data.path={path}"]
    argv += [*TINY, *more]
    assert train_cli.main(argv) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("jaxdist: error: ") and expected in errors[0], errors
    assert not (tmp_path / "run").exists()


def test_bad_records_can_be_skipped_and_counted(tmp_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD, {**GOOD, "chosen": ""}, GOOD, {"prompt": "a"}])
    config = load_config(None, ["train.objective=dpo", "data.source=preference", f"data.path={path}", "data.bad_records=skip"])
    resolve_vocab(config)
    assert len(preference_pairs(config)) == 2
    said = capsys.readouterr().err
    assert "skipped 2 bad record(s)" in said and "record 2: field 'chosen' is empty" in said


def test_dpo_keys_that_do_not_apply_say_so_in_one_line_each():
    from jaxdist.layout.validate import check_config_on_mesh

    config = load_config(None, [*dpo_overrides("p.jsonl"), "train.dpo_loss=ipo", "train.dpo_label_smoothing=0.1", "model.loss_chunk=8"])
    lines = [x for x in check_config_on_mesh(config, parse_mesh("data=2")) if "has no effect" in x]
    assert lines == [
        "train.dpo_label_smoothing=0.1 has no effect with train.dpo_loss=ipo (label smoothing is the sigmoid loss's)",
        "model.loss_chunk=8 has no effect with train.objective=dpo (its log-probabilities take the whole sequence's logits)",
    ]
    config = load_config(None, [*dpo_overrides("p.jsonl"), "data.chat_template=t.jinja", "train.dpo_beta=0.3"])
    assert not [x for x in check_config_on_mesh(config, parse_mesh("data=2")) if "has no effect" in x]


# ---------------------------------------------------------------------------------------------
# data.reference_logps: the reference's log-probabilities computed once, stored beside the data


@pytest.fixture(scope="module")
def stored(pairs_file, tmp_path_factory):
    """(the file a fresh run wrote, that run's metrics)."""
    path = tmp_path_factory.mktemp("reference") / "pairs.reference.npz"
    return path, _run(pairs_file, "data=1", tmp_path_factory.mktemp("writer") / "run", f"data.reference_logps={path}")


def _same(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for key in ("loss", *REWARD_METRICS):
        first = 1 if key == "rewards/accuracies" else 0  # at step 1 every margin is 0 up to rounding
        np.testing.assert_allclose([r[key] for r in got[first:]], [r[key] for r in want[first:]], rtol=1e-5, atol=1e-5, err_msg=key)


def test_a_fresh_run_writes_the_file_and_trains_as_the_reference_model_does(pairs_file, one_device, stored):
    path, metrics = stored
    assert path.exists()
    _same(metrics, one_device)
    assert one_device[-1]["rewards/margins"] != 0.0  # the policy moved away from its reference
    config = load_config(None, dpo_overrides(pairs_file, f"data.reference_logps={path}"))
    resolve_vocab(config)
    rows = preference_pairs(config)
    assert rows.reference.shape == (192,) and np.all(rows.reference < 0)  # log-probabilities of 96 pairs' answers
    np.testing.assert_array_equal(rows[3][KEY], rows.reference[6:8])  # pair 3: rows 6 and 7
    trainer = build_trainer(config, parse_mesh("data=1"))
    assert trainer.state_layout.abstract.reference is None and trainer.task.with_reference is None


def test_another_run_reads_the_file_on_a_mesh_and_trains_the_same(pairs_file, one_device, stored, tmp_path, capsys):
    path, _ = stored
    written = path.stat().st_mtime_ns
    _same(_run(pairs_file, "fsdp=2,tensor=2", tmp_path / "run", f"data.reference_logps={path}"), one_device)
    assert path.stat().st_mtime_ns == written  # read, not computed again
    assert f"data.reference_logps: 192 rows' reference log-probabilities from {path}" in capsys.readouterr().err


def test_a_pipelined_run_computes_the_same_file_and_trains_the_same(pairs_file, one_device, stored, tmp_path):
    """The reference pass on data=2,pipe=2 (rows through GPipe's forward) writes what one device wrote."""
    path = tmp_path / "pipe.reference.npz"
    _same(_run(pairs_file, "data=2,pipe=2", tmp_path / "run", f"data.reference_logps={path}"), one_device)
    with np.load(stored[0], allow_pickle=False) as one, np.load(path, allow_pickle=False) as piped:
        np.testing.assert_allclose(piped["logps"], one["logps"], rtol=1e-5, atol=1e-5)


def test_a_file_for_other_pairs_or_another_reference_is_refused_in_one_line(pairs_file, stored, tmp_path):
    path, _ = stored
    other = write_jsonl(tmp_path / "other.jsonl", rule_pairs(40, seed=4))
    with pytest.raises(JaxdistError, match=r"was computed for other pairs \(the data, tokenizer") as error:
        _run(other, "data=1", tmp_path / "a", f"data.reference_logps={path}")
    assert "\n" not in str(error.value)
    with pytest.raises(JaxdistError, match=r"holds the log-probabilities of another reference \(seed 0 .*\), not this run's \(seed 5"):
        _run(pairs_file, "data=1", tmp_path / "b", f"data.reference_logps={path}", "train.seed=5")
    assert not (tmp_path / "a" / "checkpoints").exists() and not (tmp_path / "b" / "checkpoints").exists()  # nothing trained


def test_a_file_holding_python_objects_is_refused_unread(pairs_file, tmp_path):
    hostile = tmp_path / "hostile.npz"
    np.savez(hostile, logps=np.array([object()] * 192, dtype=object), meta=np.array("{}"))
    with pytest.raises(JaxdistError, match=r"is not a reference log-probabilities file \(Object arrays cannot be loaded"):
        _run(pairs_file, "data=1", tmp_path / "run", f"data.reference_logps={hostile}")


def test_a_resumed_run_without_its_file_is_refused(pairs_file, tmp_path):
    path, run_dir = tmp_path / "ref.npz", tmp_path / "run"
    _run(pairs_file, "data=1", run_dir, f"data.reference_logps={path}", "train.stop_after_step=1")
    path.unlink()
    with pytest.raises(JaxdistError, match="no such file, and a resumed run no longer has the initial weights it was computed from"):
        _run(pairs_file, "data=1", run_dir, f"data.reference_logps={path}")


@pytest.mark.heavy
def test_two_processes_write_the_file_once_and_train_as_one_device(pairs_file, one_device, tmp_path):
    """Each process computes its share of every batch; process 0 writes the file, the other waits for it."""
    path, run_dir = tmp_path / "ref.npz", tmp_path / "run"
    overrides = dpo_overrides(pairs_file, "train.steps=3", "train.lr=1e-2", "train.warmup_steps=0", f"data.reference_logps={path}")
    cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", "2", "--devices-per-proc", "1", "--"]
    cmd += ["--mesh", "data=2", "--run-dir", str(run_dir), *overrides]
    done = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert path.exists() and not list(tmp_path.glob(".ref.npz.partial-*"))
    _same(metrics(run_dir), one_device)
