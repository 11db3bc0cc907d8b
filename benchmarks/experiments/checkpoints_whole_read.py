"""Experiment: how many checkpoints a checkpointed `esb.scan` should keep when its
carry is a buffer read whole every step.

Such a buffer cannot be taped (its record would be as large as storing it), so the
scan stores it at checkpoints: each store, and the load before every reversed step,
copies the whole buffer, while a rerun step costs only the step's edits (the whole
read is dead code in a rerun, which needs only the carry). Fewer checkpoints mean
fewer stores and more reruns. The step is the natural patterns' `whole_read`
(insert at a traced position, then `(w * s).sum()` of the whole buffer), 100 steps,
`promise_in_bounds`. Prints forward and gradient ms and their ratio for buffers of
512 and 4096 rows of 64 float32s and several `checkpoints`, measured in one run.

Measured (jax 0.10.2, 2-core CPU, one run):

    rows  checkpoints   fwd ms  grad ms  grad/fwd
     512      default    0.439    1.993      4.54
     512            4    0.435    1.363      3.13
     512            8    0.429    1.475      3.44
    4096      default    3.756   19.556      5.21
    4096            4    3.584   16.210      4.52
    4096            8    3.840   18.504      4.82

With the default, 13 slots for 100 steps, the reverse pass stores 75 carries and
reruns 87 steps; with 4 slots, 39 stores and 279 reruns (`_schedule.schedule`).

    python benchmarks/experiments/checkpoints_whole_read.py
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from patterns import _time  # noqa: E402  (the benchmarks' timer)

import eqx_shiftbuf as esb  # noqa: E402


MODE = "promise_in_bounds"


def _step(b, x):
    r, c, v, s = x
    b = b.insert((r, c), jnp.sin(s * v), mode=MODE)
    b, w = b.read(mode=MODE)
    return b, (w * s).sum()


def _loss(checkpoints):
    def loss(s, a, xs):
        r, c, v = xs
        b = esb.ShiftBuffer(a, axis=1)
        b, ys = esb.scan(
            _step, b, (r, c, v, jnp.broadcast_to(s, v.shape)), checkpoints=checkpoints
        )
        return ((b.array - 0.5) ** 2).mean() + ys.sum()

    return loss


def main():
    print(
        f"{'rows':>5} {'checkpoints':>12} {'fwd ms':>8} {'grad ms':>8} {'grad/fwd':>9}"
    )
    for rows in (512, 4096):
        a = jax.random.uniform(jax.random.PRNGKey(0), (rows, 64))
        t = jnp.arange(100)
        xs = (t % rows, t % 64, jnp.linspace(0.0, 1.0, 100))
        args = (jnp.float32(0.5), a, xs)
        for checkpoints in (None, 4, 8):
            f = jax.jit(_loss(checkpoints))
            g = jax.jit(jax.grad(_loss(checkpoints), argnums=(0, 1)))
            tf = min(_time(f, args, 1) for _ in range(5))
            tg = min(_time(g, args, 1) for _ in range(5))
            name = "default" if checkpoints is None else str(checkpoints)
            print(f"{rows:5} {name:>12} {tf:8.3f} {tg:8.3f} {tg / tf:9.2f}")


if __name__ == "__main__":
    main()
