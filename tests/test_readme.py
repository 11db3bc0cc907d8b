"""The README's example runs and is in place."""

import pathlib
import re


def _python_blocks() -> list[str]:
    """The README's python code blocks, in order."""
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_example_runs_without_loop_copies():
    blocks = _python_blocks()
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    copies = namespace["esb"].find_loop_copies(
        namespace["grad"], 1.0, namespace["rows"], namespace["cols"], namespace["xs"]
    )
    assert copies == []


def test_readme_read_example_runs_without_loop_copies():
    blocks = _python_blocks()
    namespace: dict = {}
    exec(compile(blocks[1], "README.md", "exec"), namespace)
    jnp, esb = namespace["jnp"], namespace["esb"]
    copies = esb.find_loop_copies(
        namespace["grad"], jnp.ones((64, 256)), namespace["xs"], min_bytes=32768
    )
    assert copies == []


def test_readme_scan_example_matches_lax_scan():
    blocks = _python_blocks()
    namespace: dict = {}
    exec(compile(blocks[2], "README.md", "exec"), namespace)
    jax, jnp, esb = namespace["jax"], namespace["jnp"], namespace["esb"]
    w, h0 = 0.5 * jnp.eye(namespace["d"]), jnp.ones(namespace["d"])
    # The same loss on lax.scan.
    namespace["esb"] = type(
        "M",
        (),
        {"scan": staticmethod(lambda f, init, xs, buffers: jax.lax.scan(f, init, xs))},
    )
    want = jax.grad(namespace["loss"])(w, h0)
    namespace["esb"] = esb
    got = namespace["grad"](w, h0)
    assert jnp.allclose(got, want, rtol=1e-6, atol=1e-8)
    assert esb.find_loop_copies(namespace["grad"], w, h0) == []
