"""lm-evaluation-harness on a jaxdist checkpoint (``jaxdist.inference.harness``, ``jaxdist eval
--tasks``): the adapter's log-likelihoods, rolling log-likelihoods and greedy generations
against the plain model's logits computed here (numpy log-softmax, no padding, no mesh), the
same on a ``data=2`` mesh, tasks defined in the test (YAML + local JSON Lines) through
``lm_eval.simple_evaluate``, the CLI and its bad input. Nothing is downloaded."""

from __future__ import annotations

import json
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist import eval as eval_cli
from jaxdist import train as train_cli
from jaxdist.data.tokenizers import ByteTokenizer
from jaxdist.inference import harness
from jaxdist.inference.loading import checkpoint_arg_parser, load, load_config

from helpers import GEN_TASK, MC_TASK, PROMPTS, QUESTIONS, ROLLING_TASK, TINY, load_model

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'jaxdist[eval]')")

SEQ = 64  # the model's context: train.seq_len
EOD = ByteTokenizer.eod_id


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """Offline, with the datasets library's cache in a temporary directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
        for key, value in harness.OFFLINE.items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("harness") / "run"
    overrides = [o for o in TINY if not o.startswith("train.seq_len")]
    argv = ["--run-dir", str(run), "--steps", "2", *overrides, f"train.seq_len={SEQ}", "train.eval_every=0", "checkpoint.every_steps=2"]
    assert train_cli.main(argv) == 0
    return run


@pytest.fixture(scope="module")
def model(run_dir):
    return load_model(run_dir)


@pytest.fixture(scope="module")
def scorers(run_dir):
    """{mesh: Scorer} on one device and on data=2 (batches of 4 rows)."""
    out = {}
    for mesh in ("1", "data=2"):
        _, config, step_dir = load_config(checkpoint_arg_parser("t", ""), ["--checkpoint", str(run_dir), "--mesh", mesh])
        loaded = load(config, step_dir)
        out[mesh] = harness.Scorer(loaded.trainer, loaded.params, SEQ, batch_size=4)
    return out


def lm(scorer):
    return harness.adapter(scorer, harness.HarnessText(ByteTokenizer(), name="byte"), max_gen_toks=8)


def ids(text: str) -> list[int]:
    return [int(i) for i in ByteTokenizer().encode(text)]


def logprobs(model, seq: list[int]) -> np.ndarray:
    """[len(seq), vocab] log-softmax of the plain model's logits, in numpy (float64)."""
    logits = np.asarray(model(jnp.asarray([seq], jnp.int32))[0], np.float64)
    return logits - (np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) + logits.max(-1, keepdims=True))


