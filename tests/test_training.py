"""``python -m maxdiff.training.train``: a run stopped and continued from its ``--state`` file
reaches exactly the state of a run never stopped; a state file of another run is refused."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import yaml
from safetensors import safe_open

from maxdiff.training import train
from pipelines.default_model import EMBEDDED

# the demo model's recipe at a size that trains in a second (its VAE is reused: --vae-from)
TINY = {
    "seed": 3, "pool_size": 64, "save_every": 4, "captions": "v2",
    "text_encoder": {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "hidden_act": "quick_gelu"},
    "text_encoder_2": {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "hidden_act": "gelu", "projection_dim": 8},
    "unet": {"sample_size": 16, "in_channels": 4, "out_channels": 4,
             "block_out_channels": [8], "layers_per_block": 1,
             "down_block_types": ["CrossAttnDownBlock2D"],
             "up_block_types": ["CrossAttnUpBlock2D"],
             "attention_head_dim": 2, "transformer_layers_per_block": 1,
             "use_linear_projection": True, "addition_embed_type": "text_time",
             "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 56,
             "cross_attention_dim": 16, "norm_num_groups": 4},
    "unet_train": {"steps": 6, "batch": 2, "lr": 1.0e-3, "warmup": 2, "weight_decay": 0.01},
}


def _run(tmp_path, name, *args, config=TINY):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(config))
    train.main(["--config", str(cfg), "--out", str(tmp_path / name), "--vae-from", str(EMBEDDED),
                *args])


def _state(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.slow  # five short training runs, about 50 s
def test_a_stopped_run_continues_to_the_same_state(tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    handler = signal.getsignal(signal.SIGTERM)
    _run(tmp_path, "a", "--state", str(a), "--stop-at", "5")  # steps 1-5 in one go
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's own handler is gone
    _run(tmp_path, "b", "--state", str(b), "--stop-at", "2")
    assert json.loads(bytes(_state(b)["meta"]))["step"] == 2
    _run(tmp_path, "b", "--state", str(b), "--stop-at", "5")  # 3-5, continued
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys() and len(sa) > 100
    ma, mb = (json.loads(bytes(s.pop("meta"))) for s in (sa, sb))
    assert ma == mb and ma["step"] == 5  # data order, moving loss and run identity too
    for k in sa:  # weights, optimizer moments and EMA, to the bit
        assert np.array_equal(sa[k], sb[k]), k
    # a state file belongs to its run: other settings are refused, naming them
    other = dict(TINY, unet_train=dict(TINY["unet_train"], lr=2.0e-3))
    with pytest.raises(ValueError, match=r"unet_train differ"):
        _run(tmp_path, "c", "--state", str(b), config=other)
    # the rest of the run: the model of all 6 steps, and the finished run's state file is gone
    _run(tmp_path, "b", "--state", str(b))
    assert not b.exists()
    (weights,) = (tmp_path / "b" / "unet").glob("*.safetensors")
    with safe_open(weights, "np") as f:
        assert f.metadata()["maxdiff_train_step"] == "6"


@pytest.mark.slow  # a training process of its own (~20 s)
def test_sigterm_stops_a_run_between_steps_and_keeps_its_state(tmp_path):
    """SIGTERM (what kill and process managers send) stops the UNet phase after the step it is
    on, writes the state and exits 130; the handler sets a flag the loop reads, so a signal that
    lands in a callback where Python ignores exceptions (it once did: a JAX garbage-collector
    callback) still stops it."""
    import subprocess
    import sys
    import time

    cfg = tmp_path / "long.yaml"
    cfg.write_text(yaml.safe_dump(dict(TINY, unet_train=dict(TINY["unet_train"], steps=100000))))
    state = tmp_path / "s.npz"
    proc = subprocess.Popen([sys.executable, "-m", "maxdiff.training.train", "--config", str(cfg),
                             "--out", str(tmp_path / "m"), "--vae-from", str(EMBEDDED),
                             "--state", str(state), "--state-every", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not state.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert state.exists(), proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    step = json.loads(bytes(_state(state)["meta"]))["step"]
    assert 5 <= step < 100000 and f"stopped at step {step} of 100000" in out, out[-2000:]
