"""Sampler names: :mod:`maxdiff.sampler_names` under its older path (the same module object).

The table lives outside :mod:`maxdiff.schedulers` because it is plain Python: the service's
ingress and the CLI's argument parser check sampler names without importing JAX, which this
package's ``__init__`` does."""

import sys

from maxdiff import sampler_names

sys.modules[__name__] = sampler_names
