"""Tiny random checkpoints written by diffusers / transformers themselves (``save_pretrained``).

No hub access here, so the tests build every checkpoint they read: small configs of the
real architectures, random weights from a fixed torch seed, and a small byte-level BPE
vocabulary in the CLIP tokenizer format. Used by the test suite only (imports torch).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from maxdiff.tokenizers import bytes_to_unicode

# Words that get merged into whole tokens, so prompts tokenize into a mix of words and bytes.
_WORDS = ["a", "the", "red", "blue", "green", "circle", "square", "on", "photo", "of", "cat",
          "dog", "background", "small", "large", "white", "black", "triangle", "astronaut"]


def _vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    chars = list(bytes_to_unicode().values())
    vocab_list = chars + [c + "</w>" for c in chars]
    merges: list[str] = []
    for w in _WORDS:
        pieces = list(w[:-1]) + [w[-1] + "</w>"]
        while len(pieces) > 1:
            merges.append(f"{pieces[0]} {pieces[1]}")
            vocab_list.append(pieces[0] + pieces[1])
            pieces = [pieces[0] + pieces[1]] + pieces[2:]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(vocab_list))}
    return vocab, list(dict.fromkeys(merges))


def vocab_size() -> int:
    return len(_vocab_and_merges()[0])


def write_clip_tokenizer(folder: str | Path, pad_token: str = "<|endoftext|>") -> Path:
    """A CLIPTokenizer folder (vocab.json + merges.txt) with a small BPE vocabulary.

    Like CLIP's, ``!`` is id 0 and the two special tokens have the highest ids, so
    ``argmax(input_ids)`` finds the end-of-text token.
    """
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = _vocab_and_merges()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token=pad_token)
    tok.model_max_length = 77
    tok.save_pretrained(folder)
    return folder


def clip_text_config(*, projection: bool, hidden_act: str = "gelu", legacy_eos: bool = True,
                     hidden_size: int = 32):
    from transformers import CLIPTextConfig

    v = vocab_size()
    return CLIPTextConfig(
        bos_token_id=v - 2,
        eos_token_id=2 if legacy_eos else v - 1,  # 2: transformers' legacy "argmax" pooling
        pad_token_id=1,
        hidden_size=hidden_size,
        intermediate_size=37,
        layer_norm_eps=1e-5,
        num_attention_heads=4,
        num_hidden_layers=5,
        vocab_size=v,
        hidden_act=hidden_act,
        projection_dim=32 if projection else 512,
        max_position_embeddings=77,
    )


def make_text_encoder(folder: str | Path, *, projection: bool, hidden_act: str = "gelu",
                      legacy_eos: bool = True, seed: int = 0):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    model = cls(clip_text_config(projection=projection, hidden_act=hidden_act,
                                 legacy_eos=legacy_eos)).eval()
    model.save_pretrained(folder)
    return model


SDXL_UNET = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2),
    projection_class_embeddings_input_dim=80,  # 6 * 8 + text_encoder_2 projection (32)
    cross_attention_dim=64,  # 32 + 32 hidden sizes of the two text encoders
    norm_num_groups=8,
)

SD15_UNET = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    layers_per_block=2,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    attention_head_dim=8,
    cross_attention_dim=32,
    norm_num_groups=8,
)

VAE = dict(
    block_out_channels=(32, 64),
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    latent_channels=4,
    norm_num_groups=8,
    sample_size=32,
    scaling_factor=0.13025,
)


# SDXL's scale factor of 8 (four levels) at tiny widths: big images stay cheap in the UNet
VAE_F8 = dict(VAE, block_out_channels=(16, 16, 32, 32),
              down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8, sample_size=128)


def make_unet(folder: str | Path, config: dict, seed: int = 0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    model = UNet2DConditionModel(**config).eval()
    _randomize(model, seed)
    model.save_pretrained(folder)
    return model


def make_controlnet(folder: str | Path, unet_config: dict, seed: int = 0, **overrides):
    """A random diffusers ControlNet for a UNet of ``unet_config`` (its config made by
    diffusers' ``ControlNetModel.from_unet``), with ``overrides`` of that config."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    with torch.device("meta"):  # only the config is needed
        made = ControlNetModel.from_unet(UNet2DConditionModel(**unet_config),
                                         load_weights_from_unet=False)
    # (without diffusers' bookkeeping keys: "_use_default_values" would undo the overrides)
    config = {k: v for k, v in made.config.items() if not k.startswith("_")}
    torch.manual_seed(seed)
    model = ControlNetModel.from_config({**config, **overrides}).eval()
    _randomize(model, seed)
    model.save_pretrained(folder)
    return model


def make_vae(folder: str | Path, config: dict = VAE, seed: int = 0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    model = AutoencoderKL(**config).eval()
    _randomize(model, seed)
    model.save_pretrained(folder)
    return model


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """diffusers zero-initialises some output layers; give every tensor a random value so
    parity tests exercise every weight (norms stay near 1, everything else small)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim <= 1:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


def make_sdxl_pipeline(folder: str | Path, seed: int = 0, scheduler_config: dict | None = None,
                       vae_config: dict | None = None, unet_config: dict | None = None,
                       hidden_2: int = 32):
    """A complete tiny SDXL folder in the diffusers layout (model_index.json and components).
    ``vae_config`` / ``unet_config``: other tiny configs (e.g. :data:`VAE_F8`). ``hidden_2``:
    text_encoder_2's width (diffusers' single-file reader tells the two encoders apart by
    width, as the real ones are: 768 and 1280); the UNet's cross-attention follows it."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    folder = Path(folder)
    tmp = folder / "_tok"
    tok1 = CLIPTokenizer.from_pretrained(write_clip_tokenizer(tmp / "1"))
    tok2 = CLIPTokenizer.from_pretrained(write_clip_tokenizer(tmp / "2", pad_token="!"))
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    unet_config = dict(unet_config or SDXL_UNET)
    if hidden_2 != 32:
        unet_config["cross_attention_dim"] = 32 + hidden_2
    unet = UNet2DConditionModel(**unet_config).eval()
    _randomize(unet, seed)
    vae = AutoencoderKL(**(vae_config or VAE)).eval()
    _randomize(vae, seed + 10)
    torch.manual_seed(seed + 20)
    te1 = CLIPTextModel(clip_text_config(projection=False, hidden_act="quick_gelu")).eval()
    te2 = CLIPTextModelWithProjection(clip_text_config(projection=True, legacy_eos=False,
                                                       hidden_size=hidden_2)).eval()
    sched = EulerDiscreteScheduler(**(scheduler_config or SDXL_SCHEDULER))
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok1,
                                     tokenizer_2=tok2, unet=unet, scheduler=sched)
    pipe.save_pretrained(folder)
    import shutil

    shutil.rmtree(tmp)
    return pipe


