"""What `esb.find_loop_copies` reports on a step that copies, and on its fix.

Each step reads a window of a carried buffer and inserts into it. Written with the
old buffer's storage read as a plain array (`buf.array`) after the insert, the step
keeps the old buffer alive past the insert, and XLA copies it every step; read
through the buffer, the step stays in place.

Run it by hand: `python docs/examples/copying_step.py [--size small]`.
"""

import argparse

import jax
import jax.numpy as jnp
from jax import lax

import eqx_shiftbuf as esb


SIZES = {"small": (64, 256, 100), "full": (1000, 1000, 1000)}


# --8<-- [start:steps]
def step_unordered(buf, x):
    i, j, v = x
    new = buf.insert((j, 0), v)
    # The old buffer's storage, read as a plain array after the insert: a read the
    # library does not see, which the insert cannot wait for.
    w = lax.dynamic_slice(buf.array, (i, 0), (1, 16))
    return new, w.sum()


def step_ordered(buf, x):
    i, j, v = x
    buf, w = buf.read((i, 0), (1, 16))  # read first: the insert waits for it
    buf = buf.insert((j, 0), v)
    return buf, w.sum()


def make_loss(step):
    """The loss of a scan of `step`; the copies are in its forward pass."""

    def loss(a, xs):
        buf, ys = lax.scan(step, esb.ShiftBuffer.from_array(a), xs)
        return (buf.array**2).sum() + ys.sum()

    return loss


# --8<-- [end:steps]


def main(size: str = "full") -> dict:
    rows, cols, steps = SIZES[size]
    t = jnp.arange(steps, dtype=jnp.int32)
    a, xs = jnp.ones((rows, cols)), (t % rows, t % 7, jnp.linspace(0.0, 1.0, steps))
    copies = {}
    for step in (step_unordered, step_ordered):
        loss = make_loss(step)
        found = esb.find_loop_copies(jax.jit(loss), a, xs)
        copies[step.__name__] = [str(c) for c in found]
        print(f"{step.__name__}: {len(found)} copies per step")
        for c in found:
            print(f"  - {c}")
    return copies


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    main(parser.parse_args().size)
