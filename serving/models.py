"""The models an application serves (docs/multi-model.md): the :class:`Catalog` that
``build_app`` makes from the serve args, which the ingress routes by and the generator
replicas load from. Light: never imports JAX.

One model (the single-model serve args: ``model``, ``config``, ``adapters``, ...) is a catalog
of one, named ``model_name`` or after its folder. A ``models`` list names several; the first is
the default, used when a request names none. Each generator replica loads models on demand
through Ray Serve's model multiplexing (``serving.generator``): the ingress sends a request
with the name as its multiplexed model id, and Ray Serve routes it to a replica that holds that
model when one can take it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from maxdiff.hub import resolve
from maxdiff.quantization import lora_problem
from pipelines.config import RunConfig, load_run_config
from serving.errors import ApiError
from serving.settings import ServeSettings
from serving.specs import AdapterSpec, ControlNetSpec


@dataclass(frozen=True)
class Served:
    """One model of the application: its name (the OpenAI and native ``model`` field), its
    run config, its per-request LoRA adapters and the ControlNets loaded with it."""

    name: str
    run_config: RunConfig
    adapters: tuple[AdapterSpec, ...] = ()
    controlnets: tuple[ControlNetSpec, ...] = ()


@dataclass(frozen=True)
class Catalog:
    """The served models, the default first. ``listed``: they came as a ``models`` list (a
    request naming no model of it is refused); else one model from the single-model args (the
    OpenAI route then ignores a ``model`` it does not know, as OpenAI clients that always send
    one, e.g. ``dall-e-3``, expect)."""

    models: tuple[Served, ...]
    listed: bool
    max_per_replica: int  # models a generator replica keeps loaded (Ray Serve's LRU)

    @classmethod
    def from_settings(cls, s: ServeSettings) -> Catalog:
        """The catalog of the serve args; a bad run config or a missing model fails here, once,
        rather than in every replica."""
        from pipelines.default_model import default_model_path

        if not s.models:
            run = load_run_config(s.config, s.run_overrides)
            if run.model is None:
                default_model_path()  # a clear error now rather than from every replica
            name = s.model_name or (Path(run.model).name if run.model else "maxdiff-default")
            _check_adapters(run, s.adapters, "serve arg adapters")
            _check_controlnets(s.controlnets, "serve arg controlnets")
            return cls((Served(name, run, s.adapters, s.controlnets),), False, 1)
        models = []
        for i, spec in enumerate(s.models):
            try:
                run = load_run_config(spec.config, spec.run_overrides)
                _check_adapters(run, spec.adapters, "adapters")
                _check_controlnets(spec.controlnets, "controlnets")
            except ValueError as e:
                raise ValueError(f"serve arg models[{i}] ({spec.name}): {e}") from None
            if run.model is None:
                default_model_path()
            models.append(Served(spec.name, run, spec.adapters, spec.controlnets))
        return cls(tuple(models), True, s.max_models_per_replica or len(models))

    @property
    def default(self) -> Served:
        return self.models[0]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def key(self, name: str) -> str:
        """Where the stats actor keeps model ``name``'s info: its name and a digest of how it
        is configured (a redeployment with other settings does not read stale info)."""
        import hashlib

        return f"{name}:{hashlib.sha256(repr(self.get(name)).encode()).hexdigest()[:16]}"

    def get(self, name: str) -> Served:
        for m in self.models:
            if m.name == name:
                return m
        raise not_found(name, self.names)

    def pick(self, requested: str | None, *, lenient: bool = False) -> str:
        """The name of the model a request asks for: ``requested``, or the default when it is
        None. A name not served is a 404 (``model_not_found``) naming the choices, unless
        ``lenient`` and the catalog is no list (then the default)."""
        if requested is None or requested in self.names:
            return requested or self.default.name
        if lenient and not self.listed:
            return self.default.name
        raise not_found(requested, self.names)


def _check_adapters(run: RunConfig, adapters, what: str) -> None:
    """Per-request adapters need the float weights: refused with a quantized model."""
    if adapters and (problem := lora_problem(run.quantization, what)) is not None:
        raise ValueError(problem)


def _check_controlnets(controlnets, what: str) -> None:
    """Each ControlNet's folder or file exists (once, here, rather than in every replica); a
    Hugging Face name (``org/name``) is found in the local cache, or downloaded."""
    for c in controlnets:
        try:
            path = resolve(c.path)
        except ValueError as e:
            raise ValueError(f"{what}: {c.name}: {e}") from None
        if not (path.is_dir() or path.is_file() and path.suffix == ".safetensors"):
            raise ValueError(f"{what}: {c.name}: {c.path}: no such folder or .safetensors file "
                             "(a diffusers ControlNet folder: config.json and its weights; or "
                             "one file, read with the model's UNet config)")


def not_found(name: str, names: list[str]) -> ApiError:
    """OpenAI's answer for a model it does not serve (404, ``model_not_found``), naming ours."""
    return ApiError(404, f"model {name!r} is not served here; choose one of: "
                    f"{', '.join(names)} (GET /v1/models lists them)", param="model",
                    code="model_not_found")
