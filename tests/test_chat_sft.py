"""``data.source=chat``: supervised fine-tuning on conversations.

The assistant mask against positions counted by hand; the per-token loss of a packed chat
batch against ``transformers``' loss on each conversation alone, with transformers' own
assistant mask (where torch is installed); the README's flow (from-hf -> train on chat ->
generate --chat -> to-hf) teaching a random Llama a mapping it could not know; bad input in
one line; the overflow counts; the data order by seed and its resume.
"""

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
from jaxdist import train as train_cli
from jaxdist.config import load_config
from jaxdist.data.batches import make_iterator
from jaxdist.data.chat import chat_splits
from jaxdist.data.chat_template import ChatTemplate
from jaxdist.data.sources import resolve_vocab
from jaxdist.data.tokenizers import load_tokenizer
from jaxdist.errors import JaxdistError
from jaxdist.inference.generation import chat_prompt, compile_generate
from jaxdist.inference.loading import checkpoint_arg_parser, load
from jaxdist.inference.loading import load_config as load_checkpoint_config

from helpers import data_layout, load_model

# A byte-level template small enough to count by hand: "u:hi;a:yo;" (role initial, ':', content, ';').
BYTE_TEMPLATE = "{% for m in messages %}{{ m.role[0] }}:{{ m.content }};{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
BYTE_TEMPLATE_MARKED = (
    "{% for m in messages %}{{ m.role[0] }}:{% if m.role == 'assistant' %}{% generation %}{{ m.content }};{% endgeneration %}"
    "{% else %}{{ m.content }};{% endif %}{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)
# A Llama-like word template: "<s>user : k3 </s> assistant : v7 </s> ..." (the generation-block
# version renders the same text; transformers masks with it)
WORD_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }} : {{ m.content }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
WORD_TEMPLATE_MARKED = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }} : {% if m.role == 'assistant' %}{% generation %}{{ m.content }} "
    "{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }} {{ eos_token }}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
KEYS = 12
WORDS = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":", *(f"k{i}" for i in range(KEYS)), *(f"v{i}" for i in range(KEYS))]
ANSWER = [int(i) for i in np.random.default_rng(7).permutation(KEYS)]  # the task: user "k{i}" -> assistant "v{ANSWER[i]}"


def write_jsonl(path, conversations) -> str:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return str(path)


def chat(*turns: str) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def chat_config(path: str, *overrides: str):
    config = load_config(None, ["data.source=chat", f"data.path={path}", "train.global_batch=4", "train.seq_len=32", *overrides])
    resolve_vocab(config)
    return config


