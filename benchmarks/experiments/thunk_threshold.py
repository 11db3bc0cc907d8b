"""Experiment: the cost of a loop step on XLA:CPU jumps with the number of kernels in it.

XLA:CPU runs each computation (a `while` loop's body once per trip) through a
`ThunkExecutor`: one thunk per kernel (a fusion, a copy, a conditional, a nested
loop, a custom call). It runs them one after the other in the calling thread only
if the thunks form a chain, or all use buffers of at most 512 bytes, or there are
at most 8 of them (`ThunkExecutor::Options`, `execute_sequential_num_thunks_threshold
= 8`, fixed in `CpuExecutable::Create`, no flag). Otherwise it builds a dataflow
execution state on the heap every time the body runs, and once more than a few
thunks are ready at once it hands some to the thread pool. In a loop of small steps
that overhead is per trip, and it outweighs the kernels.

Two measurements, one run:

1. A `lax.scan` whose step updates `n` independent float32 carries of 256
   elements (`c * x + k`, one kernel each), 10000 steps: the kernels per loop body
   and the time per step.
2. The corpus body `pop` (`tests/corpus.py`, a (100, 500) buffer, 1000 steps),
   checked (the default) and with `promise_in_bounds`: the kernels of the loop
   and the time of the forward, and of the gradient's forward pass alone
   (`jax.vjp`, which also stacks the residuals). A checked read adds its index
   check to the loop: a conditional and the two scalar kernels that compute its
   predicate and its message's index.

Measured (jax 0.10.2, this project's 2-core CPU; two runs of this script, the
second's `pop` lines):

    n carries  kernels  us/step
            4        6    0.108
            5        7    0.129
            6        8    0.163
            7        9    0.677
            8       10    0.739
            9       11    3.002
           10       12    3.491
           11       13    3.567

    pop                          kernels      ms
    forward, checked                   8   0.347
    grad's forward pass, checked       11   0.984
    forward, promise                   5   0.274
    grad's forward pass, promise        8   0.429

So a kernel added to a loop body costs its own run time while the body has at most
8, about 0.5 us a step when it takes the body past 8, and 2-3 us a step past about
10 with several kernels ready at once (the executor then hands kernels to other
threads). The checked `pop`'s three extra kernels cost 0.07 ms over 1000 steps in
the forward (8 kernels: run in line) and 0.55 ms in the gradient's forward pass
(11). With the check made a no-op (a probe, not a mode), that pass took the time of
the promised one. This, not the check's own work, is why `benchmarks/corpus.py`'s
checked gradient of `pop` is twice its `promise_in_bounds` gradient (the other
bodies' gaps were not traced).

Tried: the message's index worked out inside the conditional's error branch from
one code (`code = bad ? 1 + index : 0`, the conditional's branch index, XLA running
the last branch for any index past the end), one kernel fewer per checked access
(`pop`: 8 -> 7 forward, 11 -> 10 in the gradient's forward pass). In one process,
alternating, best of 7, 1000 steps, checked, every corpus body: 0.96-1.04x the
code before on forward and gradient alike (one run's 0.57x on the
`dynamic_update_slice` gradient did not come back in two reruns: 0.99-1.02x), since
no loop crossed 8 kernels. Not kept: it needs JAX's private `_switch_internal`.

    python benchmarks/experiments/thunk_threshold.py
"""

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import corpus  # noqa: E402
from tests.tape import loop_kernels_in  # noqa: E402


def _best_ms(fn, args, repeat: int = 15, number: int = 1) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            jax.block_until_ready(fn(*args))
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e3


def independent_carries(steps: int = 10000) -> None:
    def run(cs, xs):
        def step(cs, x):
            return tuple(c * x + k for k, c in enumerate(cs)), None

        return lax.scan(step, cs, xs)[0]

    xs = jnp.linspace(0.0, 1.0, steps)
    print(f"{'n carries':>9} {'kernels':>8} {'us/step':>8}")
    for n in range(4, 12):
        cs = tuple(jnp.ones((256,)) for _ in range(n))
        compiled = jax.jit(run).lower(cs, xs).compile()
        ms = _best_ms(compiled, (cs, xs))
        print(
            f"{n:9d} {loop_kernels_in(compiled.as_text())[0]:8d} {ms / steps * 1e3:8.3f}"
        )


def checked_pop(steps: int = 1000) -> None:
    body = corpus.BODIES_BY_NAME["pop"]
    p, init, xs = corpus.make_inputs(body, 100, 500, steps)
    print(f"\n{'pop':27} {'kernels':>8} {'ms':>7}")
    for what, ops in (("checked", corpus.ESB), ("promise", corpus.ESB_PROMISE)):
        loss = corpus.make_loss(body, ops)

        def forward_pass(p, init, xs, loss=loss):
            return jax.vjp(lambda p, a: loss(p, a, xs), p, init)

        for name, fn in (("forward", loss), ("grad's forward pass", forward_pass)):
            compiled = jax.jit(fn).lower(p, init, xs).compile()
            ms = _best_ms(compiled, (p, init, xs), repeat=7, number=10)
            kernels = loop_kernels_in(compiled.as_text())[0]
            print(f"{name + ', ' + what:27} {kernels:8d} {ms:7.3f}")


if __name__ == "__main__":
    print(f"{jax.default_backend()}, jax {jax.__version__}")
    independent_carries()
    checked_pop()
