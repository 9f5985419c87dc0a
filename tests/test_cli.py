"""``python -m nvchat_torch.stream`` on the embedded default and on a tiny checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from mlx_oracle import synth_audio

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "question.wav"


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvchat_torch.stream", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_example_question_is_16k_mono_speech():
    data, sr = sf.read(EXAMPLE)
    assert sr == 16000 and data.ndim == 1
    assert 1.0 < len(data) / sr < 10.0
    assert np.abs(data).max() > 0.1  # not silence


def test_embedded_default_streams_the_example(tmp_path):
    out = tmp_path / "answer.wav"
    proc = run_cli("--audio", str(EXAMPLE), "--output-audio", str(out), "--profile", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert "random weights" in proc.stderr and "noise" in proc.stderr
    assert "hf download mlx-community/NemotronLabs-VoiceChat-11B-4bit" in proc.stderr
    data, sr = sf.read(out)
    frames = len(sf.read(EXAMPLE)[0]) // 1280 + 1  # the partial last frame is zero-padded
    assert sr == 22050 and len(data) == frames * 1764
    assert f"{frames} frames x 1764" in proc.stdout
    assert "real-time factor" in proc.stdout and "perception" in proc.stdout


def test_checkpoint_offline_and_stream_agree(tmp_path, ckpt_f32):
    wav = tmp_path / "in.wav"
    sf.write(wav, synth_audio(1.2), 16000, subtype="FLOAT")
    outs = {}
    for mode in ("--stream", "--offline"):
        out = tmp_path / f"out{mode}.wav"
        proc = run_cli("--model", str(ckpt_f32), "--audio", str(wav), "--output-audio", str(out), mode,
                       "--deterministic", "-p", "you are a helpful assistant", "--device", "cpu", "--dtype", "float32")
        assert proc.returncode == 0, proc.stderr
        assert "assistant:" in proc.stdout and "user (transcript):" in proc.stdout
        outs[mode] = proc.stdout
    # streaming emits one frame per 1280 samples (the padded tail included); offline N + 1 frames
    n = int(np.ceil(1.2 * 16000 / 1280))
    assert f"{n} frames x 1764" in outs["--stream"]
    assert f"{int(1.2 * 16000) // 1280 + 1} frames x 1764" in outs["--offline"]


def test_resamples_and_downmixes_saying_so(tmp_path):
    wav = tmp_path / "stereo.wav"
    t = np.arange(int(0.5 * 44100)) / 44100
    stereo = np.stack([np.sin(2 * np.pi * 300 * t), np.sin(2 * np.pi * 500 * t)], axis=1) * 0.3
    sf.write(wav, stereo, 44100)
    proc = run_cli("--audio", str(wav), "--output-audio", str(tmp_path / "o.wav"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "downmixed 2 channels to mono" in proc.stderr and "resampled 44100 Hz to 16000 Hz" in proc.stderr


@pytest.mark.parametrize("args,match", [
    (["--audio", "missing.wav"], "missing.wav"),
    (["--audio", str(EXAMPLE), "--model", "no/such-local-folder-or-repo", "--device", "cpu"], "no/such-local"),
])
def test_errors_are_clear(tmp_path, args, match, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = run_cli(*args, "--output-audio", str(tmp_path / "o.wav"))
    assert proc.returncode == 2
    assert match in proc.stderr and "Traceback" not in proc.stderr
