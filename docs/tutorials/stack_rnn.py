"""Tutorial 4: a stack-augmented RNN under `vmap`, pointer stack against shift stack.

A recurrent network with an external stack learns to reverse sequences of varying
length: it reads `L` tokens, pushing a learnt vector at each, then, for `L` more
steps, pops and outputs the token it pushed last. The push and pop of each step
come from the input (each sequence of the batch has its own length, so under
`jax.vmap` different sequences push and pop at the same step); what is pushed,
and how a popped vector is read out, are learnt, with optax's adam.

Two layouts of the same stack, with the same model and step:

- **pointer stack**: an array of rows and a pointer; a push writes one row at the
  pointer (`dynamic_update_slice`) and moves it up; a pop reads the row below it
  and moves it down. Each step touches one row: O(1) in the capacity.
- **shift stack**: a `ShiftBuffer` whose row 0 is the top; a push is
  `insert((0,), v)` and a pop reads row 0 and deletes it (`delete((0,))`); both
  shift the whole stack: O(capacity) per step, in place.

Both are written without branches (a `lax.cond` on the carry copies it): every step
does the same accesses, at positions chosen with `jnp.where`.

Run it by hand: `python docs/tutorials/stack_rnn.py [--size small]`.
"""

from __future__ import annotations

import argparse
import math
import re
import time
import timeit

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array

import eqx_shiftbuf as esb


SIZES = {
    "small": dict(vocab=6, max_len=8, width=32, batch=16, train_steps=80),
    "full": dict(vocab=10, max_len=24, width=64, batch=64, train_steps=400),
}
PUSH, POP, IDLE = 0, 1, 2


# --8<-- [start:stacks]
class PointerStack(eqx.Module):
    """Rows `1..pointer-1` hold the stack (row 0 is an empty bottom)."""

    rows: esb.ShiftBuffer  # (capacity + 2, width); only overwritten, never shifted
    pointer: Array

    @staticmethod
    def empty(capacity: int, width: int) -> PointerStack:
        return PointerStack(esb.ShiftBuffer.zeros((capacity + 2, width)), jnp.int32(1))

    def top(self) -> tuple[PointerStack, Array]:
        rows, top = self.rows.read((self.pointer - 1, 0), (1, self.rows.shape[1]))
        return PointerStack(rows, self.pointer), top[0]

    def apply(self, op: Array, value: Array) -> PointerStack:
        # Always write at the pointer: above the top, so a pop or an idle step
        # overwrites nothing live; a push then keeps the row by moving up.
        rows = self.rows.dynamic_update_slice(value[None], (self.pointer, 0))
        move = jnp.where(op == PUSH, 1, jnp.where(op == POP, -1, 0))
        return PointerStack(rows, self.pointer + move)


class ShiftStack(eqx.Module):
    """Row 0 is the top; what a pop shifts in at the end is a zero row."""

    rows: esb.ShiftBuffer  # (capacity + 1, width), shifted along axis 0

    @staticmethod
    def empty(capacity: int, width: int) -> ShiftStack:
        return ShiftStack(esb.ShiftBuffer.zeros((capacity + 1, width), axis=0))

    def top(self) -> tuple[ShiftStack, Array]:
        rows, top = self.rows.read((0, 0), (1, self.rows.shape[1]))
        return ShiftStack(rows), top[0]

    def apply(self, op: Array, value: Array) -> ShiftStack:
        # A pop deletes row 0; otherwise the (unused) last row goes. A push
        # inserts at row 0; otherwise `value` lands in the unused last row.
        last = self.rows.capacity - 1
        rows = self.rows.delete((jnp.where(op == POP, 0, last),))
        rows = rows.insert((jnp.where(op == PUSH, 0, last),), value)
        return ShiftStack(rows)


# --8<-- [end:stacks]


