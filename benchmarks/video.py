"""Issue 39's GPU acceptance run for video inputs, on dummy Qwen2.5-VL-7B (benchmarks/configs, random
weights), in one process and one engine:

    python3 benchmarks/video.py [--videos 16] [--texts 64] [--seconds 30] [--smoke]

clip     a synthetic 30 s clip made here with PyAV (640x360 at 24 fps, libx264 veryfast, else mpeg4: a
         random texture panning sideways and a square crossing it, so every frame differs); its size.
decode   foveal.server.video.decode_video on the clip's bytes at 2 fps (60 frames) with the server's
         default limits and the model's own frame rule (processor.frame_indices, as the server's
         prompt builder calls it), the VideoClip built as the server builds it: median of 3 (decode_s).
prep     processor.render_chat with that VideoClip (resize, normalize, patchify, content hash): median
         of 3 (preprocess_s); the prompt's video tokens and prompt tokens.
single   one video request alone (after warm-up: two video requests one after the other, then 2 videos
         with 4 text streams, so Triton's compiles stay out), greedy 128 out: TTFT, decode tok/s (tokens
         after the first over the time after the first), and encoder time two ways: the engine's own
         (the delta's encoder_time_s: the runner's wall time around model.encode_images, which ends in a
         device sync of its own; with async scheduling it may include a previous step still on the GPU)
         and the tower alone (model.encode_images on the prompt's item, its patches' copy to the device
         included, synchronized, median of 3).
mixed    64 text streams (random ~256-token prompts, greedy 256 out, ignore_eos) started first; once all
         of them have a token, 24 text-only steps (the baseline), then 16 video requests at once (each its
         own frames: the decoded clip shifted sideways by a different amount, so neither the vision
         cache nor the prefix cache makes one free; prefix cache reset first), greedy 128 out. Every text
         stream's gaps between token arrivals (wall clock at each delta) are split into baseline, the
         video window (from the videos' arrival to the last video's first token: a gap counts when it
         overlaps it) and after; reported: p50 / p99 / max gap of each, text output tok/s over the whole
         phase, the videos' TTFT p50 / p99 (from their arrival) and their engine encoder time.

Prompts are preprocessed before their phase starts (the server does that on its input pool, beside
the engine loop), so the step loop's times are the engine's alone. Times come from the engine's step
loop (gpu_workloads.py's style), with the host's time per step phase. Ends with one JSON line.

`--smoke` runs the same code on CPU with the tiny Qwen2.5-VL config, a 3 s 160x96 clip, 2 videos and 4
text streams: it checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import benchmarks.gpu_workloads as gw  # noqa: E402
from foveal.config import ServerConfig  # noqa: E402
from foveal.request import VideoClip  # noqa: E402

log = gw.log


# -- the clip ------------------------------------------------------------------------------------
def make_clip(seconds: float, width: int, height: int, rate: int, seed: int = 0) -> tuple[bytes, str]:
    """An mp4 of `seconds` at `rate` fps: a blocky random texture panning 3 px a frame, a bright square
    crossing it (every frame differs; the encoder still has something to predict)."""
    import av

    g = np.random.default_rng(seed)
    base = g.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    base = np.kron(base, np.ones((8, 8, 1), np.uint8))[:height, :width]
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream(codec, rate=rate, options={"preset": "veryfast"} if codec == "libx264" else {})
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        if codec == "mpeg4":
            s.bit_rate = 2_000_000
        side = max(8, height // 6)
        for i in range(round(seconds * rate)):
            rgb = np.roll(base, 3 * i, axis=1)
            x, y = (7 * i) % (width - side), (5 * i) % (height - side)
            rgb[y : y + side, x : x + side] = 255
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = i
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue(), codec


def server_limits():
    """The server's VideoLimits at its default ServerConfig (foveal/server/prompts.py builds the same)."""
    from foveal.server import video
    from foveal.server.prompts import _VIDEO_DECODED_BYTES

    cfg = ServerConfig()
    return cfg, video.VideoLimits(
        max_bytes=cfg.max_video_bytes,
        max_duration_s=cfg.max_video_duration,
        max_frames=cfg.max_video_frames,
        max_decoded_bytes=min(_VIDEO_DECODED_BYTES, cfg.max_video_bytes_in_flight),
        deadline_s=cfg.input_timeout,
    )


