"""audio-classification: FSDD loading and split, WAV decoding, the mel filterbank and log-mels,
the speaker partition, and tiny runs (fedavg on the small net, fedit on a tiny wav2vec2)."""

from __future__ import annotations

import io
import os
import re
import tarfile
import wave
from pathlib import Path

import numpy as np
import pytest

from fedtune.config import ConfigError
from fedtune.data import audio as A
from fedtune.data.audio import hz_to_mel, load_fsdd, log_mel, mel_filterbank, mel_frequencies, read_wav

DATA = Path(os.environ["FEDTUNE_DATA_DIR"])
AUDIO_TASK = [
    "task.kind=audio-classification",
    "data.name=fsdd",
    "model.name=audio-cnn",
    "data.max_train_samples=96",
    "data.max_test_samples=40",
    "task.frames=32",
]


@pytest.fixture(scope="module")
def fsdd():
    return load_fsdd(DATA)


def _wav_bytes(samples: np.ndarray, width: int, channels: int = 1, rate: int = 8000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return buf.getvalue()


# -- data --------------------------------------------------------------------------------------
def test_fsdd_counts_and_official_split(fsdd):
    train, test = fsdd
    assert (len(train), len(test)) == (2700, 300)
    assert train.label_names == test.label_names == [str(d) for d in range(10)]
    assert sorted(set(train.speakers)) == sorted(set(test.speakers)) and len(set(train.speakers)) == 6
    assert np.bincount(test.labels).tolist() == [30] * 10  # 6 speakers x 5 recordings per digit
    assert np.bincount(train.labels).tolist() == [270] * 10
    assert train.sample_rate == test.sample_rate == 8000
    # the test set is exactly recordings 0-4, in (digit, speaker, index) order, decoded like scipy does
    from scipy.io import wavfile

    with tarfile.open(DATA / A.FSDD_ARCHIVE) as tar:
        members = {m.name: m for m in tar if m.name.endswith(".wav")}
        keys = sorted(
            (int(d), s, int(i), n) for n in members for d, s, i in [re.search(r"(\d)_(\w+?)_(\d+)\.wav$", n).groups()]
        )
        test_keys = [k for k in keys if k[2] < 5]
        assert len(keys) == 3000 and len(test_keys) == 300
        for j in (0, 137, 299):
            _, data = wavfile.read(io.BytesIO(tar.extractfile(members[test_keys[j][3]]).read()))
            np.testing.assert_array_equal(test.waves[j], data.astype(np.float32) / 32768.0)
            assert (test.labels[j], test.speakers[j]) == test_keys[j][:2]


def test_waves_are_float32_mono_in_range(fsdd):
    for ds in fsdd:
        assert all(w.dtype == np.float32 and w.ndim == 1 for w in ds.waves)
        assert min(float(w.min()) for w in ds.waves) >= -1.0 and max(float(w.max()) for w in ds.waves) <= 1.0
        assert max(float(np.abs(w).max()) for w in ds.waves) > 0.5  # scaled, not left as raw integers / 2^31


def test_read_wav_scales_every_pcm_width_and_mixes_channels():
    x16, rate = read_wav(_wav_bytes(np.array([-32768, 0, 16384, 32767], "<i2"), 2))
    assert rate == 8000 and x16.dtype == np.float32
    np.testing.assert_allclose(x16, [-1.0, 0.0, 0.5, 32767 / 32768])
    x8, _ = read_wav(_wav_bytes(np.array([0, 128, 255], np.uint8), 1))
    np.testing.assert_allclose(x8, [-1.0, 0.0, 127 / 128])
    v24 = np.array([-(1 << 23), -1, 1 << 22], dtype=np.int32)
    raw24 = np.stack([(v24 >> s) & 0xFF for s in (0, 8, 16)], axis=1).astype(np.uint8)
    x24, _ = read_wav(_wav_bytes(raw24.reshape(-1), 3))
    np.testing.assert_allclose(x24, [-1.0, -1 / (1 << 23), 0.5])
    stereo, _ = read_wav(_wav_bytes(np.array([16384, 0, -32768, 32767], "<i2"), 2, channels=2))
    np.testing.assert_allclose(stereo, [0.25, (-32768 + 32767) / 2 / 32768])
    with pytest.raises(ConfigError, match="not a PCM WAV"):
        read_wav(b"RIFF....WAVEjunk", "x.wav")


def test_missing_data_dir_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.data_dir: no fsdd-recordings.tar.gz") as err:
        load_fsdd(tmp_path)
    assert "\n" not in str(err.value)


# -- mel filterbank and log-mels ---------------------------------------------------------------
@pytest.mark.parametrize("htk", [False, True])
def test_filterbank_is_triangles_peaking_at_mel_spaced_centres(htk):
    sr, n_fft, n_mels, fmin, fmax = 8000, 512, 24, 60.0, 3800.0
    fb = mel_filterbank(sr, n_fft, n_mels, fmin, fmax, htk=htk, norm=None)
    bins = np.linspace(0, sr / 2, n_fft // 2 + 1)
    edges = mel_frequencies(n_mels + 2, fmin, fmax, htk)
    np.testing.assert_allclose(np.diff(hz_to_mel(edges, htk)), np.diff(hz_to_mel(edges, htk))[0])  # equal mel steps
    for m in range(n_mels):
        lo, centre, hi = edges[m : m + 3]
        expected = np.clip(np.minimum((bins - lo) / (centre - lo), (hi - bins) / (hi - centre)), 0, None)
        np.testing.assert_allclose(fb[m], expected, atol=1e-6)  # the triangle (lo, centre, hi), height 1
        assert bins[np.argmax(fb[m])] == pytest.approx(bins[np.argmin(np.abs(bins - centre))])
        assert np.all(fb[m][(bins <= lo) | (bins >= hi)] == 0)
    # adjacent triangles sum to one between the first and the last centre
    inside = (bins >= edges[1]) & (bins <= edges[-2])
    np.testing.assert_allclose(fb.sum(0)[inside], 1.0, atol=1e-6)
    # Slaney normalization: each triangle scaled to unit area, 2 / (hi - lo)
    slaney = mel_filterbank(sr, n_fft, n_mels, fmin, fmax, htk=htk)
    np.testing.assert_allclose(slaney, fb * (2.0 / (edges[2:] - edges[:-2]))[:, None], rtol=1e-5)


def test_slaney_mel_scale_is_linear_below_1khz_and_logarithmic_above():
    np.testing.assert_allclose(hz_to_mel([0, 200 / 3, 1000]), [0, 1, 15])
    np.testing.assert_allclose(hz_to_mel(6400.0) - hz_to_mel(1000.0), 27.0)  # 27 mels per factor 6.4
    np.testing.assert_allclose(A.mel_to_hz(hz_to_mel([50, 900, 1000, 3000, 7999])), [50, 900, 1000, 3000, 7999])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(sr=8000, n_fft=256, n_mels=40),
        dict(sr=16000, n_fft=400, n_mels=64, fmin=20.0, fmax=7600.0),
        dict(sr=8000, n_fft=512, n_mels=32, htk=True),
        dict(sr=8000, n_fft=256, n_mels=20, norm=None),
    ],
)
def test_filterbank_matches_librosa(kwargs):
    import librosa  # a test dependency (pyproject [test])

    args = dict(kwargs)
    sr, n_fft, n_mels = args.pop("sr"), args.pop("n_fft"), args.pop("n_mels")
    ours = mel_filterbank(sr, n_fft, n_mels, **args)
    ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, **args)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-7)