def make_sd_pipeline(folder: str | Path, *, v2: bool = False, seed: int = 0,
                     scheduler_config: dict | None = None):
    """A tiny Stable Diffusion 1.x folder (PNDM, as SD 1.5 ships), or 2.x-like with ``v2``
    (linear projections,
    ``upcast_attention``, a gelu text encoder, a tokenizer padding with ``!`` and a
    v-prediction DDIM scheduler, as SD 2.1 ships), written by diffusers'
    ``StableDiffusionPipeline.save_pretrained``."""
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        EulerDiscreteScheduler,
        PNDMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel, CLIPTokenizer

    folder = Path(folder)
    tok = CLIPTokenizer.from_pretrained(
        write_clip_tokenizer(folder / "_tok", pad_token="!" if v2 else "<|endoftext|>"))
    unet_config = dict(SD15_UNET, use_linear_projection=True, upcast_attention=True,
                       attention_head_dim=(2, 4)) if v2 else SD15_UNET
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**unet_config).eval()
    _randomize(unet, seed)
    vae = AutoencoderKL(**dict(VAE, scaling_factor=0.18215)).eval()
    _randomize(vae, seed + 10)
    torch.manual_seed(seed + 20)
    te = CLIPTextModel(clip_text_config(projection=False, legacy_eos=v2,
                                        hidden_act="gelu" if v2 else "quick_gelu")).eval()
    if scheduler_config is not None:
        sched = EulerDiscreteScheduler(**scheduler_config)
    elif v2:
        sched = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, steps_offset=1, clip_sample=False,
                              set_alpha_to_one=False, prediction_type="v_prediction")
    else:  # SD 1.5's own: PLMS
        sched = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, steps_offset=1, skip_prk_steps=True,
                              set_alpha_to_one=False)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=unet,
                                   scheduler=sched, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(folder)
    import shutil

    shutil.rmtree(folder / "_tok")
    return pipe