def write_word_tokenizer(folder, template: str = WORD_TEMPLATE) -> str:
    """tokenizer.json (WordLevel over WORDS, <s> and </s> special) and a tokenizer_config.json
    carrying the chat template and the special tokens, as a Hugging Face model folder has them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder / "tokenizer.json")


# ---------------------------------------------------------------------------------------------
# the mask


@pytest.mark.parametrize("template", [BYTE_TEMPLATE, BYTE_TEMPLATE_MARKED], ids=["prefixes", "generation-blocks"])
def test_assistant_mask_against_positions_counted_by_hand(tmp_path, template):
    """Bytes: "u:hi;a:yo;u:ok;a:no!;" -- the assistant's text is "yo;" (bytes 7-9) and "no!;"
    (bytes 17-20), ';' closing its turn included; target i is token i + 1."""
    (tmp_path / "t.jinja").write_text(template)
    path = write_jsonl(tmp_path / "c.jsonl", [chat("hi", "yo", "ok", "no!")] * 2)
    train, _ = chat_splits(chat_config(path, f"data.chat_template={tmp_path / 't.jinja'}", "data.eval_fraction=0.5"))
    example = train[0]
    text = b"u:hi;a:yo;u:ok;a:no!;"
    n = len(text) - 1
    assert bytes(example["inputs"][:n].astype(np.uint8)) == text[:-1] and bytes(example["targets"][:n].astype(np.uint8)) == text[1:]
    assistant_bytes = {7, 8, 9, 17, 18, 19, 20}
    want = np.zeros(32, np.float32)
    want[[i - 1 for i in assistant_bytes]] = 1
    np.testing.assert_array_equal(example["loss_mask"], want)
    np.testing.assert_array_equal(example["segment_ids"], [0] * n + [1] * (32 - n))  # the padding: a segment of its own
    np.testing.assert_array_equal(example["positions"], [*range(n), *range(32 - n)])

    everything, _ = chat_splits(
        chat_config(path, f"data.chat_template={tmp_path / 't.jinja'}", "data.eval_fraction=0.5", "data.loss_on=all")
    )
    np.testing.assert_array_equal(everything[0]["loss_mask"], [1.0] * n + [0.0] * (32 - n))


def test_a_multibyte_character_and_a_straddling_token_belong_to_the_assistant():
    """A token holding any character of the assistant's text is the assistant's: both bytes of
    'é', and in word tokens a token that starts before the span and ends inside it."""
    from jaxdist.data.chat import tokens_in_loss

    text = "ab|cé|d"
    spans = [(3, 5)]  # "cé"
    byte_offsets = np.array([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [4, 5], [5, 6], [6, 7]])  # é: two bytes
    np.testing.assert_array_equal(tokens_in_loss(text, spans, byte_offsets), [0, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(tokens_in_loss(text, spans, np.array([[0, 4], [4, 7]])), [1, 1])
    np.testing.assert_array_equal(tokens_in_loss(text, spans, np.array([[0, 3], [5, 7], [3, 3]])), [0, 0, 1])


def test_packing_keeps_conversations_whole_in_their_own_segments(tmp_path):
    """20, 12, 9 and 7 targets in rows of 32 (best fit, longest first): [20, 12], [9, 7];
    every conversation's tokens in order, positions from 0, one segment each."""
    conversations = [chat("a" * k, "b") for k in (14, 6, 3, 1)]  # "u:" + k + ";a:b;": k + 7 bytes, k + 6 targets
    path = write_jsonl(tmp_path / "c.jsonl", [*conversations, chat("x", "y")])
    (tmp_path / "t.jinja").write_text(BYTE_TEMPLATE)
    train, evaluation = chat_splits(chat_config(path, f"data.chat_template={tmp_path / 't.jinja'}", "data.eval_fraction=0.2"))
    assert len(train) == 2 and len(evaluation) == 1
    for row, lengths in zip((train[0], train[1]), ([20, 12], [9, 7]), strict=True):
        at = 0
        for segment, n in enumerate(lengths):
            assert (row["segment_ids"][at : at + n] == segment).all() and (row["positions"][at : at + n] == np.arange(n)).all()
            assert row["inputs"][at] == ord("u") and row["targets"][at + n - 1] == ord(";")
            at += n
        assert at == sum(lengths) and row["loss_mask"][at:].sum() == 0


def test_gzipped_json_lines_and_parquet_read_as_plain_json_lines(tmp_path):
    import gzip

    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet needs pyarrow (the storage extra)")
    import pyarrow as pa

    (tmp_path / "t.jinja").write_text(BYTE_TEMPLATE)
    conversations = [chat(f"q{i}", f"a{i}") for i in range(6)]
    write_jsonl(tmp_path / "plain.jsonl", conversations)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "a.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps({"messages": c}) + "\n" for c in conversations[:3]).encode())
    )
    pq.write_table(pa.table({"messages": conversations[3:], "id": [3, 4, 5]}), tmp_path / "z" / "b.parquet", row_group_size=2)

    def rows(path: str):
        train, evaluation = chat_splits(chat_config(path, f"data.chat_template={tmp_path / 't.jinja'}"))
        return [train[i] for i in range(len(train))] + [evaluation[i] for i in range(len(evaluation))]

    for a, b in zip(rows(str(tmp_path / "plain.jsonl")), rows(str(tmp_path / "z")), strict=True):
        assert all((a[k] == b[k]).all() for k in a)


# ---------------------------------------------------------------------------------------------
# bad input: one line each