def test_log_mel_shape_determinism_cache_and_fixed_length(fsdd):
    train, _ = fsdd
    waves = train.waves[:12]
    feats = log_mel(waves, 8000, n_mels=32, n_fft=256, hop=80, frames=40)
    assert feats.shape == (12, 32, 40) and feats.dtype == np.float32
    assert log_mel(waves, 8000, n_mels=32, n_fft=256, hop=80, frames=40) is feats  # cached
    A._MEL_CACHE.clear()
    np.testing.assert_array_equal(log_mel(waves, 8000, n_mels=32, n_fft=256, hop=80, frames=40), feats)
    # a clip is cut or zero-padded to (frames - 1) * hop samples before the STFT
    cut = [A.fix_length(w, 39 * 80) for w in waves]
    np.testing.assert_array_equal(log_mel(cut, 8000, n_mels=32, n_fft=256, hop=80, frames=40), feats)
    # top_db: nothing lies more than 80 dB below its clip's maximum
    assert np.all(feats.max(axis=(1, 2)) - feats.min(axis=(1, 2)) <= 80.0 + 1e-4)


def test_log_mel_matches_librosa(fsdd):
    import librosa  # a test dependency (pyproject [test])

    train, _ = fsdd
    idx = [0, 500, 1400, 2699]
    ours = log_mel([train.waves[i] for i in idx], 8000, n_mels=40, n_fft=256, hop=80, frames=64)
    for row, i in enumerate(idx):
        y = A.fix_length(train.waves[i], 63 * 80)
        power = librosa.feature.melspectrogram(y=y, sr=8000, n_fft=256, hop_length=80, n_mels=40)
        ref = librosa.power_to_db(power, ref=1.0, amin=1e-10, top_db=80.0)
        np.testing.assert_allclose(ours[row], ref, atol=2e-3)  # dB, float32 STFT vs librosa's


