"""A small digit-recognition dataset made on the spot: no download, the same bytes on every rank.

Each sample is a 16x16 grayscale image of a digit 0-9 drawn from a 5x7 bitmap font, scaled 2x,
then distorted the way handwriting varies: a random shear (slant), horizontal stroke thickening,
a random position on the canvas, random ink intensity, and Gaussian noise. The label is the
digit. It is small enough to train in seconds on a CPU and hard enough that a linear model does
noticeably worse than a small CNN, which makes it a fair stand-in for MNIST in the tutorial.

``make_digits(n, seed)`` is deterministic: the same ``(n, seed)`` gives the same arrays on
every machine (numpy's MT19937 stream).
"""

from __future__ import annotations

import numpy as np

SIZE = 16
_FONT = {
    0: [".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."],
    1: ["..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."],
    2: [".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"],
    3: ["#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."],
    4: ["...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."],
    5: ["#####", "#....", "####.", "....#", "....#", "#...#", ".###."],
    6: ["..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."],
    7: ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."],
    8: [".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."],
    9: [".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."],
}


def _glyphs() -> np.ndarray:
    """The ten digits as 14x10 float images (the 7x5 font scaled 2x)."""
    out = np.zeros((10, 14, 10), dtype=np.float32)
    for digit, rows in _FONT.items():
        bitmap = np.array([[c == "#" for c in row] for row in rows], dtype=np.float32)
        out[digit] = np.kron(bitmap, np.ones((2, 2), dtype=np.float32))
    return out


def make_digits(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples: images ``float32 [n, 1, 16, 16]`` (roughly zero-mean, unit-variance) and
    labels ``int64 [n]``."""
    rng = np.random.RandomState(seed)
    glyphs = _glyphs()
    labels = rng.randint(0, 10, size=n).astype(np.int64)
    images = np.zeros((n, SIZE, SIZE), dtype=np.float32)
    shear = rng.uniform(-0.35, 0.35, size=n)
    thick = rng.rand(n) < 0.5
    dy = rng.randint(0, SIZE - 14 + 1, size=n)
    dx = rng.randint(0, 3, size=n)
    ink = rng.uniform(0.6, 1.0, size=n).astype(np.float32)
    g = glyphs[labels]  # [n, 14, 10]
    g = np.where(thick[:, None, None], np.maximum(g, np.roll(g, 1, axis=2)), g)
    # slant: shift each row horizontally in proportion to its distance from the middle row
    shifts = np.rint(shear[:, None] * (np.arange(14) - 6.5)).astype(np.int64)  # [n, 14]
    cols = 3 + dx[:, None, None] + shifts[:, :, None] + np.arange(10)  # [n, 14, 10]
    rows = dy[:, None, None] + np.arange(14)[None, :, None] + np.zeros_like(cols)
    which = np.broadcast_to(np.arange(n)[:, None, None], cols.shape)
    keep = (cols >= 0) & (cols < SIZE)
    images[which[keep], rows[keep], cols[keep]] = (g * ink[:, None, None])[keep]
    images += rng.normal(0.0, 0.3, size=images.shape).astype(np.float32)
    images = (images - 0.2) / 0.45
    return images[:, None, :, :], labels
