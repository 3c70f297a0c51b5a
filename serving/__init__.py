"""maxdiff's HTTP service: a Ray Serve application (FastAPI ingress + batched generator replicas).

Build it with :func:`serving.app.build_app` (``serve run serving.app:build_app model=DIR`` or
``serve run configs/serve.yaml``); see docs/service.md. Importing this package does not
import JAX: only generator replicas load the pipeline.
"""

__all__ = ["build_app"]


def __getattr__(name):
    if name == "build_app":
        from serving.app import build_app

        return build_app
    raise AttributeError(name)
