import os

import hypothesis
import jax


jax.config.update("jax_enable_x64", True)

hypothesis.settings.register_profile(
    "default", deadline=None, print_blob=True, derandomize=False
)
hypothesis.settings.register_profile("ci", deadline=None, print_blob=True)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "default")