# --8<-- [start:model]
class StackRNN(eqx.Module):
    embed: Array  # (vocab + 1, width): the last token is "blank"
    cell: eqx.nn.GRUCell
    push: eqx.nn.Linear
    readout: eqx.nn.Linear

    def __init__(self, vocab: int, width: int, *, key):
        k = jax.random.split(key, 4)
        self.embed = jax.random.normal(k[0], (vocab + 1, width))
        self.cell = eqx.nn.GRUCell(2 * width, width, key=k[1])
        self.push = eqx.nn.Linear(width, width, key=k[2])
        self.readout = eqx.nn.Linear(2 * width, vocab, key=k[3])

    def __call__(self, stack, tokens: Array, ops: Array, scan=lax.scan):
        """One sequence: logits at every step. `stack` is an empty stack."""

        def step(carry, inputs):
            stack, h = carry
            token, op = inputs
            stack, top = stack.top()
            h = self.cell(jnp.concatenate([self.embed[token], top]), h)
            stack = stack.apply(op, jnp.tanh(self.push(h)))
            return (stack, h), self.readout(jnp.concatenate([h, top]))

        h0 = jnp.zeros(self.cell.hidden_size)
        _, logits = scan(step, (stack, h0), (tokens, ops))
        return logits


# --8<-- [end:model]


# --8<-- [start:loss]
def loss(model: StackRNN, empty, tokens, ops, targets, scan=lax.scan):
    """Cross-entropy on the pop steps, over a batch (`jax.vmap`)."""
    logits = jax.vmap(lambda t, o: model(empty, t, o, scan))(tokens, ops)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)
    popping = ops == POP
    return -(logp[..., 0] * popping).sum() / popping.sum()


# --8<-- [end:loss]


@jax.jit(static_argnums=(1, 2, 3))
def make_batch(key, batch: int, vocab: int, max_len: int):
    """Tokens, ops and targets (batch, 2 * max_len): read L tokens, then output
    them reversed, with L from 1 to max_len."""
    k1, k2 = jax.random.split(key)
    lengths = jax.random.randint(k1, (batch, 1), 1, max_len + 1)
    symbols = jax.random.randint(k2, (batch, 2 * max_len), 0, vocab)
    t = jnp.arange(2 * max_len)
    tokens = jnp.where(t < lengths, symbols, vocab).astype(jnp.int32)  # vocab: blank
    ops = jnp.where(t < lengths, PUSH, jnp.where(t < 2 * lengths, POP, IDLE))
    source = jnp.clip(2 * lengths - 1 - t, 0, 2 * max_len - 1)  # the pushed token
    targets = jnp.take_along_axis(symbols, source, 1).astype(jnp.int32)
    return tokens, ops.astype(jnp.int32), targets


# --8<-- [start:data_parallel]
def make_train_step(optimiser):
    @jax.jit  # the model, its optimiser state and the stacks hold only arrays
    def train_step(model, opt_state, empty, tokens, ops, targets):
        value, grads = eqx.filter_value_and_grad(loss)(
            model, empty, tokens, ops, targets
        )
        updates, opt_state = optimiser.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    return train_step


def data_parallel(train_step, model, opt_state, empty, data, devices):
    """One training step with the batch split over `devices`: each device runs
    the loss, the stacks and the gradient of its own sequences; the gradient is
    summed over devices (an all-reduce of the parameters' size).

    The mesh's axis is `Auto`: XLA propagates the batch's sharding through the
    model. (With `Explicit` axes, JAX asks the embedding lookup `self.embed[token]`
    for the sharding of its result.)"""
    mesh = jax.make_mesh(
        (len(devices),), ("batch",), devices=devices, axis_types=(AxisType.Auto,)
    )
    data = jax.device_put(data, NamedSharding(mesh, P("batch")))
    replicated = NamedSharding(mesh, P())
    model, opt_state, empty = jax.device_put((model, opt_state, empty), replicated)
    compiled = train_step.lower(model, opt_state, empty, *data).compile()
    return compiled(model, opt_state, empty, *data), compiled


# --8<-- [end:data_parallel]


def check_data_parallel(size: str = "small") -> dict:
    """The data-parallel step against the same step on one device, on as many
    devices as divide the batch: its loss and updated model, and the collectives
    that move data between devices other than by summing (all-gather, all-to-all,
    collective-permute), which would mean a stack crossed devices."""
    dims = SIZES[size]
    vocab, max_len, width = dims["vocab"], dims["max_len"], dims["width"]
    devices = jax.devices()[: math.gcd(len(jax.devices()), dims["batch"])]
    model = StackRNN(vocab, width, key=jax.random.key(0))
    optimiser = optax.adam(3e-3)
    opt_state = optimiser.init(model)
    empty = ShiftStack.empty(max_len, width)
    data = make_batch(jax.random.key(3), dims["batch"], vocab, max_len)
    train_step = make_train_step(optimiser)
    one = train_step(model, opt_state, empty, *data)
    many, compiled = data_parallel(train_step, model, opt_state, empty, data, devices)
    hlo = compiled.as_text()
    stacks_bytes = dims["batch"] // len(devices) * (max_len + 1) * width * 4
    moves = re.findall(r"= \S+ (all-gather|all-to-all|collective-permute)[(-]", hlo)
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(one[::2]), jax.tree.leaves(many[::2]))
    )
    return dict(
        devices=len(devices),
        max_difference=diff,
        moves=len(moves),
        all_reduces=len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo)),
        # The stacks of one device's sequences: the compiled program is per device.
        copies=len(esb.find_loop_copies(compiled, min_bytes=stacks_bytes)),
    )


