"""Fit a small mlx-lm model to a token stream: targets with real, predictable behaviour.

Random-weight targets produce noise no drafter can learn; tests and benchmarks need a target whose
greedy output follows its training text, and the hub is out of reach here. Plain next-token
cross-entropy with AdamW, on random windows of the stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np


def fit_lm(
    model: nn.Module,
    stream: Sequence[int] | np.ndarray,
    steps: int,
    batch_size: int = 8,
    seq_len: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> float:
    """Train ``model`` in place; return the mean loss of the last 10% of steps."""
    data = np.asarray(stream, dtype=np.int32)
    if len(data) < seq_len + 2:
        raise ValueError(f"token stream of {len(data)} is shorter than seq_len {seq_len} + 2")
    rng = np.random.default_rng(seed)
    warmup = max(1, steps // 20)
    schedule = optim.join_schedules(
        [optim.linear_schedule(0.0, lr, warmup), optim.cosine_decay(lr, steps - warmup, lr / 10)],
        [warmup],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def loss_fn(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    step_fn = nn.value_and_grad(model, loss_fn)
    model.train()
    losses, start = [], time.perf_counter()
    for step in range(steps):
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        win = np.stack([data[s : s + seq_len + 1] for s in starts])
        loss, grads = step_fn(model, mx.array(win[:, :-1]), mx.array(win[:, 1:]))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
        if log is not None and (step + 1) % max(1, steps // 10) == 0:
            recent = float(np.mean(losses[-max(1, steps // 10) :]))
            log(
                f"target step {step + 1}/{steps} loss {recent:.3f} ({time.perf_counter() - start:.0f}s)"
            )
    model.eval()
    return float(np.mean(losses[-max(1, steps // 10) :]))
