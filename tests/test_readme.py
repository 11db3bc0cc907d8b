"""The README's example runs and is in place."""

import pathlib
import re


def test_readme_example_runs_without_loop_copies():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    copies = namespace["esb"].find_loop_copies(
        namespace["grad"], 1.0, namespace["rows"], namespace["cols"], namespace["xs"]
    )
    assert copies == []