def _error(tmp_path, lines: list[str], *overrides: str, template: str | None = BYTE_TEMPLATE) -> str:
    (tmp_path / "c.jsonl").write_text("".join(line + "\n" for line in lines))
    if template is not None:
        (tmp_path / "t.jinja").write_text(template)
        overrides = (f"data.chat_template={tmp_path / 't.jinja'}", *overrides)
    with pytest.raises(JaxdistError) as raised:
        chat_splits(chat_config(str(tmp_path / "c.jsonl"), *overrides))
    message = str(raised.value)
    assert "\n" not in message and len(message) < 400, message
    return message


GOOD = json.dumps({"messages": chat("hi", "yo")})


@pytest.mark.parametrize(
    "lines, template, expected",
    [
        ([GOOD, json.dumps({"text": "hi"}), GOOD], BYTE_TEMPLATE, "c.jsonl: record 2: no field 'messages'"),
        ([GOOD, json.dumps({"messages": [{"role": "robot", "content": "x"}]})], BYTE_TEMPLATE, "record 2: messages[0] has role 'robot'"),
        ([json.dumps({"messages": [{"role": "user", "content": 3}]})], BYTE_TEMPLATE, "messages[0] content is int, not a string"),
        ([GOOD, "{not json"], BYTE_TEMPLATE, "record 2: not JSON"),
        ([GOOD, GOOD], "{{ raise_exception('Conversation roles must alternate') }}", "refused the conversation"),
        ([GOOD, GOOD], "{% for m in messages %}{{ m.content }", "line 1: unexpected '}'"),
        ([GOOD, GOOD], "{{ cycler.__init__.__globals__.os.popen('id').read() }}", "the sandbox refused it"),
        ([GOOD, GOOD], "{% for m in messages %}{% if loop.last %}!{% endif %}{{ m.content }}{% endfor %}", "cannot be masked"),
    ],
    ids=["no messages", "unknown role", "content not text", "not JSON", "template raises", "syntax", "sandbox", "unmaskable"],
)
def test_bad_input_is_one_line(tmp_path, lines, template, expected):
    assert expected in _error(tmp_path, lines, template=template)


def test_train_refuses_bad_chat_data_before_writing_anything(tmp_path, capsys):
    (tmp_path / "t.jinja").write_text(BYTE_TEMPLATE)
    path = write_jsonl(tmp_path / "c.jsonl", [chat("hi", "yo"), [{"role": "robot", "content": "x"}]])
    argv = ["--run-dir", str(tmp_path / "run"), "--steps", "1", "data.source=chat", f"data.path={path}"]
    assert train_cli.main([*argv, f"data.chat_template={tmp_path / 't.jinja'}", "model.n_layers=1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxdist: error:")]
    assert len(errors) == 1 and "c.jsonl: record 2: messages[0] has role 'robot'" in errors[0], errors
    assert not (tmp_path / "run").exists()


def test_a_missing_template_is_one_line(tmp_path):
    assert "no chat template: the tokenizer is byte-level" in _error(tmp_path, [GOOD, GOOD], template=None)
    assert "no such file" in _error(tmp_path, [GOOD, GOOD], f"data.chat_template={tmp_path / 'nope.jinja'}", template=None)
    tokenizer = write_word_tokenizer(tmp_path / "tok", template="")
    assert "has no chat_template.jinja and no chat_template in tokenizer_config.json" in _error(
        tmp_path, [GOOD, GOOD], f"data.tokenizer={tokenizer}", template=None
    )


def test_a_template_linked_from_outside_the_tokenizer_folder_is_refused(tmp_path):
    tokenizer = write_word_tokenizer(tmp_path / "tok", template="")
    (tmp_path / "secret.txt").write_text("not a template")
    (tmp_path / "tok" / "chat_template.jinja").symlink_to(tmp_path / "secret.txt")
    message = _error(tmp_path, [GOOD, GOOD], f"data.tokenizer={tokenizer}", template=None)
    assert "chat_template.jinja leads outside the folder" in message


