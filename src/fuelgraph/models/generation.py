"""The decode loop shared by the language models: prefill once, then one token per step,
greedy or sampled on the host from the last position's logits."""
from __future__ import annotations

import sys
import time

import numpy as np

from ..errors import FuelGraphError
from ..ir.tensor import Tensor, _leaf
from ..runtime.executor import realize_raw


def replay_greedy(run, first: Tensor, n: int, bar=None):
    """n greedy steps replayed without call bookkeeping: `run(raw tokens [B]) -> raw next
    tokens` (a captured decode step), starting from the tokens `first` [B]. Returns (the last
    raw tokens, the n outputs as one [B, n] tensor); `bar` advances once a step."""
    prev, outs = realize_raw([first])[0], []
    for _ in range(n):
        prev = run(prev)
        outs.append(prev)
        if bar is not None:
            bar.update(1)
    if isinstance(prev, np.ndarray):
        rest = np.stack(outs, 1)
    else:                                   # a device buffer (torch on the CUDA backend)
        import torch
        rest = torch.stack(outs, 1)
    return prev, _leaf(rest, first.dtype, first.device, False)


def as_ids(input_ids) -> np.ndarray:
    """input_ids (a NumPy array, list or integer Tensor, [B, S] or [S]) -> int64 [B, S]."""
    a = input_ids.numpy() if isinstance(input_ids, Tensor) else np.asarray(input_ids)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[1] < 1 or a.dtype.kind not in "iu":
        raise FuelGraphError(f"generate: input_ids must be integer token ids [B, S] with S >= 1, "
                             f"got {a.dtype} {a.shape}")
    return a.astype(np.int64)


def pick(logits: np.ndarray, do_sample: bool, temperature: float, top_k, top_p,
         rng: np.random.Generator) -> np.ndarray:
    """Next token of each row of logits [B, V]: argmax (first maximum, as torch), or a draw
    from softmax(logits / temperature) restricted to the top_k tokens and to the smallest set
    whose probability reaches top_p."""
    logits = np.asarray(logits, np.float64)
    if not do_sample:
        return logits.argmax(-1)
    if temperature <= 0:
        raise FuelGraphError(f"generate: temperature must be > 0, got {temperature}")
    z = logits / temperature
    if top_k is not None and 0 < top_k < z.shape[-1]:
        kth = np.sort(z, -1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, -1, kind="stable")
        sp = np.take_along_axis(p, order, -1)
        drop = np.cumsum(sp, -1) - sp >= top_p          # tokens after the mass is reached
        sp[drop] = 0.0
        p = np.zeros_like(p)
        np.put_along_axis(p, order, sp, -1)
        p /= p.sum(-1, keepdims=True)
    u = rng.random((p.shape[0], 1))
    return np.minimum((np.cumsum(p, -1) < u).sum(-1), p.shape[-1] - 1)


class GenerationMixin:
    """`generate` for a model that implements `_prefill(ids, max_new, greedy) -> (state, out)`,
    `_decode_step(state, tokens [B]) -> out` and `_release(state)`: `out` is a tensor, the last
    position's logits [B, V], or with greedy=True the next tokens [B] (an argmax the model
    computed in its step, so only B ids come back to the host). `tokens` is a NumPy array,
    or in greedy decoding the previous step's `out` tensor itself (left on its device)."""

    def generate(self, input_ids, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id=None, seed: int | None = None,
                 progress: bool = False) -> np.ndarray:
        """Token ids [B, S + max_new_tokens] (NumPy int64): the prompt, then tokens chosen one at
        a time (greedy with do_sample=False; else sampled with temperature, top_k, top_p from
        a NumPy generator seeded by `seed`). The prompt is run once (prefill), then each new
        token is one decode step over the model's cache. A sequence that emits eos_token_id
        (an int or a list of ints) continues with that token until all have finished, when
        the loop stops early."""
        ids = as_ids(input_ids)
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise FuelGraphError(f"generate: max_new_tokens must be an int >= 0, got "
                                 f"{max_new_tokens!r}")
        if max_new_tokens == 0:
            return ids
        eos = None if eos_token_id is None else np.atleast_1d(np.asarray(eos_token_id))
        rng = np.random.default_rng(seed)
        bar = _bar(progress, max_new_tokens)
        state, step_out = self._prefill(ids, max_new_tokens, not do_sample)
        out = [ids]
        done = np.zeros(ids.shape[0], bool)
        try:
            if not do_sample and eos is None:
                return np.concatenate(out + self._greedy_queued(state, step_out,
                                                                max_new_tokens, bar), 1)
            for i in range(max_new_tokens):
                got = step_out.numpy()
                tok = got if got.ndim == 1 else pick(got, do_sample, temperature, top_k, top_p,
                                                     rng)
                if eos is not None:
                    tok = np.where(done, out[-1][:, -1] if i else tok, tok)
                    done |= np.isin(tok, eos)
                out.append(tok[:, None].astype(np.int64))
                if bar is not None:
                    bar.update(1)
                if i + 1 == max_new_tokens or (eos is not None and done.all()):
                    break
                step_out = self._decode_step(state, tok)
        finally:
            self._release(state)
            if bar is not None:
                bar.close()
        return np.concatenate(out, 1)

    def _greedy_queued(self, state, step_out: Tensor, n: int, bar) -> list:
        """Greedy decoding with nothing to stop on: each step's next tokens [B] (computed in
        the step) feed the next step where they are, so on the GPU the host queues steps
        without waiting for one to finish; the ids come to the host once, at the end."""
        steps = self._queue_greedy(state, step_out, n, bar)
        b = step_out.shape[0]
        return [t.numpy().reshape(b, -1).astype(np.int64) for t in steps]

    def _queue_greedy(self, state, step_out: Tensor, n: int, bar) -> list:
        """The next tokens of n greedy steps (the first is step_out), queued on the device:
        tensors [B] or [B, k] (k steps), in order. A model may replace it with a faster loop."""
        steps = [step_out]
        for _ in range(n - 1):
            steps.append(self._decode_step(state, steps[-1]))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.update(1)
        return steps


def _bar(progress, total):
    """tqdm's bar when tqdm is installed, else a plain one on stderr."""
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainBar(total)
    return tqdm(total=total, desc="generating", unit="tok", leave=False)


class _PlainBar:
    def __init__(self, total):
        self.total, self.n, self.t0 = total, 0, time.perf_counter()

    def update(self, k):
        self.n += k
        done = int(30 * self.n / max(self.total, 1))
        rate = self.n / max(time.perf_counter() - self.t0, 1e-9)
        sys.stderr.write(f"\rgenerating [{'#' * done}{'.' * (30 - done)}] {self.n}/{self.total} "
                         f"({rate:.1f} tok/s)")
        sys.stderr.flush()

    def close(self):
        sys.stderr.write("\r" + " " * 72 + "\r")
        sys.stderr.flush()
