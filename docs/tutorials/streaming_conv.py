"""Tutorial 2: a streaming causal convolution, with its delay line in `eqx.nn.State`.

A temporal convolution network (TCN) reads, at each time step, the last `K` inputs
of each layer: a delay line. Each layer keeps its delay line in a `ShiftBuffer` of
shape `(K, D)` shifted along axis 0: every step inserts the new input at row 0 (the
oldest row falls off the end) and reads the `K` taps with `read`. The buffers live
in an `eqx.nn.State`, not in the model, so that:

- the model processes one time step per call, and a stream can be cut into chunks
  processed by separate `eqx.filter_jit` calls, the state carrying the delay lines
  from one call to the next;
- training (optax's adam) updates the weights only: the delay lines are not
  parameters.

The program trains a student TCN to imitate a teacher TCN on random input, checks
that streaming in chunks gives the same output as one pass over the whole
sequence and as a plain convolution, and counts the copies in the compiled
gradient.

Run it by hand: `python docs/tutorials/streaming_conv.py [--size small]`.
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jaxtyping import Array

import eqx_shiftbuf as esb


SIZES = {
    "small": dict(k=8, d=4, hidden=16, length=128, train_steps=40, chunk=32),
    "full": dict(k=32, d=8, hidden=64, length=2000, train_steps=400, chunk=250),
}


# --8<-- [start:layer]
class CausalConv(eqx.Module):
    """`y_t = bias + sum_k weight[k] @ x_{t-k}`, one time step per call."""

    weight: Array  # (K, D_in, D_out)
    bias: Array
    index: eqx.nn.StateIndex  # the delay line: the last K inputs, newest first

    def __init__(self, k: int, d_in: int, d_out: int, *, key):
        self.weight = jax.random.normal(key, (k, d_in, d_out)) / np.sqrt(k * d_in)
        self.bias = jnp.zeros(d_out)
        self.index = eqx.nn.StateIndex(esb.ShiftBuffer.zeros((k, d_in), axis=0))

    def __call__(self, x: Array, state: eqx.nn.State):
        line = state.get(self.index)
        line = line.insert((0,), x)  # x_t at row 0; x_{t-K} falls off the end
        line, taps = line.read((0, 0), line.shape)  # taps[k] = x_{t-k}
        y = jnp.einsum("ki,kio->o", taps, self.weight) + self.bias
        return y, state.set(self.index, line)


class TCN(eqx.Module):
    conv1: CausalConv
    conv2: CausalConv

    def __init__(self, k: int, d: int, hidden: int, *, key):
        k1, k2 = jax.random.split(key)
        self.conv1 = CausalConv(k, d, hidden, key=k1)
        self.conv2 = CausalConv(k, hidden, d, key=k2)

    def __call__(self, x: Array, state: eqx.nn.State):
        h, state = self.conv1(x, state)
        y, state = self.conv2(jax.nn.gelu(h), state)
        return y, state


# --8<-- [end:layer]


# --8<-- [start:run]
def run(model: TCN, state: eqx.nn.State, xs: Array, scan=lax.scan):
    """Feed `xs` (time, D) through the model, one step at a time: `(ys, state)`."""

    def step(state, x):
        y, state = model(x, state)
        return state, y

    state, ys = scan(step, state, xs)
    return ys, state


def loss(model: TCN, state: eqx.nn.State, xs: Array, targets: Array, scan=lax.scan):
    ys, _ = run(model, state, xs, scan)
    return jnp.mean((ys - targets) ** 2)


# --8<-- [end:run]


# --8<-- [start:train]
def make_train_step(optimiser: optax.GradientTransformation):
    @eqx.filter_jit
    def train_step(model, opt_state, state, xs, targets):
        # The model's inexact arrays are its weights and biases; the delay lines
        # are in `state`, which is not differentiated and not updated.
        value, grads = eqx.filter_value_and_grad(loss)(model, state, xs, targets)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimiser.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, value

    return train_step


# --8<-- [end:train]


# --8<-- [start:stream]
@eqx.filter_jit
def stream_chunk(model: TCN, state: eqx.nn.State, chunk: Array):
    """One call per chunk; the delay lines carry over in `state`."""
    return run(model, state, chunk)


# --8<-- [end:stream]


def reference(model: TCN, xs: Array) -> Array:
    """The same network as two plain (non-streaming) causal convolutions."""

    def conv(layer: CausalConv, x: Array) -> Array:
        k = layer.weight.shape[0]
        padded = jnp.pad(x, ((k - 1, 0), (0, 0)))
        # windows[t, k] = x_{t-k}
        windows = jnp.stack(
            [padded[k - 1 - j : k - 1 - j + len(x)] for j in range(k)], 1
        )
        return jnp.einsum("tki,kio->to", windows, layer.weight) + layer.bias

    return conv(model.conv2, jax.nn.gelu(conv(model.conv1, xs)))


def main(size: str = "full") -> dict:
    dims = SIZES[size]
    k, d, hidden, length = dims["k"], dims["d"], dims["hidden"], dims["length"]
    print(
        f"TCN: 2 causal convolutions of {k} taps, {d} -> {hidden} -> {d} features; "
        f"sequences of {length} steps"
    )
    teacher, state = eqx.nn.make_with_state(TCN)(k, d, hidden, key=jax.random.key(1))
    model, _ = eqx.nn.make_with_state(TCN)(k, d, hidden, key=jax.random.key(2))
    out: dict = {}

    # What optax trains: the model's inexact arrays. No ShiftBuffer among them.
    params = eqx.filter(model, eqx.is_inexact_array)
    is_buffer = lambda x: isinstance(x, esb.ShiftBuffer)
    out["buffers_in_params"] = sum(
        map(is_buffer, jax.tree.leaves(params, is_leaf=is_buffer))
    )
    out["buffers_in_state"] = sum(
        map(is_buffer, jax.tree.leaves(state, is_leaf=is_buffer))
    )
    print(
        f"ShiftBuffers among the trained parameters: {out['buffers_in_params']}; "
        f"in the state: {out['buffers_in_state']}"
    )

    # Train on fresh random sequences.
    optimiser = optax.adam(3e-3)
    opt_state = optimiser.init(params)
    train_step = make_train_step(optimiser)
    teach = eqx.filter_jit(run)
    keys = jax.random.split(jax.random.key(0), dims["train_steps"])
    losses = []
    start = time.perf_counter()
    for i, key in enumerate(keys):
        xs = jax.random.normal(key, (length, d))
        targets, _ = teach(teacher, state, xs)
        model, opt_state, value = train_step(model, opt_state, state, xs, targets)
        losses.append(float(value))
        if i % max(1, len(keys) // 5) == 0 or i == len(keys) - 1:
            print(f"  step {i:4d}  loss {losses[-1]:.5f}")
    seconds = time.perf_counter() - start
    out["loss_first"], out["loss_last"] = losses[0], losses[-1]
    print(f"{len(keys)} adam steps in {seconds:.1f} s (with the compile)")

    # The state given to training is the initial one, untouched by adam.
    out["state_unchanged"] = all(
        bool((a == 0).all()) for a in jax.tree.leaves(eqx.filter(state, eqx.is_array))
    )

    # Stream a new sequence in chunks, one `filter_jit` call per chunk.
    xs = jax.random.normal(jax.random.key(3), (length, d))
    chunks, s = [], state
    for start_t in range(0, length, dims["chunk"]):
        ys, s = stream_chunk(model, s, xs[start_t : start_t + dims["chunk"]])
        chunks.append(ys)
    streamed = jnp.concatenate(chunks)
    whole, _ = stream_chunk(model, state, xs)
    out["stream_vs_whole"] = float(jnp.abs(streamed - whole).max())
    out["stream_vs_reference"] = float(jnp.abs(streamed - reference(model, xs)).max())
    print(
        f"streamed in chunks of {dims['chunk']}: largest difference from one pass "
        f"{out['stream_vs_whole']:.2g}, from a plain convolution "
        f"{out['stream_vs_reference']:.2g}"
    )

    # The training gradient edits the delay lines in place.
    grad = eqx.filter_grad(loss)
    targets, _ = teach(teacher, state, xs)
    line_bytes = k * min(d, hidden) * 4
    copies = esb.find_loop_copies(grad, model, state, xs, targets, min_bytes=line_bytes)
    out["grad_copies"] = len(copies)
    print(
        f"copies of a delay line per step in the gradient: {len(copies)} "
        f"({', '.join(sorted(set(c.shape for c in copies)))})"
    )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    main(parser.parse_args().size)
