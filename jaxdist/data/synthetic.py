"""Synthetic data with learnable structure, for tests, benchmarks and the default run.

Tokens follow a fixed random bigram chain (low-entropy successors), so a model's loss
falls from log(vocab) towards the chain's entropy. Images are class prototypes plus
noise (a colour and a coarse pattern per class, so pooled conv features separate them). Batch k is a pure function of (seed, k): independent of processes and workers.
"""

from __future__ import annotations

import numpy as np

Batch = dict[str, np.ndarray]


def _rng(seed: int, step: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, step])


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, successors: int = 4):
        rng = np.random.default_rng([seed, 7919])
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        # each token has a few likely successors with random weights
        self.next_tokens = rng.integers(0, vocab_size, size=(vocab_size, successors))
        weights = rng.dirichlet(np.ones(successors), size=vocab_size)
        self.cumulative = np.cumsum(weights, axis=1)

    def batch(self, step: int, global_batch: int, *, split: str = "train") -> Batch:
        rng = _rng(self.seed, step, 0 if split == "train" else 1)
        tokens = np.empty((global_batch, self.seq_len + 1), dtype=np.int32)
        tokens[:, 0] = rng.integers(0, self.vocab_size, size=global_batch)
        uniforms = rng.random((global_batch, self.seq_len))
        for t in range(self.seq_len):
            choice = (self.cumulative[tokens[:, t]] < uniforms[:, t : t + 1]).sum(axis=1)
            tokens[:, t + 1] = self.next_tokens[tokens[:, t], np.minimum(choice, self.next_tokens.shape[1] - 1)]
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


class SyntheticImages:
    def __init__(self, image_size: int, num_classes: int, seed: int = 0, noise: float = 1.0):
        rng = np.random.default_rng([seed, 104729])
        colour = rng.normal(size=(num_classes, 1, 1, 3))
        coarse = rng.normal(size=(num_classes, 4, 4, 3))
        pattern = np.repeat(np.repeat(coarse, -(-image_size // 4), axis=1), -(-image_size // 4), axis=2)[:, :image_size, :image_size]
        self.prototypes = (colour + pattern).astype(np.float32)
        self.num_classes, self.seed, self.noise = num_classes, seed, noise

    def batch(self, step: int, global_batch: int, *, split: str = "train") -> Batch:
        rng = _rng(self.seed, step, 0 if split == "train" else 1)
        labels = rng.integers(0, self.num_classes, size=global_batch).astype(np.int32)
        noise = rng.normal(size=(global_batch, *self.prototypes.shape[1:])).astype(np.float32)
        return {"images": self.prototypes[labels] + self.noise * noise, "labels": labels}