def reference(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    whole = [*context, *continuation][-(SEQ + 1) :]
    lp = logprobs(model, whole[:-1])
    n = len(continuation)
    rows = range(len(whole) - 1 - n, len(whole) - 1)
    return float(sum(lp[r, whole[r + 1]] for r in rows)), all(int(np.argmax(lp[r])) == whole[r + 1] for r in rows)


def greedy_text(model, context: str, max_new: int, until: str) -> str:
    seq, new = ids(context)[-(SEQ - max_new) :], []
    for _ in range(max_new):
        token = int(np.argmax(logprobs(model, seq)[-1]))
        if token == EOD:
            break
        seq.append(token)
        new.append(token)
    return ByteTokenizer().decode(new).split(until)[0]


def test_loglikelihoods_equal_the_plain_model_on_one_device_and_on_data_2(model, scorers):
    rng = np.random.default_rng(0)
    text = [bytes(rng.integers(32, 127, n, dtype=np.uint8)).decode() for n in (3, 11, 20, 37, 50, 80)]
    requests = [(ids(t), ids(" " + t[:5])) for t in text]  # 6 requests, batches of 4: two buckets; the 80 loses its start
    requests[0] = (requests[0][0], ids(" abcdefg"))
    expected = [reference(model, c, k) for c, k in requests]
    for mesh, scorer in scorers.items():
        got = scorer.loglikelihood(requests)
        np.testing.assert_allclose([g[0] for g in got], [e[0] for e in expected], atol=1e-4, err_msg=mesh)
        assert [g[1] for g in got] == [e[1] for e in expected], mesh
    # a continuation the model prefers greedily is_greedy
    context = ids("Q: why")
    first = int(np.argmax(logprobs(model, context)[-1]))
    got = scorers["data=2"].loglikelihood([(context, [first])])
    assert got[0][1] and got[0][0] == pytest.approx(reference(model, context, [first])[0], abs=1e-4)


def test_short_requests_are_packed_into_rows_and_score_as_alone(model, scorers):
    """One long request and seven short ones: packed, two documents a row at the model's 64
    tokens (the packed attention's budget), they fill one batch of 4 rows where one request a
    row took two; each scores as it does alone in a batch of its own, and as the plain model."""
    rng = np.random.default_rng(1)
    text = [bytes(rng.integers(32, 127, n, dtype=np.uint8)).decode() for n in (48, 4, 6, 7, 9, 10, 12, 5)]
    requests = [(ids(t), ids(" " + t[:3])) for t in text]
    for mesh, scorer in scorers.items():
        before = scorer.rows_scored
        packed = scorer.loglikelihood(requests)
        assert scorer.rows_scored - before == 4, mesh  # one batch of 4 rows (two batches of 4 one request a row)
        alone = [scorer.loglikelihood([request])[0] for request in requests]
        np.testing.assert_allclose([p[0] for p in packed], [a[0] for a in alone], atol=1e-5, err_msg=mesh)
        assert [p[1] for p in packed] == [a[1] for a in alone], mesh
    expected = [reference(model, c, k)[0] for c, k in requests]
    np.testing.assert_allclose([p[0] for p in packed], expected, atol=1e-4)


def test_loglikelihood_rolling_sums_the_whole_text_in_windows(model, scorers):
    short = "a short text"
    long = "".join(chr(97 + (i * 7) % 26) for i in range(150))  # three windows of 64 predictions
    requests = [types.SimpleNamespace(args=(t,)) for t in (short, long)]
    got = lm(scorers["data=2"]).loglikelihood_rolling(requests)
    seq = [EOD, *ids(short)]
    lp = logprobs(model, seq[:-1])
    assert got[0] == pytest.approx(sum(lp[i, seq[i + 1]] for i in range(len(seq) - 1)), abs=1e-4)
    seq, total = [EOD, *ids(long)], 0.0
    n = len(seq) - 1  # predictions
    for start in range(0, n, SEQ):  # predictions start..end-1, each window with the most context it can hold
        end = min(start + SEQ, n)
        lo = max(0, end - SEQ)
        lp = logprobs(model, seq[lo:end])
        total += sum(lp[j - lo, seq[j + 1]] for j in range(start, end))
    assert got[1] == pytest.approx(total, abs=1e-4)


def write_tasks(root, model=None) -> None:
    """The multiple-choice task, and the generation task whose first two answers are what greedy
    decoding gives (the others not)."""
    (root / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (root / "mc.yaml").write_text(MC_TASK.format(data=root / "mc.jsonl"))
    if model is not None:
        answers = [greedy_text(model, p, 8, "e") if k < 2 else "no such answer" for k, p in enumerate(PROMPTS)]
        (root / "gen.jsonl").write_text(
            "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(PROMPTS, answers, strict=True))
        )
        (root / "gen.yaml").write_text(GEN_TASK.format(data=root / "gen.jsonl"))


def test_a_multiple_choice_and_a_generation_task_score_what_the_plain_model_predicts(model, scorers, tmp_path):
    write_tasks(tmp_path, model)
    right = [
        int(np.argmax([reference(model, ids(f"Q: {q}\nA:"), ids(" " + choice))[0] for choice in choices])) == answer
        for q, choices, answer in QUESTIONS
    ]
    answers = [json.loads(line)["answer"] for line in (tmp_path / "gen.jsonl").read_text().splitlines()]
    matches = [greedy_text(model, p, 8, "e") == a for p, a in zip(PROMPTS, answers, strict=True)]
    got = harness.run_tasks(lm(scorers["data=2"]), ["tiny_choice", "tiny_generate"], include_path=str(tmp_path))
    assert got["tiny_choice"]["acc"] == pytest.approx(np.mean(right))
    assert got["tiny_generate"]["exact_match"] == pytest.approx(np.mean(matches)) and sum(matches) >= 2
    limited = harness.run_tasks(lm(scorers["1"]), ["tiny_choice"], include_path=str(tmp_path), limit=2)
    assert limited["tiny_choice"]["acc"] == pytest.approx(np.mean(right[:2]))


def _eval(capsys, *argv: str) -> tuple[int, str, str]:
    rc = eval_cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_command_line_writes_the_run_s_eval_file_and_refuses_bad_input(run_dir, tmp_path, capsys):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    base = ("--checkpoint", str(run_dir))
    rc, out, _ = _eval(capsys, *base, "--tasks", "tiny_choice", "--include-path", str(tasks), "--json", "--num-fewshot", "1")
    assert rc == 0
    result = json.loads(out)
    written = json.loads((run_dir / "eval" / "2.json").read_text())
    assert result["step"] == written["step"] == 2 and result["eval_file"] == str(run_dir / "eval" / "2.json")
    assert written["tasks"]["tiny_choice"]["acc"] == result["tasks"]["tiny_choice"]["acc"]
    assert 0 <= result["tasks"]["tiny_choice"]["acc"] <= 1

    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "t.yaml").write_text(
        MC_TASK.replace("tiny_choice", "wants_download").replace("dataset_path: json", "dataset_path: nonexistent-org/nonexistent")
    )
    bad = {
        "unknown task(s) no_such_task: not in lm-eval's registry nor under --include-path": (
            "--tasks",
            "no_such_task",
            "--include-path",
            str(tasks),
        ),
        "--include-path": ("--tasks", "tiny_choice", "--include-path", str(tmp_path / "missing")),
        "could not be loaded without a download": ("--tasks", "wants_download", "--include-path", str(tmp_path / "remote")),
        "--limit must be positive": ("--tasks", "tiny_choice", "--limit", "0"),
        "only apply with --tasks": ("--num-fewshot", "2"),
    }
    for message, argv in bad.items():
        rc, out, err = _eval(capsys, *base, *argv)
        errors = [line for line in err.splitlines() if line.startswith("jaxdist: error")]
        assert rc == 2 and len(errors) == 1 and message in errors[0], (argv, err)
        assert "Traceback" not in err and not out


def test_tasks_run_during_training_on_the_live_weights_as_on_the_saved_checkpoint(tmp_path, capsys):
    """``train.harness_tasks`` every ``train.harness_every`` steps on a data=2 mesh: RUN_DIR/eval/STEP.json
    and ``TASK/METRIC`` lines in metrics.jsonl at steps 2 and 4, and step 4's score equals what
    ``jaxdist eval --tasks`` gives from the checkpoint saved at step 4 (the weights reloaded, another
    path); with ``train.harness_chat_template`` the last step's score is ``jaxdist eval
    --apply-chat-template``'s on its checkpoint; an unknown task is refused in one line before the first step."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    (tasks / "rolling.jsonl").write_text("".join(json.dumps({"text": p * 3}) + "\n" for p in PROMPTS))
    (tasks / "rolling.yaml").write_text(ROLLING_TASK.format(data=tasks / "rolling.jsonl"))
    run = tmp_path / "run"
    overrides = [o for o in TINY if not o.startswith("train.seq_len")]
    harness_keys = ["train.harness_tasks=tiny_choice,tiny_rolling", f"train.harness_include_path={tasks}", "train.harness_batch_size=4"]
    argv = ["--run-dir", str(run), "--steps", "4", "--mesh", "data=2", *overrides, f"train.seq_len={SEQ}", "train.lr=0.01"]
    assert train_cli.main([*argv, *harness_keys, "train.harness_every=2", "checkpoint.every_steps=4"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scores = {line["step"]: line for line in lines if "tiny_choice/acc" in line}
    assert sorted(scores) == [2, 4]
    for step, line in scores.items():
        written = json.loads((run / "eval" / f"{step}.json").read_text())["tasks"]
        assert written["tiny_choice"]["acc"] == line["tiny_choice/acc"]
        assert written["tiny_rolling"]["bits_per_byte"] == line["tiny_rolling/bits_per_byte"] > 0
    assert scores[2]["tiny_rolling/bits_per_byte"] != scores[4]["tiny_rolling/bits_per_byte"]  # each step's own weights
    capsys.readouterr()
    names = "tiny_choice,tiny_rolling"
    rc, out, _ = _eval(capsys, "--checkpoint", str(run), "--tasks", names, "--include-path", str(tasks), "--json", "--mesh", "1")
    assert rc == 0 and json.loads(out)["step"] == 4
    reloaded = json.loads(out)["tasks"]
    assert reloaded["tiny_choice"]["acc"] == pytest.approx(scores[4]["tiny_choice/acc"])
    assert reloaded["tiny_rolling"]["bits_per_byte"] == pytest.approx(scores[4]["tiny_rolling/bits_per_byte"], rel=1e-5)

    # With the chat template: the last step's score is jaxdist eval --apply-chat-template's on its checkpoint
    (tasks / "t.jinja").write_text(CHAT)
    chat_run = tmp_path / "chat"
    chat_keys = ["train.harness_tasks=tiny_choice", f"train.harness_include_path={tasks}", "train.harness_chat_template=true"]
    assert train_cli.main(["--run-dir", str(chat_run), *argv[2:], *chat_keys, f"data.chat_template={tasks / 't.jinja'}"]) == 0
    lines = [json.loads(line) for line in (chat_run / "metrics.jsonl").read_text().splitlines()]
    chat_scores = {line["step"]: line["tiny_choice/acc"] for line in lines if "tiny_choice/acc" in line}
    assert sorted(chat_scores) == [4]  # harness_every=0: the last step only
    capsys.readouterr()
    flags = ("--tasks", "tiny_choice", "--include-path", str(tasks), "--apply-chat-template", "--json", "--mesh", "1")
    rc, out, _ = _eval(capsys, "--checkpoint", str(chat_run), *flags)
    assert rc == 0 and json.loads(out)["tasks"]["tiny_choice"]["acc"] == pytest.approx(chat_scores[4])

    refused = tmp_path / "refused"
    rc = train_cli.main(["--run-dir", str(refused), *argv[2:], "train.harness_tasks=tiny_choice,no_such_task", *harness_keys[1:]])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("jaxdist: error")]
    assert rc == 2 and len(errors) == 1 and "unknown task(s) no_such_task" in errors[0], err
    assert not (refused / "metrics.jsonl").exists()


CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}|{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def test_the_chat_template_renders_each_request_and_scores_it_as_the_plain_model(model, scorers, tmp_path):
    """--apply-chat-template: every log-likelihood request's context is the conversation rendered
    by the template (checked against jinja2 on the task's own question), and the accuracy is what
    the plain model's log-likelihoods of those rendered requests predict."""
    import jinja2

    from jaxdist.data.chat_template import find_chat_template

    write_tasks(tmp_path)
    (tmp_path / "t.jinja").write_text(CHAT)
    text = harness.HarnessText(ByteTokenizer(), find_chat_template(str(tmp_path / "t.jinja"), ""), name="byte")
    chat_lm = harness.adapter(scorers["1"], text, max_gen_toks=8)
    seen: list[tuple[str, str]] = []
    answer = chat_lm.loglikelihood

    def spy(requests, **kwargs):
        seen.extend(tuple(r.args) for r in requests)
        return answer(requests, **kwargs)

    chat_lm.loglikelihood = spy
    got = harness.run_tasks(chat_lm, ["tiny_choice"], include_path=str(tmp_path), apply_chat_template=True)
    rendered = [
        jinja2.Template(CHAT).render(messages=[{"role": "user", "content": f"Q: {q}\nA:"}], add_generation_prompt=True)
        for q, _, _ in QUESTIONS
    ]
    assert sorted({context for context, _ in seen}) == sorted(rendered)
    right = []
    for (_, choices, truth), context in zip(QUESTIONS, rendered, strict=True):
        continuations = [cont for ctx, cont in seen if ctx == context]
        assert [c.strip() for c in continuations] == choices
        scores = [reference(model, ids(context), ids(cont))[0] for cont in continuations]
        right.append(int(np.argmax(scores)) == truth)
    assert got["tiny_choice"]["acc"] == pytest.approx(np.mean(right))
    with pytest.raises(harness.JaxdistError, match="the run has no chat template"):
        harness.run_tasks(lm(scorers["1"]), ["tiny_choice"], include_path=str(tmp_path), apply_chat_template=True)