def add_safety_checker(base: str | Path, out: str | Path, images, flagged: int = 2) -> Path:
    """``base`` (a tiny SD 1.x folder) saved to ``out`` with a random diffusers
    ``StableDiffusionSafetyChecker`` and its feature extractor (32-pixel crops), its first
    concept's threshold set between the scores of ``images`` (float (N, H, W, 3) in [0, 1],
    what the folder makes for some request) so that the ``flagged`` highest-scoring of them
    are flagged and the others are not; no other concept flags anything."""
    import numpy as np
    from diffusers import StableDiffusionPipeline
    from diffusers.pipelines.stable_diffusion.safety_checker import (
        StableDiffusionSafetyChecker,
    )
    from transformers import CLIPConfig, CLIPImageProcessor

    torch.manual_seed(3)
    config = CLIPConfig(vision_config=dict(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           image_size=32, patch_size=8),
                        text_config=dict(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4),
                        projection_dim=16)
    checker = StableDiffusionSafetyChecker(config).eval()
    with torch.no_grad():
        for p in checker.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        checker.special_care_embeds_weights.fill_(2.0)  # never: no adjustment
        checker.concept_embeds_weights.fill_(2.0)
    fe = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    pixels = fe(images=[(np.asarray(im) * 255).round().astype(np.uint8) for im in images],
                return_tensors="pt").pixel_values
    with torch.no_grad():
        emb = checker.visual_projection(checker.vision_model(pixels)[1])
        cos = torch.nn.functional.normalize(emb) @ torch.nn.functional.normalize(
            checker.concept_embeds).T
        scores = np.sort(cos[:, 0].numpy())
        k = len(scores) - flagged
        checker.concept_embeds_weights[0] = float(scores[k - 1] + scores[k]) / 2
    pipe = StableDiffusionPipeline.from_pretrained(base, safety_checker=checker,
                                                   feature_extractor=fe)
    pipe.save_pretrained(out)
    return Path(out)


SDXL_SCHEDULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    steps_offset=1,
    prediction_type="epsilon",
    timestep_spacing="leading",
    interpolation_type="linear",
    use_karras_sigmas=False,
)


def make_sdxl_lora(model: str | Path, out: str | Path, rank: int = 4, seed: int = 0) -> Path:
    """A random LoRA for the attention projections of a tiny SDXL or SD folder's UNet, in the
    diffusers/PEFT key format (``unet.<module>.lora_A.weight`` / ``lora_B.weight``)."""
    import numpy as np

    from maxdiff.checkpoint import open_weights, save_safetensors

    rng = np.random.default_rng(seed)
    source = open_weights(Path(model) / "unet")
    tensors = {}
    for key in source.keys():
        if key.endswith((".to_q.weight", ".to_v.weight")):
            n_out, n_in = source.files[source.file_of(key)].shape(key)
            module = key[: -len(".weight")]
            tensors[f"unet.{module}.lora_A.weight"] = (
                rng.standard_normal((rank, n_in)) / n_in**0.5).astype(np.float32)
            tensors[f"unet.{module}.lora_B.weight"] = (
                rng.standard_normal((n_out, rank)) * 0.3 / rank**0.5).astype(np.float32)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out)
    return out


