"""Generated videos as MP4 files through PyAV (FFmpeg): H.264 video (yuv420p, so players and
browsers show it) and, when there is sound, an AAC audio track."""
from __future__ import annotations

import io
from fractions import Fraction

import numpy as np


def encode_mp4(frames: np.ndarray, frame_rate: float, audio=None,
               sample_rate: int | None = None, crf: int = 18) -> bytes:
    """frames (F, H, W, 3) uint8 at frame_rate; audio (channels, samples) floats in [-1, 1]
    (a tensor or array) at sample_rate, or None. Odd sides are padded by one pixel (H.264's
    4:2:0 needs even ones)."""
    import av

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be (F, H, W, 3) uint8, got {frames.shape} {frames.dtype}")
    frames = _even_sides(frames)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        rate = Fraction(frame_rate).limit_denominator(1001)
        video = container.add_stream("libx264", rate=rate)
        video.width, video.height = frames.shape[2], frames.shape[1]
        video.pix_fmt = "yuv420p"
        video.options = {"crf": str(crf)}
        sound = None
        if audio is not None:
            sound = container.add_stream("aac", rate=int(sample_rate))
        for frame in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
        if sound is not None:
            _write_audio(container, sound, audio, int(sample_rate))
    return buffer.getvalue()


def _write_audio(container, stream, audio, sample_rate: int) -> None:
    import av

    samples = np.asarray(audio.float().cpu() if hasattr(audio, "float") else audio,
                         dtype=np.float32)
    samples = np.clip(samples if samples.ndim == 2 else samples[None], -1, 1)
    layout = "mono" if samples.shape[0] == 1 else "stereo"
    samples = samples[:2]
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp",
                                       layout=layout)
    frame.sample_rate = sample_rate
    container.mux(stream.encode(frame))
    container.mux(stream.encode())


def _even_sides(frames: np.ndarray) -> np.ndarray:
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not (pad_h or pad_w):
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def decode_mp4(data: bytes) -> tuple[np.ndarray, float, bool]:
    """(frames (F, H, W, 3) uint8, frame rate, has audio) of an MP4 file's bytes."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate)
        has_audio = bool(container.streams.audio)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    return np.stack(frames), rate, has_audio