def decode(llm, data: bytes, fps: float) -> VideoClip:
    """The clip's frames sampled at `fps` by the model's rule, as the server's _decode_videos does."""
    from foveal.server import video

    cfg, limits = server_limits()
    proc = llm.processor

    def choose(meta):
        return proc.frame_indices(
            meta.total_frames, meta.fps, fps=fps, num_frames=None, max_frames=cfg.max_video_frames
        )

    v = video.decode_video(data, limits, choose)
    meta = v.metadata
    sampled_fps = len(v.indices) / meta.total_frames * meta.fps if meta.fps > 0 else 1.0
    times = tuple(i / meta.fps for i in v.indices) if meta.fps > 0 else None
    return VideoClip(v.frames, sampled_fps, video.video_hash(v), times)


def variant(clip: VideoClip, k: int) -> VideoClip:
    """Clip k: the frames shifted 11*k px sideways (other pixels, so another vision-cache and prefix-cache
    key), the same rate and times."""
    if k == 0:
        return clip
    h = hashlib.sha256(f"{clip.content_hash}|roll{k}".encode()).hexdigest()
    return VideoClip(np.roll(clip.frames, 11 * k, axis=2), clip.fps, h, clip.timestamps)


def video_prompt(llm, clip: VideoClip, k: int):
    content = [{"type": "video"}, {"type": "text", "text": f"Describe what happens in clip {k}."}]
    return llm.processor.render_chat([{"role": "user", "content": content}], videos=[clip])


def median_time(fn, reps: int = 3):
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


# -- the step loop with every delta's arrival --------------------------------------------------------
class Tracker:
    """Adds requests and steps the engine, keeping each request's add time, token arrival times (one per
    delta with tokens), token count and the engine's encoder time for it."""

    def __init__(self, llm):
        self.llm, self.eng = llm, llm.engine
        self.added: dict[str, float] = {}
        self.times: dict[str, list[float]] = {}
        self.count: dict[str, int] = {}
        self.encoder: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        for k in ("schedule", "execute", "update"):
            self.eng.step_seconds[k] = 0.0
        self.eng.step_seconds["steps"] = 0

    def add(self, prompts: list, params) -> list[str]:
        gw._sync()
        now = time.perf_counter()
        ids = [self.eng.add_request(self.llm.processor.request(p, params)) for p in prompts]
        for rid in ids:
            self.added[rid], self.times[rid], self.count[rid] = now, [], 0
        return ids

    def step(self) -> None:
        deltas = self.eng.step()
        now = time.perf_counter()
        for d in deltas:
            if d.request_id not in self.times:
                continue
            if d.token_ids:
                self.times[d.request_id].append(now)
                self.count[d.request_id] += len(d.token_ids)
            self.encoder[d.request_id] = d.encoder_time_s
            if d.error:
                self.errors[d.request_id] = d.error

    def until_first(self, ids: list[str]) -> None:
        """Step until each of `ids` has a token (a failed request raises: it never will)."""
        while self.eng.has_unfinished() and any(not self.times[r] for r in ids):
            self.step()
        self.check()

    def drain(self) -> None:
        while self.eng.has_unfinished():
            self.step()
        self.check()

    def check(self) -> None:
        if self.errors:
            rid, err = next(iter(self.errors.items()))
            raise RuntimeError(f"{len(self.errors)} request(s) failed, e.g. {rid}: {err}")

    def ttft(self, rid: str) -> float:
        return self.times[rid][0] - self.added[rid]

    def ms_per_step(self) -> dict:
        s = self.eng.step_seconds
        n = max(1, s["steps"])
        return {k: round(s[k] / n * 1e3, 3) for k in ("schedule", "execute", "update")}


def encoder_alone(llm, prompt, reps: int = 3) -> float:
    """model.encode_images on the prompt's video item, synchronized: median of `reps` (after one)."""
    model = llm.engine.model
    data = [it.data for it in prompt.items if it.modality == "video"]

    def once():
        with torch.inference_mode():
            model.encode_images(data)
        gw._sync()

    once()
    gw._sync()
    return median_time(once, reps)[0]


