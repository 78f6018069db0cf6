"""lm-evaluation-harness parity with its own Hugging Face backend: the same tiny Llama (built by
transformers with a byte-level BPE tokenizer, imported with ``convert from-hf``) scored by
lm-eval's ``HFLM`` (PyTorch) and by jaxdist's adapter (``jaxdist.inference.harness``) gives the
same per-request log-likelihoods (1e-4) and greedy flags, the same generations, and the same
accuracy on a multiple-choice and a generation task run through ``lm_eval.simple_evaluate``.
Needs the ``hf`` extra (torch, transformers); without it the module skips in one line.
Nothing is downloaded."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'jaxdist[hf]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'jaxdist[hf]')")
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'jaxdist[eval]')")

from hf_tiny import build_converted, offline_datasets  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from jaxdist.data.tokenizers import load_tokenizer  # noqa: E402
from jaxdist.inference import harness  # noqa: E402
from jaxdist.inference.loading import checkpoint_arg_parser, load, load_config  # noqa: E402

from helpers import GEN_TASK, MC_TASK, PROMPTS, QUESTIONS  # noqa: E402

SEQ = 128  # what each side reads at most (the converted config's train.seq_len, HFLM's max_length)


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    with offline_datasets(tmp_path_factory.mktemp("hf_datasets")):
        yield


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """(the HF model directory, the converted jaxdist folder)."""
    return build_converted(tmp_path_factory.mktemp("harness_hf"), SEQ)


@pytest.fixture(scope="module")
def hf_lm(models_dir):
    hf_dir, _ = models_dir
    return HFLM(pretrained=str(hf_dir), tokenizer=str(hf_dir), device="cpu", dtype="float32", batch_size=4, max_length=SEQ)


@pytest.fixture(scope="module")
def jaxdist_lm(models_dir):
    _, converted = models_dir
    _, config, step_dir = load_config(
        checkpoint_arg_parser("t", ""), ["--checkpoint", str(converted), "model.dtype=float32", f"train.seq_len={SEQ}"]
    )
    tokenizer = load_tokenizer(config.data.tokenizer)
    loaded = load(config, step_dir)
    scorer = harness.Scorer(loaded.trainer, loaded.params, SEQ, batch_size=4)
    return harness.adapter(scorer, harness.HarnessText(tokenizer, name=tokenizer.name), max_gen_toks=8)


def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=k) for k, args in enumerate(arguments)]


def test_both_backends_tokenize_alike(hf_lm, jaxdist_lm):
    for text in [*PROMPTS, " meow", "Q: a cat says\nA: hiss"]:
        assert jaxdist_lm.tok_encode(text) == hf_lm.tok_encode(text), text
    assert jaxdist_lm.eot_token_id == hf_lm.eot_token_id


def test_per_request_log_likelihoods_equal_lm_evals_hugging_face_backend(hf_lm, jaxdist_lm):
    pairs = [(f"Q: {q}\nA:", f" {choice}") for q, choices, _ in QUESTIONS for choice in choices]
    pairs += [("", "The quick brown fox"), ("Once upon a time", " there was a cat.")]
    theirs = hf_lm.loglikelihood(requests("loglikelihood", pairs))
    ours = jaxdist_lm.loglikelihood(requests("loglikelihood", pairs))
    np.testing.assert_allclose([x[0] for x in ours], [x[0] for x in theirs], atol=1e-4, rtol=0)
    assert [bool(x[1]) for x in ours] == [bool(x[1]) for x in theirs]
    assert len({round(x[0], 3) for x in theirs}) > len(pairs) // 2  # the requests are told apart


def test_greedy_generations_equal_lm_evals_hugging_face_backend(hf_lm, jaxdist_lm):
    asks = [(p, {"until": ["e"], "max_gen_toks": 8, "do_sample": False}) for p in PROMPTS]
    theirs = hf_lm.generate_until(requests("generate_until", asks))
    ours = jaxdist_lm.generate_until(requests("generate_until", asks))
    assert ours == theirs and any(theirs), theirs


def test_a_multiple_choice_and_a_generation_task_score_alike(hf_lm, jaxdist_lm, tmp_path):
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "mc.yaml").write_text(MC_TASK.format(data=tmp_path / "mc.jsonl"))
    # the first two answers are what HF's greedy decoding gives, the others not: the accuracy is 2/5 only if both agree
    asks = [(p, {"until": ["e"], "max_gen_toks": 8, "do_sample": False}) for p in PROMPTS[:2]]
    greedy = hf_lm.generate_until(requests("generate_until", asks))
    answers = [*greedy, "no such", "answers"]
    (tmp_path / "gen.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(PROMPTS, answers, strict=True))
    )
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=tmp_path / "gen.jsonl"))
    tasks = ["tiny_choice", "tiny_generate"]
    theirs = harness.run_tasks(hf_lm, tasks, include_path=str(tmp_path))
    ours = harness.run_tasks(jaxdist_lm, tasks, include_path=str(tmp_path))
    assert ours["tiny_choice"]["acc"] == pytest.approx(theirs["tiny_choice"]["acc"])
    assert ours["tiny_generate"]["exact_match"] == pytest.approx(theirs["tiny_generate"]["exact_match"]) == pytest.approx(2 / 4)