# -- the task ----------------------------------------------------------------------------------
def test_speaker_partition_gives_whole_speakers(tiny_config):
    from fedtune.runtime import RunContext, resolve_run

    ctx = RunContext(
        resolve_run(
            tiny_config(
                "method=fedavg",
                "task.kind=audio-classification",
                "data.name=fsdd",
                "task.split_by=speaker",
                "federation.num_clients=3",
                "data.max_train_samples=300",
            )
        )
    )
    speakers = np.array(ctx.task.train.speakers)
    parts = ctx.partitions
    owned = [set(speakers[p]) for p in parts]
    assert all(len(o) == 2 for o in owned) and set.union(*owned) == set(speakers)
    assert sum(len(p) for p in parts) == len(speakers)
    assert all(not (a & b) for i, a in enumerate(owned) for b in owned[i + 1 :])
    with pytest.raises(ConfigError, match="^federation.num_clients: task.split_by='speaker' needs at most 6"):
        RunContext(
            resolve_run(tiny_config("method=fedavg", *AUDIO_TASK, "task.split_by=speaker", "federation.num_clients=7"))
        ).partitions


def test_bad_data_name_and_option_are_config_errors(tiny_config):
    from fedtune.runtime import RunContext, resolve_run

    with pytest.raises(ConfigError, match="^data.name: audio-classification reads fsdd; got 'tweets'"):
        RunContext(
            resolve_run(tiny_config("method=fedavg", "task.kind=audio-classification", "data.name=tweets"))
        ).task.train
    with pytest.raises(ConfigError, match=r"^task.split_by"):
        RunContext(resolve_run(tiny_config("method=fedavg", "task.kind=audio-classification", "task.split_by=room")))


def test_fedavg_on_the_small_net_runs(tiny_config):
    from fedtune.run import run_experiment

    summary = run_experiment(
        tiny_config("method=fedavg", *AUDIO_TASK, "rounds=2", "train.local_steps=4", "federation.num_clients=2")
    )
    assert summary["task"] == "audio-classification" and summary["test_examples"] == 40
    assert 0.0 <= summary["final_accuracy"] <= 1.0 and np.isfinite(summary["final_loss"])
    test_labels = load_fsdd(DATA)[1].labels
    sub = np.sort(np.random.default_rng(0).choice(300, size=40, replace=False))  # Task.data's test subsample
    assert summary["majority_accuracy"] == np.bincount(test_labels[sub]).max() / 40


