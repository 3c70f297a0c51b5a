"""maxdiff's HTTP service: a Ray Serve application (FastAPI ingress + batched generator replicas).

Build it with :func:`serving.app.build_app` (``serve run serving.app:build_app model=DIR`` or
``serve run configs/serve.yaml``); see docs/service.md. Importing this package does not
import JAX: only generator replicas load the pipeline.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported on first use (below): the package alone imports neither Ray nor JAX
    from serving.app import build_app

__all__ = ["build_app"]


def __getattr__(name):
    if name == "build_app":
        from serving.app import build_app

        return build_app
    raise AttributeError(name)
