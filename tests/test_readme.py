"""The README's code blocks run: its examples are in place, and its commands are
the ones the tests and CI run."""

import os
import pathlib
import re
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _blocks(language: str) -> list[str]:
    """The README's code blocks in `language`, in order."""
    text = (ROOT / "README.md").read_text()
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def _python_blocks() -> list[str]:
    return _blocks("python")


# Every command of the README's bash blocks, and where it runs under test.
COMMANDS = {
    'pip install -e ".[dev]"': "CI installs with the docs extra too (.ci/run)",
    'pip install -e ".[dev,docs]"': "what CI runs first (.ci/run)",
    "pytest": "what CI runs (.ci/run): this suite",
    "mkdocs build --strict": "tests/test_docs.py builds the site strict",
    "python -m eqx_shiftbuf.demo": "test_readme_demo_command_runs, below",
}


def _commands() -> list[str]:
    """The commands of the README's bash blocks: each line without its comment,
    split at `&&`."""
    commands = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            commands += [c.strip() for c in line.split("&&") if c.strip()]
    return commands


def test_readme_bash_blocks_hold_only_commands_run_under_test():
    commands = _commands()
    assert "python -m eqx_shiftbuf.demo" in commands, commands
    unknown = sorted(set(commands) - set(COMMANDS))
    assert not unknown, f"README commands that no test or CI step runs: {unknown}"
    # CI's own script installs and tests as the README says.
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert 'pip install -e ".[dev,docs]"' in ci and "pytest" in ci, ci


def test_readme_demo_command_runs():
    # The README's command, at the small size (the full one times 1000 steps on a
    # 1000 x 500 buffer); tests/test_demo.py checks the demo's claims in process.
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, "-m", "eqx_shiftbuf.demo", "--size", "small"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gradients agree: True" in proc.stdout, proc.stdout
    assert "forward values agree: True" in proc.stdout, proc.stdout


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