def test_the_unmaskable_template_trains_on_everything_and_bad_records_can_be_skipped(tmp_path, capsys):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{% if loop.last %}!{% endif %}{{ m.content }};{% endfor %}")
    bad = json.dumps({"messages": [{"role": "robot", "content": "x"}]})
    path = write_jsonl(tmp_path / "c.jsonl", [chat("hi", "yo")] * 3)
    (tmp_path / "c.jsonl").write_text((tmp_path / "c.jsonl").read_text() + bad + "\n")
    train, _ = chat_splits(chat_config(path, f"data.chat_template={tmp_path / 't.jinja'}", "data.loss_on=all", "data.bad_records=skip"))
    assert bytes(train[0]["inputs"][:5].astype(np.uint8)) == b"hi;!y"
    said = capsys.readouterr().err
    assert "skipped 1 bad record(s)" in said and "record 4: messages[0] has role 'robot'" in said


# ---------------------------------------------------------------------------------------------
# overflow


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_overflow_counts(tmp_path, capsys, overflow):
    """seq_len 32 (33 tokens kept): 3 conversations over it and 4 of 11 bytes; one of the long
    ones has its assistant text past the cut (left out when cut)."""
    long_reply = chat("q" * 5, "r" * 30)  # "u:" 5 ";a:" 30 ";" = 41 bytes; the assistant's from byte 10
    late_reply = chat("q" * 33, "r")  # 40 bytes; the assistant's byte is 38: past the 33 kept
    short = chat("q", "r" * 4)
    conversations = [long_reply, long_reply, late_reply, *[short] * 4]
    path = write_jsonl(tmp_path / "c.jsonl", conversations)
    (tmp_path / "t.jinja").write_text(BYTE_TEMPLATE)
    train, evaluation = chat_splits(
        chat_config(path, f"data.chat_template={tmp_path / 't.jinja'}", f"data.chat_overflow={overflow}", "data.eval_fraction=0.2")
    )
    said = capsys.readouterr().err
    rows = [train[i] for i in range(len(train))] + [evaluation[i] for i in range(len(evaluation))]
    slots = sum(int((r["inputs"] != 0).sum()) for r in rows)  # padding is id 0, never a byte of this text
    if overflow == "truncate":
        assert "7 conversations (3 cut to train.seq_len=32, 1 left out with no assistant token after the cut)" in said
        assert slots == 2 * 32 + 4 * 10  # two cut to 32 targets, four of 10
    else:
        assert "7 conversations (3 longer than train.seq_len=32 dropped, 0 left out with no assistant token)" in said
        assert slots == 4 * 10


# ---------------------------------------------------------------------------------------------
# the data order: by seed, resumable


def test_batches_follow_the_seed_and_resume(tmp_path):
    (tmp_path / "t.jinja").write_text(BYTE_TEMPLATE)
    rng = np.random.default_rng(0)
    path = write_jsonl(tmp_path / "c.jsonl", [chat(*(f"m{rng.integers(1000)}" for _ in range(4))) for _ in range(60)])
    layout = data_layout("data=2,fsdp=2")

    def batches(seed: int, steps: int, state=None):
        config = chat_config(path, f"data.chat_template={tmp_path / 't.jinja'}", f"train.seed={seed}", "train.global_batch=8")
        iterator = make_iterator(config, layout)
        try:
            if state is not None:
                iterator.set_state(state)
            out = [jax.device_get(next(iterator)) for _ in range(steps)]
            return out, iterator.get_state()
        finally:
            iterator.close()

    first, _ = batches(0, 4)
    again, _ = batches(0, 4)
    other, _ = batches(1, 1)
    _, state = batches(0, 2)
    resumed, _ = batches(0, 2, state)
    for a, b in zip(first, again, strict=True):
        assert all((a[k] == b[k]).all() for k in a)
    assert not (first[0]["inputs"] == other[0]["inputs"]).all()
    for a, b in zip(first[2:], resumed, strict=True):
        assert all((a[k] == b[k]).all() for k in a)


# ---------------------------------------------------------------------------------------------
# the flow: from-hf -> train on chat -> generate --chat -> to-hf


def mapping_chats(n: int, seed: int) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, KEYS, (n, 2))
    return [chat(f"k{a}", f"v{ANSWER[a]}", f"k{b}", f"v{ANSWER[b]}") for a, b in keys]


