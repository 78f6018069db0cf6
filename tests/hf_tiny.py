"""A tiny Llama and a byte-level BPE tokenizer built by ``transformers`` and ``tokenizers``, saved
as a Hugging Face model directory (the parity tests of the ``hf`` extra: lm-eval's Hugging Face
backend, TRL's DPO). Only imported where torch and transformers are installed."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxdist.inference import harness

EOT = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a cat.",
    "Q: two and two\nA: four. Q: sky colour\nA: blue. The cat says meow, the dog says woof.",
    "def f(x): return x + 1\n1, 2, 3, 4, 5, 6, 7, 8, 9, 10. Opposite of up is down, left, right.",
]


def build_tokenizer(directory, max_length: int) -> tuple[int, int]:
    """A byte-level BPE tokenizer trained on CORPUS in ``directory`` (``tokenizer.json`` and a
    ``tokenizer_config.json`` naming its end-of-text token as eos, bos and pad): (its vocabulary
    size, the end-of-text id)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "bos_token": EOT, "pad_token": EOT}
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": max_length}))
    return tokenizer.get_vocab_size(), tokenizer.token_to_id(EOT)


def build_llama(directory, max_length: int, seed: int = 0) -> transformers.LlamaForCausalLM:
    """The tokenizer and a 2-layer Llama (grouped-query attention, a few ids the tokenizer never
    produces) saved in ``directory``, in float32."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab, eot = build_tokenizer(directory, max_length)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab + 12,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=max_length,
        initializer_range=0.15,  # peaked distributions: clear greedy choices
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


@contextlib.contextmanager
def offline_datasets(cache):
    """Nothing downloaded (the ``datasets`` library and the hub offline, its cache in ``cache``), no W&B."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_CACHE", str(cache))
        for key, value in {**harness.OFFLINE, "WANDB_MODE": "disabled"}.items():
            mp.setenv(key, value)
        yield


def build_converted(root, max_length: int):
    """``build_llama`` in ``root/hf``, imported with ``convert from-hf`` into ``root/jaxdist``: (both paths)."""
    from jaxdist import convert

    build_llama(root / "hf", max_length)
    assert convert.main(["from-hf", str(root / "hf"), str(root / "jaxdist")]) == 0
    return root / "hf", root / "jaxdist"
