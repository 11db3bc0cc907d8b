"""Tutorial 3: an attention decoder with a KV cache, trained, then generating.

A one-layer attention decoder reads one token per step. Each step writes the key
and value of its token into a cache at the step's position
(`dynamic_update_slice` at a moving position) and attends over the cache (read
with `read`, future positions masked). The same step function serves training
(teacher forcing: a `scan` over the sequence) and greedy generation.

The task: each sequence repeats a random block of `period` tokens; after the first
block every token is predictable by attending `period - 1` positions back. The model
is trained with optax's adam; then it is given the first block and generates the
rest greedily.

The cache is carried through the scan. Under `lax.scan`, reverse mode saves what
each step read, the whole cache, at every step: gradient memory grows with the
square of the length. A checkpointed `esb.scan` stores about `sqrt(2 * length)`
carries and reruns steps instead. The program measures both (temporary memory of
the compiled gradient, from `memory_analysis()`, and time).

Run it by hand: `python docs/tutorials/kv_cache.py [--size small]`.
"""

from __future__ import annotations

import argparse
import time
import timeit

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jaxtyping import Array

import eqx_shiftbuf as esb


SIZES = {
    "small": dict(vocab=8, period=4, length=24, d=16, batch=8, train_steps=100),
    "full": dict(vocab=16, period=8, length=128, d=64, batch=16, train_steps=250),
}


# --8<-- [start:model]
class Decoder(eqx.Module):
    embed: Array  # (vocab, d)
    position: Array  # (length, d)
    qkv: Array  # (d, 3d)
    out: Array  # (d, d)
    unembed: Array  # (d, vocab)

    def __init__(self, vocab: int, length: int, d: int, *, key):
        k = jax.random.split(key, 5)
        self.embed = jax.random.normal(k[0], (vocab, d))
        self.position = jax.random.normal(k[1], (length, d))
        self.qkv = jax.random.normal(k[2], (d, 3 * d)) / np.sqrt(d)
        self.out = jax.random.normal(k[3], (d, d)) / np.sqrt(d)
        self.unembed = jax.random.normal(k[4], (d, vocab)) / np.sqrt(d)

    def empty_cache(self, batch: int) -> esb.ShiftBuffer:
        """Keys and values of every position: (batch, length, 2d)."""
        length, d = self.position.shape
        return esb.ShiftBuffer.zeros((batch, length, 2 * d))

    def step(self, cache: esb.ShiftBuffer, tokens: Array, t: Array):
        """Read `tokens` (batch,) at position `t`: `(cache, logits)`."""
        length, d = self.position.shape
        x = self.embed[tokens] + self.position[t]  # (batch, d)
        q, k, v = jnp.split(x @ self.qkv, 3, axis=-1)
        kv = jnp.concatenate([k, v], axis=-1)[:, None]  # (batch, 1, 2d)
        cache = cache.dynamic_update_slice(kv, (0, t, 0))  # write at position t
        cache, kvs = cache.read()  # every position; carry on with `cache`
        keys, values = kvs[..., :d], kvs[..., d:]
        scores = jnp.einsum("bd,btd->bt", q, keys) / np.sqrt(d)
        scores = jnp.where(jnp.arange(length) <= t, scores, -jnp.inf)  # causal
        attended = jnp.einsum("bt,btd->bd", jax.nn.softmax(scores), values)
        h = x + attended @ self.out
        return cache, h @ self.unembed


# --8<-- [end:model]


# --8<-- [start:loss]
def loss(model: Decoder, tokens: Array, period: int, scan=esb.scan):
    """Next-token cross-entropy after the first block, teacher forced."""
    batch, length = tokens.shape

    def step(cache, inputs):
        t, tok = inputs
        return model.step(cache, tok, t)

    steps = jnp.arange(length - 1, dtype=jnp.int32)
    _, logits = scan(step, model.empty_cache(batch), (steps, tokens.T[:-1]))
    logits = logits[period - 1 :]  # (time, batch, vocab): predictions of block 2 on
    targets = tokens.T[period:]
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, targets[..., None], -1).mean()


# --8<-- [end:loss]


# --8<-- [start:generate]
@eqx.filter_jit
def generate(model: Decoder, prompt: Array, length: int):
    """Greedy decoding: feed `prompt` (batch, p), then the model's own tokens."""
    batch, p = prompt.shape

    def step(carry, t):
        cache, previous = carry
        tok = jnp.where(t < p, prompt[:, jnp.minimum(t, p - 1)], previous)
        cache, logits = model.step(cache, tok, t)
        nxt = jnp.argmax(logits, -1).astype(prompt.dtype)
        return (cache, nxt), tok

    init = (model.empty_cache(batch), prompt[:, 0])
    _, tokens = lax.scan(step, init, jnp.arange(length, dtype=jnp.int32))
    return tokens.T