def run_on_host_devices(script: str, n: int = 4):
    """Run ``script`` (Python source) in a fresh process whose CPU backend has ``n`` devices, at
    the suite's XLA flags (conftest.py: -O0, as the rest of the suite) with the run's
    compilation cache (``MAXDIFF_COMPILE_CACHE``, the pipelines' default); returns the JSON value
    of the last line it prints."""
    import json
    import os
    import subprocess
    import sys

    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"
    env = dict(os.environ, XLA_FLAGS=flags.strip())
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# the real refiner's UNet layout at tiny width (sd_xl_refiner.yaml: four levels, attention in
# the middle two only, four transformer layers in each)
REFINER_LAYOUT = dict(
    block_out_channels=(16, 32, 32, 32), attention_head_dim=(1, 2, 2, 2),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                      "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=4)


def make_sdxl_refiner(folder: str | Path, seed: int = 5, scheduler_config: dict | None = None,
                      vae_config: dict | None = None, unet_layout: dict | None = None):
    """A tiny SDXL refiner folder as diffusers saves stabilityai's: a
    ``StableDiffusionXLImg2ImgPipeline`` with ``text_encoder=None``, ``tokenizer=None`` and
    ``requires_aesthetics_score=True``. Its UNet reads encoder 2's states alone
    (``cross_attention_dim`` = its hidden size) and five time ids (original size, crop
    corner, aesthetic score): ``projection_class_embeddings_input_dim = 5 *
    addition_time_embed_dim + projection_dim``; its own VAE and text encoder weights.
    ``unet_layout``: UNet fields over the base's tiny layout (:data:`REFINER_LAYOUT`)."""
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLImg2ImgPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    folder = Path(folder)
    tok2 = CLIPTokenizer.from_pretrained(write_clip_tokenizer(folder / "_tok", pad_token="!"))
    te_config = clip_text_config(projection=True, legacy_eos=False)
    unet_config = dict(SDXL_UNET, **(unet_layout or {}), cross_attention_dim=te_config.hidden_size,
                       projection_class_embeddings_input_dim=5 * SDXL_UNET["addition_time_embed_dim"]
                       + te_config.projection_dim)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**unet_config).eval()
    _randomize(unet, seed)
    vae = AutoencoderKL(**(vae_config or VAE)).eval()
    _randomize(vae, seed + 10)
    torch.manual_seed(seed + 20)
    te2 = CLIPTextModelWithProjection(te_config).eval()
    sched = EulerDiscreteScheduler(**(scheduler_config or SDXL_SCHEDULER))
    pipe = StableDiffusionXLImg2ImgPipeline(vae=vae, text_encoder=None, text_encoder_2=te2,
                                            tokenizer=None, tokenizer_2=tok2, unet=unet,
                                            scheduler=sched, requires_aesthetics_score=True)
    pipe.save_pretrained(folder)
    import shutil

    shutil.rmtree(folder / "_tok")
    return pipe


IMAGE_ENCODER = dict(hidden_size=32, intermediate_size=64, projection_dim=24,
                     num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8,
                     hidden_act="gelu")