def accuracy(model, empty, tokens, ops, targets) -> float:
    logits = jax.vmap(lambda t, o: model(empty, t, o))(tokens, ops)
    right = (jnp.argmax(logits, -1) == targets) & (ops == POP)
    return float(right.sum() / (ops == POP).sum())


def time_ms(fn, args, size: str) -> float:
    call = lambda: jax.block_until_ready(fn(*args))
    call()
    timer = timeit.Timer(call)
    number, repeat = (3, 2) if size == "small" else (timer.autorange()[0], 5)
    return min(timer.repeat(number=number, repeat=repeat)) / number * 1e3


def main(size: str = "full") -> dict:
    dims = SIZES[size]
    vocab, max_len, width = dims["vocab"], dims["max_len"], dims["width"]
    batch = dims["batch"]
    print(
        f"reverse sequences of 1 to {max_len} tokens (vocabulary {vocab}); GRU and "
        f"stack width {width}; batches of {batch}, under jax.vmap"
    )
    out: dict = {}
    stacks = {
        "pointer": PointerStack.empty(max_len, width),
        "shift": ShiftStack.empty(max_len, width),
    }
    test = make_batch(jax.random.key(99), 256, vocab, max_len)
    print(
        f"{'stack':<8} {'grad ms':>8} {'copies':>6} {'train s':>8} {'loss':>7} "
        f"{'accuracy':>8}"
    )
    for name, empty in stacks.items():
        model = StackRNN(vocab, width, key=jax.random.key(0))
        optimiser = optax.adam(3e-3)
        opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))

        train_step = make_train_step(optimiser)

        data = make_batch(jax.random.key(1), batch, vocab, max_len)
        # A `jax.jit` function (the model and the stacks hold only arrays): the
        # copies are counted in the program that was timed, compiled once.
        grad = jax.jit(lambda *args: eqx.filter_grad(loss)(*args))
        ms = time_ms(grad, (model, empty, *data), size)
        # Copies of at least the batch of stacks, inside the compiled loops.
        stacks_bytes = batch * (max_len + 1) * width * 4
        copies = esb.find_loop_copies(grad, model, empty, *data, min_bytes=stacks_bytes)
        start = time.perf_counter()
        for key in jax.random.split(jax.random.key(2), dims["train_steps"]):
            data = make_batch(key, batch, vocab, max_len)
            model, opt_state, value = train_step(model, opt_state, empty, *data)
        seconds = time.perf_counter() - start
        acc = accuracy(model, empty, *test)
        out[name] = dict(
            grad_ms=ms,
            grad_copies=len(copies),
            copy_shapes=sorted({c.shape for c in copies}),
            train_s=seconds,
            loss=float(value),
            accuracy=acc,
        )
        print(
            f"{name:<8} {ms:>8.2f} {len(copies):>6d} {seconds:>8.1f} "
            f"{float(value):>7.3f} {acc:>8.1%}"
        )
    out["shift_over_pointer"] = out["shift"]["grad_ms"] / out["pointer"]["grad_ms"]
    print(
        f"gradient time, shift stack / pointer stack: {out['shift_over_pointer']:.2f}x"
    )
    if size == "small" and len(jax.devices()) == 1:
        # On one device the step is the same program: `tests/test_sharding.py`
        # runs `check_data_parallel` on 4 (the tests run the small size).
        return out
    dp = out["data_parallel"] = check_data_parallel(size)
    print(
        f"data-parallel training step (shift stack) on {dp['devices']} device(s): "
        f"largest difference from one device {dp['max_difference']:.1e}; "
        f"{dp['moves']} collectives that move data (all-gather, all-to-all, "
        f"collective-permute), {dp['all_reduces']} all-reduces (the gradient's "
        f"sum); {dp['copies']} loop copies of the stacks"
    )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    main(parser.parse_args().size)
