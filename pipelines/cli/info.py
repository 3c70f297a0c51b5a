"""``maxdiff info``: what a model is (family, components, dtype, sizes, limits), as text or
JSON, without loading its weights."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pipelines.cli.common import _json_file, _run_config, _usage_errors

# ---------------------------------------------------------------------------------- info
COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")


CONFIG_KEYS = {
    "unet": ("sample_size", "in_channels", "block_out_channels", "transformer_layers_per_block",
             "cross_attention_dim", "addition_time_embed_dim"),
    "vae": ("block_out_channels", "latent_channels", "scaling_factor"),
    "text_encoder": ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    "text_encoder_2": ("hidden_size", "num_hidden_layers", "projection_dim", "vocab_size"),
}


def cmd_info(args) -> int:
    import jax
    import numpy as np

    from maxdiff import quantization as quantlib
    from maxdiff import single_file
    from maxdiff.checkpoint import open_weights
    from pipelines.text_to_image import TextToImagePipeline, model_root

    with _usage_errors():
        cfg = _run_config(args)
        t0 = time.perf_counter()
        pipe = TextToImagePipeline.from_config(cfg)
        root, layout, _ = model_root(Path(cfg.model), cfg.single_file_config)
    load_s = time.perf_counter() - t0
    comps = {}
    for name in [c for c in COMPONENTS if c in pipe.params]:  # SD 1.x / 2.x: one encoder
        leaves = quantlib.weights(pipe.params[name])  # a quantized weight: its int8 values
        conf = _json_file(root / name / "config.json")
        replaced = {"unet": cfg.unet, "vae": cfg.vae}.get(name)
        if replaced:
            src = open_weights(replaced)
        elif layout is not None:
            src = single_file.component_source(layout, name, conf)
        else:
            src = open_weights(root / name)
        scope = getattr(src, "scope", "")
        stored = sorted({str(src.files[src.file_of(k)].dtype(k)) for k in src.keys()
                         if k.startswith(scope)})
        comps[name] = dict(
            parameters=int(sum(int(np.prod(x.shape)) for x in leaves)),
            dtype=sorted({str(x.dtype) for x in leaves}), stored_dtype=stored,
            weights=src.describe(), **{"class": conf.get("_class_name") or
                                       (conf.get("architectures") or ["?"])[0]},
            config={k: conf[k] for k in CONFIG_KEYS[name] if k in conf})
    devices = list(pipe.mesh.devices.flat)
    report = dict(
        model=cfg.model, format=(f"single file ({layout.family.title})" if layout
                                 else "diffusers folder"),
        configs=str(root) if layout else None, unet=cfg.unet, vae=cfg.vae,
        quantization=cfg.quantization,
        scheduler=type(pipe.scheduler).__name__,
        scheduler_preset=cfg.scheduler, default_steps=pipe.default_steps,
        default_guidance=pipe.default_guidance,
        default_size=f"{pipe.default_width}x{pipe.default_height}" if pipe.default_width else None,
        vae_scale_factor=pipe.vae_scale_factor, components=comps,
        total_parameters=sum(c["parameters"] for c in comps.values()),
        devices=[f"{d.platform}:{d.id} ({d.device_kind})" for d in devices],
        local_devices=len(jax.local_devices()), load_seconds=round(load_s, 2))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model      {report['model']} ({report['format']})"
          + (f"\nconfigs    {root}" if layout else "")
          + (f"\nunet file  {cfg.unet}" if cfg.unet else "")
          + (f"\nvae        {cfg.vae}" if cfg.vae else "")
          + (f"\nquantized  {cfg.quantization} (the UNet's transformer linear layers)"
             if cfg.quantization != "none" else ""))
    print(f"scheduler  {report['scheduler']}" + (f" ({cfg.scheduler})" if cfg.scheduler else "")
          + f"; defaults: {pipe.default_steps} steps, guidance {pipe.default_guidance:g}, "
          f"size {report['default_size'] or 'none (pass --size)'}")
    print(f"devices    {len(devices)} of {report['local_devices']} local: "
          f"{', '.join(report['devices'])}")
    print(f"loaded in  {load_s:.1f}s\n")
    print(f"{'component':<16}{'class':<30}{'parameters':>14}  {'loaded as':<10}{'stored as':<12}")
    for name, c in comps.items():
        print(f"{name:<16}{c['class']:<30}{c['parameters']:>14,}  {','.join(c['dtype']):<10}"
              f"{','.join(c['stored_dtype']):<12}")
    print(f"{'total':<46}{report['total_parameters']:>14,}\n")
    for name, c in comps.items():
        conf = ", ".join(f"{k}={v}" for k, v in c["config"].items())
        print(f"{name:<16}{conf}\n{'':<16}weights: {c['weights']}")
    return 0