def test_fedit_on_a_tiny_wav2vec2_trains_lora_on_attention_and_the_head(tiny_config):
    from fedtune.run import run_experiment
    from fedtune.runtime import RunContext, resolve_run

    cfg = tiny_config(
        "method=fedit",
        *AUDIO_TASK,
        "model.name=tiny-wav2vec2",
        "data.max_train_samples=32",
        "data.max_test_samples=16",
        "rounds=1",
        "train.local_steps=2",
        "train.batch_size=4",
        "federation.num_clients=2",
        "model.lora_rank=2",
    )
    ctx = RunContext(resolve_run(cfg))
    assert ctx.task.lora_targets() == ["q_proj", "v_proj"]
    assert ctx.task.head_modules() == ["projector", "classifier"]
    names = ctx.workspace.state(2).keys()
    assert sum(".q_proj.lora_A." in n for n in names) == 2 and sum(".v_proj.lora_B." in n for n in names) == 2
    assert {"projector.weight", "classifier.weight"} <= set(names)
    assert ctx.task.inputs[0]["input_values"].shape == (32, 16000)  # 8 kHz -> 16 kHz, 1 s
    summary = run_experiment(cfg)
    assert summary["method"] == "fedit" and 0.0 <= summary["final_accuracy"] <= 1.0


def test_the_head_and_its_init_are_the_same_in_every_process(tiny_config):
    from fedtune.runtime import RunContext, resolve_run

    cfg = tiny_config("method=fedavg", *AUDIO_TASK)
    a, b = RunContext(resolve_run(cfg)).task.build_model(3), RunContext(resolve_run(cfg)).task.build_model(3)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert np.array_equal(p.numpy(), q.numpy()), n
    assert not np.array_equal(
        a.classifier.weight.detach().numpy(),
        RunContext(resolve_run(cfg)).task.build_model(4).classifier.weight.detach().numpy(),
    )


def test_lora_on_the_small_net_adapts_its_convolutions(tiny_config):
    from fedtune.runtime import RunContext, resolve_run

    ctx = RunContext(resolve_run(tiny_config("method=fedit", *AUDIO_TASK, "model.lora_rank=2")))
    state = ctx.workspace.state(2)
    assert ctx.task.lora_targets() == ["conv"] and ctx.task.head_modules() == ["classifier"]
    assert state["encoder.blocks.0.conv.lora_A.weight"].shape == (2, 1, 3, 3)
    assert state["encoder.blocks.2.conv.lora_B.weight"].shape == (64, 2, 1, 1)
    assert {"classifier.weight", "classifier.bias"} <= state.keys()


def test_a_hf_audio_model_loads_by_path_with_a_fresh_seeded_head(tiny_config, tmp_path):
    from fedtune.models.audio import _tiny_wav2vec2, _tiny_wav2vec2_extractor
    from fedtune.runtime import RunContext, resolve_run

    saved = _tiny_wav2vec2(10)
    saved.save_pretrained(tmp_path / "w2v")
    _tiny_wav2vec2_extractor().save_pretrained(tmp_path / "w2v")
    ctx = RunContext(
        resolve_run(tiny_config("method=fedit", *AUDIO_TASK, f"model.name={tmp_path / 'w2v'}", "task.clip_seconds=0.5"))
    )
    assert ctx.task.lora_targets() == ["q_proj", "v_proj"] and ctx.task.head_modules() == ["projector", "classifier"]
    a, b = ctx.task.build_model(1), ctx.task.build_model(1)
    np.testing.assert_array_equal(a.classifier.weight.detach().numpy(), b.classifier.weight.detach().numpy())
    assert not np.allclose(a.classifier.weight.detach().numpy(), saved.classifier.weight.detach().numpy())
    np.testing.assert_array_equal(
        a.wav2vec2.encoder.layers[0].attention.q_proj.weight.detach().numpy(),
        saved.wav2vec2.encoder.layers[0].attention.q_proj.weight.detach().numpy(),
    )
    assert ctx.task.inputs[0]["input_values"].shape == (96, 8000)
    assert 0.0 <= ctx.task.evaluate(a, 16)["accuracy"] <= 1.0
