"""Audio data: the Free Spoken Digit Dataset (FSDD), WAV decoding and log-mel features.

- :class:`AudioSet`: mono float32 waveforms in [-1, 1], int64 labels, speaker names.
- :func:`load_fsdd`: the 3,000 FSDD recordings (digits 0-9, 6 speakers, 8 kHz, files
  ``{digit}_{speaker}_{index}.wav``) read straight from ``fsdd-recordings.tar.gz`` (or from an
  extracted ``recordings/`` folder), split as the dataset prescribes: recordings with index 0-4
  are the test set (300), the rest the training pool (2,700). Cached per process.
- :func:`log_mel`: log-mel spectrograms of a fixed number of frames, computed with
  :func:`torch.stft` and the filterbank of :func:`mel_filterbank`, cached per process.
- :func:`standardize_clips`: each clip to zero mean and unit variance (the conv nets' input).
- :func:`resample`: polyphase resampling (8 kHz FSDD -> the rate a pretrained model expects).

Mel scale and normalization follow librosa's defaults (``librosa.filters.mel(htk=False,
norm="slaney")``, the Auditory Toolbox of Slaney 1998): mel is linear below 1 kHz
(``f / (200/3)``) and logarithmic above (``15 + ln(f / 1000) / (ln 6.4 / 27)``); the
``n_mels`` triangles have their feet and peaks at ``n_mels + 2`` points equally spaced on that
scale between ``fmin`` and ``fmax``, evaluated at the FFT bin frequencies, each scaled to unit
area (``2 / (f_{m+2} - f_m)``). ``htk=True`` gives the HTK scale ``2595 log10(1 + f / 700)``;
``norm=None`` leaves peak height 1 (then the triangles sum to 1 between the first and last
centre). The spectrogram is ``|STFT|^2`` with a periodic Hann window, centred frames and zero
padding (librosa's ``center=True, pad_mode="constant"``), and the log is
``10 log10(max(mel, 1e-10))`` clipped at ``top_db`` below each clip's maximum (librosa's
``power_to_db(ref=1.0, amin=1e-10, top_db=top_db)``).
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
import wave
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedtune.config import ConfigError

FSDD_ARCHIVE = "fsdd-recordings.tar.gz"
FSDD_FOLDER = "recordings"
FSDD_TEST_INDICES = range(0, 5)  # the dataset's official test split: recordings 0-4 of every digit and speaker
DIGIT_NAMES = [str(d) for d in range(10)]
_FSDD_NAME = re.compile(r"(?:^|/)(\d)_([A-Za-z]+)_(\d+)\.wav$")


@dataclass
class AudioSet:
    waves: list[np.ndarray]  # float32 mono in [-1, 1], one array per clip (lengths differ)
    labels: np.ndarray  # (N,) int64
    speakers: list[str]
    label_names: list[str]
    sample_rate: int

    def __len__(self) -> int:
        return len(self.waves)

    def subset(self, idx) -> AudioSet:
        idx = np.asarray(idx, dtype=np.int64)
        return AudioSet(
            [self.waves[i] for i in idx],
            self.labels[idx],
            [self.speakers[i] for i in idx],
            self.label_names,
            self.sample_rate,
        )


# -- WAV ---------------------------------------------------------------------------------------
def read_wav(data: bytes, where: str = "WAV") -> tuple[np.ndarray, int]:
    """(mono float32 waveform in [-1, 1], sample rate) of PCM WAV bytes: 8-bit unsigned, 16-, 24-
    or 32-bit signed integers scaled by 2^(bits-1) (so int16 -32768..32767 -> -1..32767/32768);
    channels averaged."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ConfigError(f"{where}: not a PCM WAV file ({exc})") from None
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        x = np.frombuffer(raw, f"<i{width}").astype(np.float32) / float(2 ** (8 * width - 1))
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    else:
        raise ConfigError(f"{where}: unsupported sample width {width} bytes")
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1)
    return np.ascontiguousarray(x, dtype=np.float32), rate


# -- FSDD --------------------------------------------------------------------------------------
_FSDD_CACHE: dict[tuple, tuple[AudioSet, AudioSet]] = {}


def _fsdd_source(data_dir: str | Path) -> Path:
    root = Path(data_dir).expanduser()
    for candidate in (root, root / FSDD_ARCHIVE, root / FSDD_FOLDER, root / "fsdd" / FSDD_FOLDER):
        if candidate.is_file() and candidate.name.endswith((".tar.gz", ".tgz", ".tar")):
            return candidate.resolve()
        if candidate.is_dir() and candidate.name == FSDD_FOLDER:
            return candidate.resolve()
    raise ConfigError(
        f"data.data_dir: no {FSDD_ARCHIVE} (or {FSDD_FOLDER}/ folder of FSDD WAVs) in {str(root)!r}; "
        "set data.data_dir or FEDTUNE_DATA_DIR"
    )


