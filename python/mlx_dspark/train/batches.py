"""Distillation batches: which samples go together each step (deterministic, resumable epochs),
and the padded arrays of one batch with its drawn anchor positions and their targets."""

from __future__ import annotations

import numpy as np

from . import data as D
from .losses import anchor_targets


class Batches:
    """Deterministic epochs: each epoch a seeded permutation, cut into length-sorted chunks of
    `batch * 16` samples, each chunk split into batches (less padding), batches shuffled."""

    def __init__(self, samples: list[D.Sample], batch: int, seed: int):
        self.samples = samples
        self.batch = max(1, min(batch, len(samples)))
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._make(0)

    def _make(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng(self.seed * 1000003 + epoch)
        perm = rng.permutation(len(self.samples))
        chunk = self.batch * 16
        out = []
        for i in range(0, len(perm), chunk):
            part = sorted(perm[i : i + chunk].tolist(), key=lambda k: len(self.samples[k].ids))
            out += [part[j : j + self.batch] for j in range(0, len(part), self.batch)]
        rng.shuffle(out)
        return out

    def next(self) -> list[int]:
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._make(self.epoch)
        b = self._order[self.cursor]
        self.cursor += 1
        return b

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def restore(self, st: dict) -> None:
        self.epoch, self.cursor = int(st["epoch"]), int(st["cursor"])
        self._order = self._make(self.epoch)


def make_batch(samples: list[D.Sample], idx: list[int], A: int, B: int, rng: np.random.Generator):
    """Padded tokens [S, T] and per-anchor targets; anchors are drawn without replacement among
    p in [n_prompt, len-2] (the anchor and its successor are answer tokens), then sorted."""
    seqs = [samples[i] for i in idx]
    T = max(len(s.ids) for s in seqs)
    T = ((T + 15) // 16) * 16
    S = len(seqs)
    tokens = np.zeros((S, T), np.int32)
    anchors = np.zeros((S, A), np.int32)
    labels = np.zeros((S, A, B), np.int32)
    prev = np.zeros((S, A, B), np.int32)
    mask = np.zeros((S, A, B), np.float32)
    for r, s in enumerate(seqs):
        n = len(s.ids)
        tokens[r, :n] = s.ids
        cand = np.arange(s.n_prompt, n - 1)
        k = min(A, len(cand))
        if k == 0:
            continue
        pick = np.sort(rng.choice(cand, size=k, replace=False))
        anchors[r, :k] = pick
        lab, prv, m = anchor_targets(s.ids, s.n_prompt, n, pick, B)
        labels[r, :k], prev[r, :k], mask[r, :k] = lab, prv, m
    return tokens, anchors, labels, prev, mask
