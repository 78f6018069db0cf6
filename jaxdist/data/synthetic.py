"""Synthetic data with learnable structure, for tests, benchmarks and quick runs.

Random-access sources (``len`` and ``[i]``) that Grain reads like any other. Tokens
follow a fixed random bigram chain (a few likely successors per token), so a model's
loss falls from log(vocab) towards the chain's entropy. Images are class prototypes (a
colour and a coarse pattern per class) plus noise. Example i is a pure function of
(seed, split, i).
"""

from __future__ import annotations

import bisect
import time

import numpy as np

EXAMPLES_PER_EPOCH = 2**31 - 1  # effectively endless; the pipeline still shuffles and repeats


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, 0 if split == "train" else 1, index])


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, split: str = "train", successors: int = 4):
        rng = np.random.default_rng([seed, 7919])
        self.vocab_size, self.seq_len, self.seed, self.split = vocab_size, seq_len, seed, split
        self.next_tokens = rng.integers(0, vocab_size, size=(vocab_size, successors)).tolist()
        self.cumulative = np.cumsum(rng.dirichlet(np.ones(successors), size=vocab_size), axis=1).tolist()

    def __len__(self) -> int:
        return EXAMPLES_PER_EPOCH

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = _rng(self.seed, self.split, index)
        uniforms = rng.random(self.seq_len).tolist()
        token = int(rng.integers(0, self.vocab_size))
        tokens = [token]
        for u in uniforms:  # scalar Python: ~0.5 us a token, far below a train step
            choices = self.next_tokens[token]
            token = choices[min(bisect.bisect_left(self.cumulative[token], u), len(choices) - 1)]
            tokens.append(token)
        array = np.asarray(tokens, dtype=np.int32)
        return {"inputs": array[:-1], "targets": array[1:]}


class SyntheticImages:
    def __init__(self, image_size: int, num_classes: int, seed: int = 0, split: str = "train", noise: float = 1.0):
        rng = np.random.default_rng([seed, 104729])
        colour = rng.normal(size=(num_classes, 1, 1, 3))
        coarse = rng.normal(size=(num_classes, 4, 4, 3))
        block = -(-image_size // 4)
        pattern = np.repeat(np.repeat(coarse, block, axis=1), block, axis=2)[:, :image_size, :image_size]
        self.prototypes = (colour + pattern).astype(np.float32)
        self.num_classes, self.seed, self.split, self.noise = num_classes, seed, split, noise

    def __len__(self) -> int:
        return EXAMPLES_PER_EPOCH

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = _rng(self.seed, self.split, index)
        label = int(rng.integers(0, self.num_classes))
        image = self.prototypes[label] + self.noise * rng.normal(size=self.prototypes.shape[1:]).astype(np.float32)
        return {"images": image, "labels": np.int32(label)}


class SlowReads:
    """A source whose every read waits ``latency_s`` first: simulated slow storage, so a
    benchmark can make a run data-bound on purpose (``data.synthetic_latency_ms``)."""

    def __init__(self, source, latency_s: float):
        self.source, self.latency_s = source, latency_s

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        time.sleep(self.latency_s)
        return self.source[index]
