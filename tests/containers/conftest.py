"""The container tests build an image and bring docker/compose.yaml up (minutes, a container engine,
root or a rootless podman): only `make test-containers` runs them (it sets SPECVOX_CONTAINERS=1), so
a plain `pytest` or `make test` does not even collect them."""

import os

collect_ignore_glob = [] if os.environ.get("SPECVOX_CONTAINERS") == "1" else ["test_*.py"]