# -- the phases ------------------------------------------------------------------------------------
def single(llm, prompt, a) -> dict:
    t = Tracker(llm)
    (rid,) = t.add([prompt], gw.greedy(a.video_out))
    t.drain()
    ts = t.times[rid]
    r = {
        "ttft_s": t.ttft(rid),
        "decode_tok_s": (t.count[rid] - 1) / (ts[-1] - ts[0]) if len(ts) > 1 else None,
        "output_tokens": t.count[rid],
        "encoder_engine_s": t.encoder.get(rid),
        "steps": t.eng.step_seconds["steps"],
        "ms_per_step": t.ms_per_step(),
    }
    log(
        f"single video: TTFT {r['ttft_s'] * 1e3:.1f} ms, decode {r['decode_tok_s'] or 0:.1f} tok/s "
        f"({r['output_tokens']} tokens), encoder (engine) {(r['encoder_engine_s'] or 0) * 1e3:.1f} ms, "
        f"{r['steps']} steps, host ms/step {r['ms_per_step']}"
    )
    return r


def mixed(llm, clip: VideoClip, a, V: int) -> dict:
    """Text streams first, a baseline of text-only steps, then the videos all at once."""
    texts = gw.random_prompts(a.texts, a.text_len, V, 5)
    t0 = time.perf_counter()
    videos = [video_prompt(llm, variant(clip, k), k) for k in range(1, a.videos + 1)]
    log(f"mixed: {a.videos} video prompts preprocessed in {time.perf_counter() - t0:.1f} s")
    llm.engine.reset_prefix_cache()
    t = Tracker(llm)
    tids = t.add(texts, gw.greedy(a.text_out))
    t.until_first(tids)
    for _ in range(a.base_steps):
        t.step()
    vids = t.add(videos, gw.greedy(a.video_out))
    t_v = t.added[vids[0]]
    t.until_first(vids)
    t_done = time.perf_counter()
    live = sum(t.count[r] < a.text_out for r in tids)  # text streams still running at the window's end
    t.drain()
    base, window, after = [], [], []
    for r in tids:
        ts = t.times[r]
        for prev, now in zip(ts, ts[1:]):
            gap = now - prev
            (base if now <= t_v else after if prev >= t_done else window).append(gap)
    text_tokens = sum(t.count[r] for r in tids)
    text_wall = max(t.times[r][-1] for r in tids) - t.added[tids[0]]
    ttft = sorted(t.ttft(r) for r in vids)
    enc = [t.encoder.get(r, 0.0) for r in vids]

    def gaps(xs):
        return {
            "n": len(xs),
            "p50_ms": _ms(pct(xs, 0.5)),
            "p99_ms": _ms(pct(xs, 0.99)),
            "max_ms": _ms(pct(xs, 1)),
        }

    r = {
        "videos": a.videos,
        "texts": a.texts,
        "video_window_s": t_done - t_v,
        "texts_live_at_window_end": live,
        "text_gaps_baseline": gaps(base),
        "text_gaps_video_window": gaps(window),
        "text_gaps_after": gaps(after),
        "text_output_tokens": text_tokens,
        "text_tok_s": text_tokens / text_wall,
        "video_ttft_p50_s": pct(ttft, 0.5),
        "video_ttft_p99_s": pct(ttft, 0.99),
        "video_encoder_engine_mean_s": sum(enc) / len(enc),
        "video_output_tokens": sum(t.count[r] for r in vids),
        "steps": t.eng.step_seconds["steps"],
        "ms_per_step": t.ms_per_step(),
    }
    log(
        f"mixed: {a.texts} text streams + {a.videos} videos: text {r['text_tok_s']:.1f} tok/s; text gaps "
        f"baseline {r['text_gaps_baseline']}, video window ({r['video_window_s']:.2f} s, {live} streams "
        f"live at its end) {r['text_gaps_video_window']}, after {r['text_gaps_after']}; video TTFT p50 "
        f"{r['video_ttft_p50_s'] * 1e3:.0f} ms p99 {r['video_ttft_p99_s'] * 1e3:.0f} ms, encoder (engine) "
        f"mean {r['video_encoder_engine_mean_s'] * 1e3:.1f} ms; {r['steps']} steps, host ms/step "
        f"{r['ms_per_step']}"
    )
    return r


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def warm(llm, clip: VideoClip, a, V: int) -> None:
    """Two lone video requests, then 2 videos beside 4 text streams: first-use costs and compiles out."""
    t0 = time.perf_counter()
    for k in (101, 102):
        gw.run(llm, [video_prompt(llm, variant(clip, k), k)], [gw.greedy(8)])
    prompts = [video_prompt(llm, variant(clip, k), k) for k in (103, 104)]
    prompts += gw.random_prompts(4, a.text_len, V, 99)
    gw.run(llm, prompts, [gw.greedy(8)] * len(prompts))
    log(f"warm-up: {time.perf_counter() - t0:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", type=int, default=16)
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0, help="the clip's length")
    ap.add_argument("--size", default="640x360", help="the clip's width x height")
    ap.add_argument("--source-fps", type=int, default=24)
    ap.add_argument("--fps", type=float, default=2.0, help="the sampling rate the frames are decoded at")
    ap.add_argument("--text-len", type=int, default=256)
    ap.add_argument("--text-out", type=int, default=256)
    ap.add_argument("--video-out", type=int, default=128)
    ap.add_argument("--base-steps", type=int, default=24, help="text-only steps before the videos come")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-encoder-tokens-per-step", type=int, default=None,
                    help="the encoder's budget a step, in embeddings (default: the engine's)")  # fmt: skip
    gw.engine_options(ap)
    a = ap.parse_args()
    gw.setup(a, "video.py")
    if a.smoke:  # and small counts
        a.videos, a.texts, a.seconds, a.size = 2, 4, 3.0, "160x96"
        a.text_len, a.text_out, a.video_out, a.base_steps, a.max_model_len = 16, 24, 8, 4, 4096
    else:
        log(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, eager={a.enforce_eager}")
    width, height = (int(x) for x in a.size.split("x"))
    out: dict = {"benchmark": "video", "commit": os.environ.get("FOVEAL_COMMIT", "?")}

    t0 = time.perf_counter()
    data, codec = make_clip(a.seconds, width, height, a.source_fps)
    out["clip"] = {
        "seconds": a.seconds, "size": a.size, "source_fps": a.source_fps, "codec": codec, "bytes": len(data),
    }  # fmt: skip
    log(f"clip: {a.seconds:g} s {a.size} at {a.source_fps} fps, {codec}, {len(data) / 1e6:.2f} MB "
        f"(made in {time.perf_counter() - t0:.1f} s)")  # fmt: skip

    llm = gw.engine(
        "qwen2.5-vl-7b.json", a, max_model_len=a.max_model_len, max_num_seqs=a.texts + a.videos,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_encoder_tokens_per_step=a.max_encoder_tokens_per_step,
    )  # fmt: skip
    out["budgets"] = {"max_num_batched_tokens": a.max_num_batched_tokens,
                      "max_encoder_tokens_per_step": a.max_encoder_tokens_per_step}  # fmt: skip
    V = min(150000, llm.processor.info.vocab_size - 64)  # text ids below the special ones
    decode_s, clip = median_time(lambda: decode(llm, data, a.fps))
    preprocess_s, prompt = median_time(lambda: video_prompt(llm, clip, 0))
    video_tokens = sum(it.num_embeds for it in prompt.items if it.modality == "video")
    out.update(
        decode_s=decode_s, frames=len(clip.frames), frame_shape=list(clip.frames.shape[1:]),
        sampled_fps=clip.fps, preprocess_s=preprocess_s, video_tokens=video_tokens,
        prompt_tokens=len(prompt.prompt_token_ids),
    )  # fmt: skip
    log(
        f"decode at {a.fps:g} fps: {len(clip.frames)} frames {tuple(clip.frames.shape[1:])} in "
        f"{decode_s * 1e3:.0f} ms; preprocess {preprocess_s * 1e3:.0f} ms: {video_tokens} video tokens, "
        f"{len(prompt.prompt_token_ids)} prompt tokens (medians of 3)"
    )

    warm(llm, clip, a, V)
    out["encoder_alone_s"] = encoder_alone(llm, prompt)
    log(f"vision tower alone on the clip: {out['encoder_alone_s'] * 1e3:.1f} ms (median of 3, synchronized)")
    llm.engine.reset_prefix_cache()
    out["single"] = single(llm, prompt, a)
    out["mixed"] = mixed(llm, clip, a, V)
    print(json.dumps(out, default=lambda x: round(x, 4) if isinstance(x, float) else str(x)))


if __name__ == "__main__":
    main()