def greedy_answers(checkpoint) -> list[str]:
    """The first word the model answers to each key, all keys in one batch."""
    _, config, step_dir = load_checkpoint_config(checkpoint_arg_parser("test", ""), ["--checkpoint", str(checkpoint)])
    tokenizer = load_tokenizer(config.data.tokenizer)
    prompts = np.asarray([chat_prompt(config, tokenizer, chat(f"k{i}"))[1] for i in range(KEYS)], np.int32)  # the model's template
    loaded = load(config, step_dir)
    tokens, _ = compile_generate(loaded, prompts.shape, 1, 0.0, 1.0)(loaded.params, prompts, jax.random.key(0))
    return [tokenizer.decode([int(t)]) for t in np.asarray(tokens)[:, 0]]


@pytest.fixture(scope="module")
def sft_flow(tmp_path_factory):
    """A random Llama with a word tokenizer and a chat template in its tokenizer_config.json,
    converted, then fine-tuned on the mapping task through the train CLI."""
    root = tmp_path_factory.mktemp("sft")
    ref.write_random_llama(root / "hf", ref.hf_config(vocab=len(WORDS), d=64, layers=2, heads=4, kv_heads=2, mlp=128, scaling=None))
    write_word_tokenizer(root / "hf")
    assert convert.main(["from-hf", str(root / "hf"), str(root / "llama")]) == 0
    data = write_jsonl(root / "chats.jsonl", mapping_chats(400, seed=0))
    argv = [
        *("--config", str(root / "llama" / "config.yaml"), "--init-from", str(root / "llama"), "--mesh", "data=2"),
        *("--run-dir", str(root / "run"), "--steps", "30", "--log-every", "1"),
        *("data.source=chat", f"data.path={data}", "train.seq_len=32", "train.global_batch=16", "train.lr=1e-2"),
        *("train.warmup_steps=5", "train.eval_every=0", "checkpoint.every_steps=30", "model.dtype=float32"),
    ]
    assert train_cli.main(argv) == 0
    return root