# --8<-- [end:generate]


def make_batch(key, batch: int, vocab: int, period: int, length: int) -> Array:
    block = jax.random.randint(key, (batch, period), 0, vocab, dtype=jnp.int32)
    return jnp.tile(block, (1, -(-length // period)))[:, :length]


def measure(fn, args, size: str):
    """Compiled temporary memory (MiB) and best time of one call (ms) of the
    `jax.jit` function `fn`."""
    compiled = fn.lower(*args).compile()
    memory = compiled.memory_analysis()
    mib = memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")
    call = lambda: jax.block_until_ready(compiled(*args))
    call()
    timer = timeit.Timer(call)
    number, repeat = (3, 2) if size == "small" else (timer.autorange()[0], 5)
    return mib, min(timer.repeat(number=number, repeat=repeat)) / number * 1e3


def main(size: str = "full") -> dict:
    dims = SIZES[size]
    vocab, period, length, d = dims["vocab"], dims["period"], dims["length"], dims["d"]
    batch = dims["batch"]
    print(
        f"decoder: vocabulary {vocab}, width {d}, sequences of {length} tokens "
        f"repeating a block of {period}; batches of {batch}; cache "
        f"{batch} x {length} x {2 * d} float32"
    )
    model = Decoder(vocab, length, d, key=jax.random.key(0))
    out: dict = {}

    # Gradient memory and time: lax.scan against a checkpointed esb.scan.
    tokens = make_batch(jax.random.key(1), batch, vocab, period, length)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    print(f"{'gradient with':<14} {'temp MiB':>9} {'ms':>8}")
    grads = {}
    for name, scan in [("lax.scan", lax.scan), ("esb.scan", esb.scan)]:

        def grad(params, tokens, scan=scan):
            m = eqx.combine(params, static)
            return jax.grad(lambda m: loss(m, tokens, period, scan))(m)

        grads[name] = jax.jit(grad)
        mib, ms = measure(grads[name], (params, tokens), size)
        out[name] = dict(temp_mib=mib, ms=ms)
        print(f"{name:<14} {mib:>9.2f} {ms:>8.2f}")
    a, b = out["lax.scan"], out["esb.scan"]
    out["memory_ratio"] = b["temp_mib"] / a["temp_mib"]
    out["time_ratio"] = b["ms"] / a["ms"]
    print(
        f"esb.scan / lax.scan: memory {out['memory_ratio']:.3f}x, "
        f"time {out['time_ratio']:.2f}x"
    )
    # In the esb.scan gradient just measured (compiled once for both).
    cache_bytes = batch * length * 2 * d * 4
    copies = esb.find_loop_copies(
        grads["esb.scan"], params, tokens, min_bytes=cache_bytes // 2
    )
    out["grad_copies"] = len(copies)
    print(f"copies of the cache per step in the esb.scan gradient: {len(copies)}")

    # Train with adam (the model's arrays are its parameters: the cache is made
    # inside the loss, not stored in the model).
    optimiser = optax.adam(1e-2)
    opt_state = optimiser.init(params)

    @eqx.filter_jit
    def train_step(model, opt_state, tokens):
        value, grads = eqx.filter_value_and_grad(loss)(model, tokens, period)
        updates, opt_state = optimiser.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    keys = jax.random.split(jax.random.key(2), dims["train_steps"])
    start = time.perf_counter()
    for i, key in enumerate(keys):
        tokens = make_batch(key, batch, vocab, period, length)
        model, opt_state, value = train_step(model, opt_state, tokens)
        if i % max(1, len(keys) // 5) == 0 or i == len(keys) - 1:
            print(f"  step {i:4d}  loss {float(value):.4f}")
    out["loss_last"] = float(value)
    print(f"{len(keys)} adam steps in {time.perf_counter() - start:.1f} s")

    # Greedy generation from the first block of new sequences.
    truth = make_batch(jax.random.key(3), 64, vocab, period, length)
    generated = generate(model, truth[:, :period], length)
    out["accuracy"] = float((generated[:, period:] == truth[:, period:]).mean())
    print(f"greedy generation from the first block: {out['accuracy']:.1%} correct")
    print("  prompt    ", " ".join(map(str, np.asarray(truth[0, :period]))))
    shown = np.asarray(generated[0, period : 4 * period])
    print("  generated ", " ".join(map(str, shown)), "...")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    main(parser.parse_args().size)
