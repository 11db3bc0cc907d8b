"""Every corpus body and natural pattern under `jax.vmap`: time against plain `lax`.

    python benchmarks/vmap.py [--set corpus,natural] [--names insert,one_d]
                              [--batch 8] [--repeat 5]

A user who batches a model over examples runs each step under `jax.vmap`: a batch
of buffers, one per example, each edited at its own indices. For each body of
`tests/corpus.py` (a `(100, 64)` buffer, 300 steps) and each row of
`tests/natural.py` (its own buffer, 100 steps), with the per-step inputs batched
(`--batch` sequences; the natural rows' own batch of 4) and the initial buffer
shared, it prints the forward (`jax.vmap(loss)`) and gradient
(`jax.vmap(jax.grad(loss))`) time of the library with `promise_in_bounds` over
plain `lax`'s for the same step (measured in one run, batches interleaved), and
`work`: the instructions of the library's compiled forward loop that make an array
as large as the whole batch of buffers other than by updating one in place
(`tests/tape.py`'s `loop_buffer_work`: copies, broadcasts, full-size fusions). A
per-step copy is one such instruction, but so is a buffer-sized broadcast or
gather, which `esb.find_loop_copies` does not report.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jax


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from patterns import _time  # noqa: E402  (the benchmarks' timer)

from tests import corpus, natural  # noqa: E402
from tests.tape import loop_buffer_work  # noqa: E402


def _corpus_case(name: str, batch: int):
    body = corpus.BODIES_BY_NAME[name]
    p, init, xs = corpus.make_inputs(body, 100, 64, 300)
    args = (p, init, corpus.batch_xs(xs, batch))
    fns = {}
    for version, ops in (("lib", corpus.ESB_PROMISE), ("plain", corpus.PLAIN)):
        loss = corpus.make_loss(body, ops)
        fns[version, "vmap"] = jax.vmap(loss, in_axes=(None, None, 0))
        grad = jax.grad(loss, argnums=(0, 1))
        fns[version, "vmap(grad)"] = jax.vmap(grad, in_axes=(None, None, 0))
    return fns, args, batch * init.size


def _natural_case(name: str):
    row = natural.ROWS_BY_NAME[name]
    args = natural.args_for(row, "vmap", 100)
    fns = {}
    for version, ops in (("lib", corpus.ESB_PROMISE), ("plain", natural.PLAIN)):
        loss = natural.make_loss(row, ops)
        for mode in ("vmap", "vmap(grad)"):
            fns[version, mode] = natural.program(mode, loss, row.batch_init)
    return fns, args, natural.BATCH * math.prod(row.shape)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--set", default="corpus,natural")
    ap.add_argument("--names", default=None, help="bodies or rows (default: all)")
    ap.add_argument("--batch", type=int, default=8, help="corpus bodies' batch")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)

    cases = []
    for which in a.set.split(","):
        if which == "corpus":
            names = [b.name for b in corpus.BODIES]
        else:
            names = list(natural.ROWS_BY_NAME)
        if a.names:
            names = [n for n in a.names.split(",") if n in names]
        cases += [(which, n) for n in names]
    print(
        f"library (promise_in_bounds) / plain lax under vmap; "
        f"{jax.default_backend()}, jax {jax.__version__}"
    )
    print(f"{'set':8} {'name':22} {'vmap':>6} {'v(grad)':>7} {'work':>5}")
    for which, name in cases:
        if which == "corpus":
            fns, args, size = _corpus_case(name, a.batch)
        else:
            fns, args, size = _natural_case(name)
        jitted = {k: jax.jit(f) for k, f in fns.items()}
        work = loop_buffer_work(fns["lib", "vmap"], args, size)
        best = {k: float("inf") for k in jitted}
        for _ in range(a.repeat):  # interleaved, so a slow spell hits all a little
            for k, f in jitted.items():
                best[k] = min(best[k], _time(f, args, 1))
        ratio = {m: best["lib", m] / best["plain", m] for m in ("vmap", "vmap(grad)")}
        print(
            f"{which:8} {name:22} {ratio['vmap']:6.2f} {ratio['vmap(grad)']:7.2f}"
            f" {len(work):5d}",
            flush=True,
        )


if __name__ == "__main__":
    main()