def test_sft_learns_a_mapping_it_could_not_know(sft_flow):
    before = greedy_answers(sft_flow / "llama")
    after = greedy_answers(sft_flow / "run")
    want = [f"v{ANSWER[i]}" for i in range(KEYS)]
    assert sum(a == w for a, w in zip(before, want, strict=True)) <= 2, before
    assert sum(a == w for a, w in zip(after, want, strict=True)) >= KEYS - 1, after
    losses = [json.loads(line)["loss"] for line in (sft_flow / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses[0] > 1.0 and losses[-1] < 0.1, losses


def test_generate_chat_and_messages_use_the_template(sft_flow, capsys, tmp_path):
    def generate(*argv: str) -> dict:
        assert generate_cli.main(["--checkpoint", str(sft_flow / "run"), "--max-new-tokens", "4", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    got = generate("--chat", "k3")
    assert got["chat_prompt"] == "<s>user : k3 </s> assistant : "
    assert got["text"] == f"v{ANSWER[3]}" and got["decoded"] == 2  # the answer, then </s>: a stop id
    (tmp_path / "m.json").write_text(json.dumps({"messages": chat("k1", f"v{ANSWER[1]}", "k5")}))
    assert generate("--messages", str(tmp_path / "m.json"))["text"] == f"v{ANSWER[5]}"
    # a checkpoint not trained on chat data (data.source=stdlib), a template given as a key: used, and not warned about
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant : ")
    argv = ["--chat", "k3", f"data.chat_template={tmp_path / 't.jinja'}", "data.source=stdlib", "train.momentum=0.5"]
    assert generate_cli.main(["--checkpoint", str(sft_flow / "run"), "--max-new-tokens", "4", "--json", *argv]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["chat_prompt"] == "user : k3 assistant : "
    no_effect = [x for x in err.splitlines() if "has no effect" in x]
    assert len(no_effect) == 1 and "train.momentum=0.5" in no_effect[0], err  # the others are still said
    (tmp_path / "bad.json").write_text(json.dumps(chat("k1", "v1")))
    assert generate_cli.main(["--checkpoint", str(sft_flow / "run"), "--messages", str(tmp_path / "bad.json")]) == 2
    assert "ends with the assistant's message" in capsys.readouterr().err


def test_to_hf_keeps_the_chat_template(sft_flow):
    out = sft_flow / "exported"
    assert convert.main(["to-hf", str(sft_flow / "run"), str(out)]) == 0
    assert (out / "chat_template.jinja").read_text() == WORD_TEMPLATE
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == WORD_TEMPLATE


# ---------------------------------------------------------------------------------------------
# against transformers (torch and transformers: the hf extra)


def test_per_token_loss_equals_transformers(tmp_path):
    """A packed row of two conversations: each target's loss, the mask, and the mean over the
    masked targets equal transformers' on each conversation alone, masked by transformers'
    own ``return_assistant_tokens_mask`` (the {% generation %} version of the template)."""
    torch = pytest.importorskip("torch", reason="needs torch (the hf extra)")
    transformers = pytest.importorskip("transformers", reason="needs transformers (the hf extra)")
    from tokenizers import Tokenizer

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=128, initializer_range=0.2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.save_pretrained(tmp_path / "hf")
    write_word_tokenizer(tmp_path / "hf")
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0

    conversations = [chat("k1", "v4", "k2", "v9"), chat("k7", "v0"), chat("k5", "v5")]
    path = write_jsonl(tmp_path / "c.jsonl", conversations)
    config = load_config(str(tmp_path / "out" / "config.yaml"), ["data.source=chat", f"data.path={path}", "train.seq_len=32"])
    config.data.eval_fraction = 0.3
    resolve_vocab(config)
    train, _ = chat_splits(config)
    row = train[0]
    jax_model = load_model(tmp_path / "out")
    batch = {k: jnp.asarray(v[None]) for k, v in row.items()}
    logits = np.asarray(jax_model(batch["inputs"], batch["positions"], batch["segment_ids"]))[0, :, : len(WORDS)]
    losses = -jax.nn.log_softmax(logits)[np.arange(32), row["targets"]]
    loss_sum, weight, _ = nnx.jit(lambda m, b: m.loss(b))(jax_model, batch)

    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")), bos_token="<s>", eos_token="</s>"
    )
    hf_tokenizer.chat_template = WORD_TEMPLATE_MARKED
    all_ids, all_labels, at = [], [], 0
    for segment, conversation in enumerate(conversations[:2]):  # the two that the row packs (longest first, in file order)
        encoded = hf_tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = encoded["input_ids"], np.asarray(encoded["assistant_masks"], bool)
        n = len(ids) - 1
        assert (row["segment_ids"][at : at + n] == segment).all()
        np.testing.assert_array_equal(row["inputs"][at : at + n], ids[:-1])
        np.testing.assert_array_equal(row["loss_mask"][at : at + n], mask[1:])
        with torch.no_grad():
            hf_logits = model(torch.tensor([ids])).logits[0, :-1].double()
        hf_losses = torch.nn.functional.cross_entropy(hf_logits, torch.tensor(ids[1:]), reduction="none").numpy()
        np.testing.assert_allclose(losses[at : at + n][mask[1:]], hf_losses[mask[1:]], atol=1e-5, rtol=0)
        all_ids.append(ids)
        all_labels.append([i if m else -100 for i, m in zip(ids, mask, strict=True)])
        at += n
    width = max(map(len, all_ids))
    pad = [[0] * (width - len(ids)) for ids in all_ids]
    with torch.no_grad():
        hf_mean = model(
            torch.tensor([i + p for i, p in zip(all_ids, pad, strict=True)]),
            labels=torch.tensor([lab + [-100] * len(p) for lab, p in zip(all_labels, pad, strict=True)]),
        ).loss
    np.testing.assert_allclose(float(loss_sum / weight), float(hf_mean), atol=1e-5, rtol=0)


def test_the_exported_template_is_what_transformers_applies(sft_flow):
    transformers = pytest.importorskip("transformers", reason="needs transformers (the hf extra)")
    out = sft_flow / "exported-for-transformers"
    assert convert.main(["to-hf", str(sft_flow / "run"), str(out)]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    conversation = chat("k1", "v2", "k3")
    want = ChatTemplate("t", WORD_TEMPLATE, (("bos_token", "<s>"), ("eos_token", "</s>"))).render(conversation, True)
    assert tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == want
