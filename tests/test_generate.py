"""``jaxdist.generate``: KV-cached sampling against recomputing the whole sequence, the
cache's memory against its formula (XLA's own accounting), sampling rules, and bad input."""

from __future__ import annotations

import json

import hf_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist import convert
from jaxdist import generate as generate_cli
from jaxdist.config import ModelConfig
from jaxdist.inference.generation import sample
from jaxdist.models.llama import KVCache, Llama

from helpers import load_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(Hugging Face directory, converted checkpoint) of a random Llama with a word tokenizer."""
    root = tmp_path_factory.mktemp("gen")
    ref.write_random_llama(root / "hf", ref.hf_config(vocab=1000, d=64, layers=2, heads=8, kv_heads=2))
    ref.write_tokenizer(root / "hf" / "tokenizer.json", 1000)
    assert convert.main(["from-hf", str(root / "hf"), str(root / "out")]) == 0
    return root / "hf", root / "out"


def _generate(capsys, *argv: str) -> dict:
    assert generate_cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.heavy
def test_greedy_with_cache_equals_recomputing_the_sequence(checkpoint, capsys):
    hf_dir, out = checkpoint
    prompt = [int(i) for i in np.random.default_rng(3).integers(3, 1000, 24)]
    got = _generate(
        capsys, "--checkpoint", str(out), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "12", "--mesh", "tensor=2"
    )
    model, config, tensors = load_model(out), *ref.read_llama(hf_dir)
    seq, numpy_seq = list(prompt), list(prompt)
    for _ in range(12):  # no cache: the whole sequence each time, in jaxdist (eager) and in numpy
        seq.append(int(jnp.argmax(model(jnp.asarray([seq]))[0, -1])))
        numpy_seq.append(int(np.argmax(ref.logits(config, tensors, np.asarray([numpy_seq]))[0, -1])))
    assert got["ids"] == seq[len(prompt) :] == numpy_seq[len(prompt) :]
    assert got["prompt_ids"] == prompt


def test_prompt_text_goes_through_the_tokenizer(checkpoint, capsys):
    _, out = checkpoint
    got = _generate(capsys, "--checkpoint", str(out), "--prompt", "w5 w7 w9", "--max-new-tokens", "4")
    assert got["prompt_ids"] == [8, 10, 12]  # WordLevel ids: w_i is i + 3
    assert got["text"] == " ".join(f"w{i - 3}" for i in got["ids"]) and len(got["ids"]) == 4


def test_generation_stops_at_the_end_of_text_token(checkpoint, capsys, tmp_path):
    """With a tokenizer whose end-of-text word is the id greedy decoding reaches third,
    the output ends before it."""
    _, out = checkpoint
    base = ["--checkpoint", str(out), "--prompt-ids", "5,6,7", "--max-new-tokens", "8"]
    ids = _generate(capsys, *base)["ids"]
    stop = ids[3]
    assert stop not in ids[:3] and stop != 2
    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(997))]
    words[2], words[stop] = words[stop], words[2]  # "</s>" (the end-of-text word) now has id `stop`
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert _generate(capsys, *base, f"data.tokenizer={tmp_path / 'tokenizer.json'}")["ids"] == ids[:3]


def test_generation_stops_at_generation_config_eos_ids(checkpoint, capsys, tmp_path):
    """generation_config.json's eos_token_id (a list, as Llama 3's) stops decoding at the
    first of them reached, and decoding stops there rather than running --max-new-tokens."""
    import shutil

    _, out = checkpoint
    base = ["--prompt-ids", "5,6,7"]
    ids = _generate(capsys, "--checkpoint", str(out), *base, "--max-new-tokens", "8")["ids"]
    stop = ids[3]
    assert stop not in ids[:3] and 2 not in ids[:4]  # 2: config.json's and the tokenizer's end of text
    model = tmp_path / "model"
    shutil.copytree(out, model)
    (model / "hf_source" / "generation_config.json").write_text(json.dumps({"eos_token_id": [999, stop]}))
    got = _generate(capsys, "--checkpoint", str(model), *base, "--max-new-tokens", "200")
    assert got["ids"] == ids[:3] and got["decoded"] == 4
    assert got["stop_ids"] == [999, stop, 2]
    (model / "hf_source" / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    assert generate_cli.main(["--checkpoint", str(model), *base]) == 2
    assert "eos_token_id '</s>' is not a token id or a list of them" in capsys.readouterr().err


def test_decoding_ends_when_every_sequence_has_ended():
    """A batch of two: each sequence ends at its first stop id and repeats it from there;
    the loop runs until the later of the two, not to max_new_tokens."""
    from jaxdist.inference.generation import generate_ids

    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(1)))
    prompt = jnp.asarray([[5, 6, 7], [40, 41, 42]], jnp.int32)

    def run(stop_ids):
        return jax.jit(lambda p: generate_ids(nnx.merge(graphdef, p), prompt, 12, stop_ids=stop_ids))(params)

    free, steps = run(())
    free = np.asarray(free)
    assert int(steps) == 12
    stops = (int(free[0, 2]), int(free[1, 5]))
    ends = [next(k for k, t in enumerate(row) if t in stops) for row in free]
    tokens, steps = run(stops)
    tokens = np.asarray(tokens)
    assert int(steps) == max(ends) + 1 < 12
    for row, end, want in zip(tokens, ends, free, strict=True):
        np.testing.assert_array_equal(row[: end + 1], want[: end + 1])  # the same tokens up to the stop
        assert (row[end : int(steps)] == want[end]).all()  # then the stop id again


@pytest.mark.heavy
def test_sampling_is_seeded_and_top_p_keeps_the_nucleus(checkpoint, capsys):
    _, out = checkpoint
    base = ["--checkpoint", str(out), "--prompt-ids", "5,6,7", "--max-new-tokens", "16", "--temperature", "1.5"]
    first, again, other = (_generate(capsys, *base, "--seed", s)["ids"] for s in ("1", "1", "2"))
    assert first == again and first != other
    greedy = _generate(capsys, *base[:6])["ids"]
    assert _generate(capsys, *base, "--top-p", "1e-6")["ids"] == greedy  # a nucleus of one id is greedy

    # the nucleus of probabilities (0.5, 0.3, 0.15, 0.05) at top_p 0.7 is {0, 1}, renormalised to (0.625, 0.375)
    logits = jnp.log(jnp.asarray([[0.15, 0.5, 0.05, 0.3]] * 4000))
    ids = np.asarray(jax.jit(lambda k: sample(logits, k, 1.0, 0.7))(jax.random.key(0)))
    assert set(np.unique(ids)) == {1, 3}
    assert np.mean(ids == 1) == pytest.approx(0.625, abs=0.03)


def test_kv_cache_memory_is_the_formula():
    """XLA's argument bytes for one decoding step are the parameters, the token and the
    cache; the cache is 2 x layers x batch x max_len x kv_heads x head_dim x 4 bytes,
    and it is updated in place (aliased to the output) when donated."""
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=8, n_kv_heads=2)
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    batch, max_len = 3, 100
    step = jax.jit(lambda p, cache, token: nnx.merge(graphdef, p).decode(token, cache), donate_argnums=1)
    cache = KVCache.zeros(cfg, batch, max_len, jnp.float32)
    stats = step.lower(params, cache, jnp.zeros((batch, 1), jnp.int32)).compile().memory_analysis()
    formula = 2 * 3 * batch * max_len * 2 * 8 * 4
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert stats.argument_size_in_bytes - param_bytes - batch * 4 - 4 == formula  # tokens, index
    assert stats.alias_size_in_bytes >= formula


BAD = {
    "both prompts": (["--prompt", "w1", "--prompt-ids", "1"], "give exactly one of --prompt TEXT or --prompt-ids"),
    "no prompt": ([], "give exactly one of --prompt TEXT or --prompt-ids"),
    "id past the vocab": (["--prompt-ids", "3,1000"], "prompt ids [1000] are outside the model's vocab (0..999)"),
    "not ids": (["--prompt-ids", "1,x"], "expected comma-separated integers"),
    "heads vs tensor": (["--prompt-ids", "1", "--mesh", "tensor=3"], "must be divisible by the tensor axis (3)"),
    "zero tokens": (["--prompt-ids", "1", "--max-new-tokens", "0"], "need --max-new-tokens >= 1"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line(checkpoint, case, capsys):
    argv, message = BAD[case]
    assert generate_cli.main(["--checkpoint", str(checkpoint[1]), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxdist: error:") and message in err[-1]


def test_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert generate_cli.main(["--checkpoint", str(tmp_path / "none"), "--prompt-ids", "1"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