def _fsdd_files(source: Path) -> Iterator[tuple[str, bytes]]:
    if source.is_dir():
        for path in sorted(source.glob("*.wav")):
            yield path.name, path.read_bytes()
        return
    with tarfile.open(source) as tar:
        for member in tar:
            wav = tar.extractfile(member) if member.isfile() and member.name.endswith(".wav") else None
            if wav is not None:
                yield member.name, wav.read()


def load_fsdd(data_dir: str | Path) -> tuple[AudioSet, AudioSet]:
    """(training pool, test set) of FSDD from ``data_dir`` (a folder holding
    ``fsdd-recordings.tar.gz`` or ``recordings/``, or the archive itself). Clips sorted by
    (digit, speaker, index); test = indices 0-4. Read once per process (keyed by the source's
    path, size and modification time)."""
    source = _fsdd_source(data_dir)
    stat = source.stat()
    key = (str(source), stat.st_size, stat.st_mtime_ns)
    if key in _FSDD_CACHE:
        return _FSDD_CACHE[key]
    clips: list[tuple[int, str, int, np.ndarray]] = []
    rates = set()
    for name, data in _fsdd_files(source):
        match = _FSDD_NAME.search(name)
        if match is None:
            continue
        wave_, rate = read_wav(data, f"{source}:{name}")
        rates.add(rate)
        clips.append((int(match.group(1)), match.group(2), int(match.group(3)), wave_))
    if not clips:
        raise ConfigError(
            f"data.data_dir: {str(source)!r} holds no FSDD recordings ({{digit}}_{{speaker}}_{{index}}.wav)"
        )
    if len(rates) != 1:
        raise ConfigError(f"data.data_dir: FSDD recordings in {str(source)!r} mix sample rates {sorted(rates)}")
    clips.sort(key=lambda c: c[:3])
    rate = rates.pop()

    def make(test: bool) -> AudioSet:
        rows = [c for c in clips if (c[2] in FSDD_TEST_INDICES) == test]
        return AudioSet(
            [c[3] for c in rows],
            np.array([c[0] for c in rows], dtype=np.int64),
            [c[1] for c in rows],
            list(DIGIT_NAMES),
            rate,
        )

    result = (make(False), make(True))
    _FSDD_CACHE[key] = result
    return result


# -- mel filterbank and log-mel features -------------------------------------------------------
_F_SP = 200.0 / 3  # Hz per mel below 1 kHz (Slaney)
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP  # 15
_LOGSTEP = np.log(6.4) / 27.0


def hz_to_mel(hz, htk: bool = False) -> np.ndarray:
    """Slaney's mel scale (linear below 1 kHz, logarithmic above), or HTK's ``2595 log10(1 + f/700)``."""
    hz = np.asarray(hz, dtype=np.float64)
    if htk:
        return 2595.0 * np.log10(1.0 + hz / 700.0)
    return np.where(
        hz >= _MIN_LOG_HZ, _MIN_LOG_MEL + np.log(np.maximum(hz, 1e-12) / _MIN_LOG_HZ) / _LOGSTEP, hz / _F_SP
    )