def make_image_encoder(folder: str | Path, seed: int = 0, **overrides) -> Path:
    """A tiny transformers CLIPVisionModelWithProjection folder (an IP-Adapter's
    ``image_encoder/``), random weights."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    model = CLIPVisionModelWithProjection(CLIPVisionConfig(**{**IMAGE_ENCODER, **overrides}))
    _randomize(model.eval(), seed)
    model.save_pretrained(folder)
    return Path(folder)


def make_ip_adapter(unet, out: str | Path, kind: str = "basic", seed: int = 0,
                    tokens: int = 4, encoder: dict | None = None) -> Path:
    """A random IP-Adapter file for the diffusers ``unet`` in h94/IP-Adapter's layout
    (``image_proj.*``, ``ip_adapter.{k}.to_k_ip.weight``: k = 1, 3, ... in diffusers'
    ``attn_processors`` order), saved as ``out`` (.safetensors). ``kind``: ``basic`` (Linear
    + LayerNorm over image_embeds), ``plus`` (the 4-block resampler over hidden states) or
    ``full`` (Linear, GELU, Linear, LayerNorm over every hidden state).
    ``encoder``: the image encoder's config (default :data:`IMAGE_ENCODER`)."""
    from safetensors.torch import save_file

    enc = {**IMAGE_ENCODER, **(encoder or {})}
    g = torch.Generator().manual_seed(seed + 7)
    r = lambda *shape, s=None: (torch.randn(*shape, generator=g) / (shape[-1] ** 0.5 if s is None
                                                                     else 1 / s)).contiguous()
    cross = unet.config.cross_attention_dim
    sd = {}
    if kind == "basic":
        sd["image_proj.proj.weight"] = r(tokens * cross, enc["projection_dim"])
        sd["image_proj.proj.bias"] = r(tokens * cross, s=0.05)
        sd["image_proj.norm.weight"] = 1 + r(cross, s=0.1)
        sd["image_proj.norm.bias"] = r(cross, s=0.05)
    elif kind == "plus":
        hidden, inner = 32, 64  # one 64-wide head, as the file's to_q says
        sd["image_proj.latents"] = r(1, tokens, hidden, s=hidden ** -0.5)
        sd["image_proj.proj_in.weight"] = r(hidden, enc["hidden_size"])
        sd["image_proj.proj_in.bias"] = r(hidden, s=0.05)
        for i in range(4):
            p = f"image_proj.layers.{i}"
            for n in ("0.norm1", "0.norm2", "1.0"):
                sd[f"{p}.{n}.weight"] = 1 + r(hidden, s=0.1)
                sd[f"{p}.{n}.bias"] = r(hidden, s=0.05)
            sd[f"{p}.0.to_q.weight"] = r(inner, hidden)
            sd[f"{p}.0.to_kv.weight"] = r(2 * inner, hidden)
            sd[f"{p}.0.to_out.weight"] = r(hidden, inner)
            sd[f"{p}.1.1.weight"] = r(4 * hidden, hidden)
            sd[f"{p}.1.3.weight"] = r(hidden, 4 * hidden)
        sd["image_proj.proj_out.weight"] = r(cross, hidden)
        sd["image_proj.proj_out.bias"] = r(cross, s=0.05)
        sd["image_proj.norm_out.weight"] = 1 + r(cross, s=0.1)
        sd["image_proj.norm_out.bias"] = r(cross, s=0.05)
    elif kind == "full":
        e = enc["hidden_size"]
        sd["image_proj.proj.0.weight"] = r(e, e)
        sd["image_proj.proj.0.bias"] = r(e, s=0.05)
        sd["image_proj.proj.2.weight"] = r(cross, e)
        sd["image_proj.proj.2.bias"] = r(cross, s=0.05)
        sd["image_proj.proj.3.weight"] = 1 + r(cross, s=0.1)
        sd["image_proj.proj.3.bias"] = r(cross, s=0.05)
    else:
        raise ValueError(kind)
    k = 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        attn = unet.get_submodule(name[: -len(".processor")])
        sd[f"ip_adapter.{k}.to_k_ip.weight"] = r(attn.to_k.out_features, cross)
        sd[f"ip_adapter.{k}.to_v_ip.weight"] = r(attn.to_v.out_features, cross)
        k += 2
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out))
    return out