def mel_to_hz(mel, htk: bool = False) -> np.ndarray:
    """Inverse of :func:`hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    if htk:
        return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)
    return np.where(mel >= _MIN_LOG_MEL, _MIN_LOG_HZ * np.exp(_LOGSTEP * (mel - _MIN_LOG_MEL)), _F_SP * mel)


def mel_frequencies(n: int, fmin: float, fmax: float, htk: bool = False) -> np.ndarray:
    """``n`` frequencies (Hz) equally spaced on the mel scale from ``fmin`` to ``fmax``."""
    return mel_to_hz(np.linspace(hz_to_mel(fmin, htk), hz_to_mel(fmax, htk), n), htk)


def mel_filterbank(
    sample_rate: int,
    n_fft: int,
    n_mels: int,
    fmin: float = 0.0,
    fmax: float | None = None,
    htk: bool = False,
    norm: str | None = "slaney",
) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) float32 triangular filters: filter m rises from ``f[m]`` to a peak
    at ``f[m+1]`` and falls to ``f[m+2]``, ``f`` = :func:`mel_frequencies` (n_mels + 2 points),
    evaluated at the FFT bin frequencies; ``norm="slaney"`` scales each to unit area."""
    fmax = sample_rate / 2.0 if fmax is None else float(fmax)
    if not 0 <= fmin < fmax <= sample_rate / 2.0:
        raise ValueError(
            f"mel filterbank: expected 0 <= fmin < fmax <= {sample_rate / 2}, got fmin={fmin}, fmax={fmax}"
        )
    if norm not in (None, "slaney"):
        raise ValueError(f"mel filterbank: norm must be 'slaney' or None, got {norm!r}")
    bins = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    edges = mel_frequencies(n_mels + 2, fmin, fmax, htk)
    widths = np.diff(edges)
    ramps = edges[:, None] - bins[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    if norm == "slaney":
        weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(np.float32)


AMIN = 1e-10  # power floor before the log
_MEL_CACHE: OrderedDict[tuple, np.ndarray] = OrderedDict()
_MEL_CACHE_SIZE = 8


def fix_length(wave_: np.ndarray, length: int) -> np.ndarray:
    """``wave_`` cut to its first ``length`` samples or zero-padded at the end to ``length``."""
    out = np.zeros(length, dtype=np.float32)
    n = min(length, len(wave_))
    out[:n] = wave_[:n]
    return out


def waves_digest(waves: list[np.ndarray]) -> str:
    """A digest of the waveforms (lengths and float32 samples): a cache key for features of them."""
    h = hashlib.blake2b(digest_size=16)
    for w in waves:
        a = np.ascontiguousarray(w, dtype=np.float32)
        h.update(len(a).to_bytes(8, "little"))
        h.update(a.tobytes())
    return h.hexdigest()


def log_mel(
    waves: list[np.ndarray],
    sample_rate: int,
    n_mels: int = 40,
    n_fft: int = 256,
    hop: int = 80,
    frames: int = 64,
    fmin: float = 0.0,
    fmax: float | None = None,
    top_db: float | None = 80.0,
    htk: bool = False,
    chunk: int = 256,
) -> np.ndarray:
    """(N, n_mels, frames) float32 log-mel spectrograms in dB (see the module docstring).

    Each clip is first cut or zero-padded at the end to ``(frames - 1) * hop`` samples, so that
    centred STFT frames give exactly ``frames`` frames. The result is cached per process (a
    small LRU keyed by the parameters and a digest of the waveforms), so the server and every
    client of a process compute it once; callers must not modify the returned array."""
    import torch

    key = (waves_digest(waves), sample_rate, n_mels, n_fft, hop, frames, fmin, fmax, top_db, htk)
    if key in _MEL_CACHE:
        _MEL_CACHE.move_to_end(key)
        return _MEL_CACHE[key]
    if frames < 1 or hop < 1 or n_fft < 2:
        raise ValueError(f"log_mel: expected frames >= 1, hop >= 1, n_fft >= 2 (got {frames}, {hop}, {n_fft})")
    length = (frames - 1) * hop
    fb = torch.from_numpy(mel_filterbank(sample_rate, n_fft, n_mels, fmin, fmax, htk))
    window = torch.hann_window(n_fft, periodic=True)
    out = np.empty((len(waves), n_mels, frames), dtype=np.float32)
    for start in range(0, len(waves), chunk):
        batch = torch.from_numpy(np.stack([fix_length(w, length) for w in waves[start : start + chunk]]))
        spec = torch.stft(
            batch, n_fft, hop_length=hop, window=window, center=True, pad_mode="constant", return_complex=True
        )
        mel = fb @ torch.view_as_real(spec).pow(2).sum(-1)
        db = 10.0 * torch.log10(mel.clamp_min(AMIN))
        if top_db is not None:
            db = torch.maximum(db, db.amax(dim=(1, 2), keepdim=True) - top_db)
        out[start : start + len(batch)] = db.numpy()
    _MEL_CACHE[key] = out
    while len(_MEL_CACHE) > _MEL_CACHE_SIZE:
        _MEL_CACHE.popitem(last=False)
    return out


def standardize_clips(features: np.ndarray) -> np.ndarray:
    """Each clip to zero mean and unit variance over all its values (per-utterance
    normalization; no statistics shared between clips, so every process and every subset
    gives the same features)."""
    axes = tuple(range(1, features.ndim))
    mean = features.mean(axis=axes, keepdims=True)
    std = features.std(axis=axes, keepdims=True)
    return ((features - mean) / np.maximum(std, 1e-5)).astype(np.float32)


# -- resampling --------------------------------------------------------------------------------
def resample(waves: list[np.ndarray], from_rate: int, to_rate: int) -> list[np.ndarray]:
    """``waves`` resampled from ``from_rate`` to ``to_rate`` Hz (polyphase filtering,
    :func:`scipy.signal.resample_poly`, ratio reduced by the gcd); float32."""
    if from_rate == to_rate:
        return [np.asarray(w, dtype=np.float32) for w in waves]
    from math import gcd

    from scipy.signal import resample_poly

    g = gcd(int(from_rate), int(to_rate))
    up, down = int(to_rate) // g, int(from_rate) // g
    return [resample_poly(w, up, down).astype(np.float32) for w in waves]
