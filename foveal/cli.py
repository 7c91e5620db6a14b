"""Command line: `foveal serve` (the OpenAI-compatible server) and `foveal generate --prompt ...`
(offline generation with streaming output)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from foveal.config import default_log_level


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model", default=None, help="GGUF file, HF folder or Hub repo id (default: embedded SmolLM2)"
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights from the config alone (--model: a config.json or its folder)",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "gguf"],
        help="auto (default): a GGUF's Q4_0/Q4_1/Q8_0 linears run as stored on a CPU with the native "
        "AVX2 kernel, with int8 activations as llama.cpp (outputs differ slightly from the dense model's), "
        "dense elsewhere; gguf: insist on that (an error off the CPU); none: dequantize every weight to "
        "--dtype (the dense path the parity tests compare with transformers)",
    )
    g.add_argument(
        "--pooling",
        default="auto",
        choices=["auto", "none", "last", "mean"],
        help="/v1/embeddings: how a prompt's hidden states are pooled (auto: an embedding model's own, e.g. "
        "Qwen3-Embedding's last token; a generative model serves none unless last or mean is named)",
    )
    g.add_argument("--device", default="auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
    g.add_argument(
        "--max-request-kv-tokens",
        type=int,
        default=None,
        help="most K/V tokens (prompt + output) one request may hold; checked at admission "
        "(default: --max-model-len)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: share of GPU memory for weights, activations and the KV pool (the pool gets the rest)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs / recorded CPU decode steps (every step runs eagerly)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "int8"],
        help="KV pool element type; fp8/int8 quantize K/V (per-token scales) to hold ~2x the tokens",
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="per-step token budget (prefill chunks + decodes); default 2048, 128 for `serve` on CPU",
    )
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument(
        "--attention-backend",
        default="auto",
        help="auto (triton on CUDA; on CPU, cpu: a native decode kernel built at first use, else torch), "
        "torch, cpu or triton",
    )
    g.add_argument(
        "--shared-prefix-min-rows",
        type=int,
        default=64,
        help="triton: decode rows behind one cached prefix that read it once per tile of rows (0: never)",
    )
    g.add_argument(
        "--shared-prefix-min-tokens",
        type=int,
        default=1024,
        help="triton: the shortest shared prefix (keys) read that way",
    )
    g.add_argument(
        "--request-rows-min-tokens",
        type=int,
        default=256,
        help="triton: a request's own decode rows (verify rows, DFlash and block diffusion blocks) read "
        "its keys once for all of them from this many keys (0: never)",
    )
    g.add_argument(
        "--no-prefix-cache",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not reuse KV blocks across requests with a common prefix",
    )
    g.add_argument(
        "--vision-cache-memory", type=int, default=256 * 2**20, help="bytes of cached image embeddings"
    )
    g.add_argument(
        "--max-encoder-tokens-per-step",
        type=int,
        default=None,
        help="image embedding tokens encoded per step",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the device runs this one (default: on for CUDA)",
    )
    g.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding as a JSON object (as in vLLM), e.g. {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}; drafts per row and '
        'step follow load and acceptance unless "adaptive": false; default: off',
    )
    g.add_argument(
        "--reasoning-parser",
        default="auto",
        help="think-marker format of the model's reasoning (auto: from the tokenizer; none; or a name in "
        "foveal/parsing/reasoning.py, e.g. qwen3, deepseek_r1; harmony: gpt-oss, detected by auto)",
    )
    g.add_argument(
        "--tool-call-parser",
        default="auto",
        help="tool-call format (auto: from the chat template; a template without tool support gets a "
        "generic Hermes-style tool prompt; none; or a name, e.g. hermes, llama3_json, mistral)",
    )
    g.add_argument(
        "--enable-thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the default of chat_template_kwargs.enable_thinking (default: the chat template's)",
    )
    g.add_argument(
        "--grammar-cache-memory",
        type=int,
        default=512 * 2**20,
        help="bytes of compiled grammars kept (estimated; least recently used go first)",
    )
    g.add_argument(
        "--thinking-budget",
        type=int,
        default=None,
        help="thinking tokens a request may spend before the end of thinking is forced (default: no limit)",
    )
    g.add_argument(
        "--diffusion-config", type=_json_object, default=None,
        help='diffusion models: the denoising knobs a request gets by default, e.g. \'{"steps": 4, '
        '"block_length": 32, "threshold": 0.9}\' (any of steps, block_length, threshold, min_threshold, '
        "max_tokens_per_step, editing_threshold, stability_steps, max_post_steps)",
    )  # fmt: skip
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format)")
    g.add_argument(
        "--max-loras", type=int, default=4, help="adapters on the device at once (one step's most)"
    )
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    g.add_argument(
        "--max-cpu-loras", type=int, default=None,
        help="adapters kept in host memory (default 2 x --max-loras); others are read again when used",
    )  # fmt: skip
    g.add_argument(
        "--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
        help='adapters served from the start: name=path (a folder or a Hub id), or a JSON object '
        '{"name": ..., "path": ...} (as in vLLM); the request\'s "model" field picks one',
    )  # fmt: skip
    g.add_argument("--log-level", default=default_log_level())


def _lora_module(value: str) -> tuple[str, str]:
    """--lora-modules item: name=path, or vLLM's JSON {"name", "path"[, "base_model_name"]}."""
    import json

    if value.lstrip().startswith("{"):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("name"), str)
            or not isinstance(obj.get("path"), str)
        ):
            raise argparse.ArgumentTypeError('a JSON LoRA module needs string "name" and "path"')
        return obj["name"], obj["path"]
    name, eq, path = value.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected name=path")
    return name, path


def _json_object(value: str) -> dict:
    """A JSON object flag (argparse error otherwise)."""
    import json

    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(out, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return out


def _speculative_config(value: str):
    """--speculative-config: a SpeculativeConfig, or an argparse error naming what is wrong."""
    from foveal.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(value)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        model=a.model,
        load_format=a.load_format,
        dtype=a.dtype,
        quantization=a.quantization,
        pooling=a.pooling,
        device=a.device,
        max_model_len=a.max_model_len,
        kv_cache_memory=a.kv_cache_memory,
        max_request_kv_tokens=a.max_request_kv_tokens,
        gpu_memory_utilization=a.gpu_memory_utilization,
        enforce_eager=a.enforce_eager,
        kv_cache_dtype=a.kv_cache_dtype,
        block_size=a.block_size,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        attention_backend=a.attention_backend,
        shared_prefix_min_rows=a.shared_prefix_min_rows,
        shared_prefix_min_tokens=a.shared_prefix_min_tokens,
        request_rows_min_tokens=a.request_rows_min_tokens,
        vision_cache_memory=a.vision_cache_memory,
        enable_prefix_caching=a.enable_prefix_caching,
        max_encoder_tokens_per_step=a.max_encoder_tokens_per_step,
        async_scheduling=a.async_scheduling,
        speculative_config=a.speculative_config,
        reasoning_parser=a.reasoning_parser,
        tool_call_parser=a.tool_call_parser,
        enable_thinking=a.enable_thinking,
        thinking_budget=a.thinking_budget,
        grammar_cache_bytes=a.grammar_cache_memory,
        diffusion_config=a.diffusion_config,
        enable_lora=a.enable_lora or bool(a.lora_modules),
        max_loras=a.max_loras,
        max_lora_rank=a.max_lora_rank,
        max_cpu_loras=a.max_cpu_loras,
        lora_modules=tuple(a.lora_modules),
    )


def cmd_generate(a: argparse.Namespace) -> int:
    from foveal.engine.llm import LLM
    from foveal.loader import ModelLoadError
    from foveal.request import SamplingParams

    try:
        params = SamplingParams(
            temperature=a.temperature,
            top_p=a.top_p,
            top_k=a.top_k,
            max_tokens=a.max_tokens,
            seed=a.seed,
            stop=a.stop or [],
        )
        llm = LLM(progress=True, **_engine_kwargs(a))
        ids = (
            llm.processor.apply_chat_template([{"role": "user", "content": a.prompt}])
            if not a.raw
            else llm.processor.tokenize(a.prompt)
        )
        t0 = time.perf_counter()
        n = 0
        last = None
        for d in llm.stream(ids, params):
            sys.stdout.write(d.text)
            sys.stdout.flush()
            n += len(d.token_ids)
            last = d
        dt = time.perf_counter() - t0
        sys.stdout.write("\n")
        if last is not None and last.error:
            print(f"error: {last.error}", file=sys.stderr)
            return 1
        print(
            f"[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s, finish: {last.finish_reason.value}]",
            file=sys.stderr,
        )
        return 0
    except (ValueError, ModelLoadError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_serve(a: argparse.Namespace) -> int:
    from foveal.config import EngineConfig, ServerConfig
    from foveal.engine.factory import build_engine
    from foveal.loader import ModelLoadError
    from foveal.server.app import create_app
    from foveal.server.serve import serve
    from foveal.server.transport import uvicorn_config_kwargs

    try:
        scfg = ServerConfig.from_env(
            host=a.host,
            port=a.port,
            api_key=a.api_key,
            served_model_name=a.served_model_name,
            max_queued_requests=a.max_queued_requests or None,  # 0: unbounded
            max_tokens=a.max_tokens or None,  # 0: up to the context
            request_timeout=a.request_timeout or None,  # 0: none
            metrics_public=a.metrics_public,
            ui=a.ui,
            drain_timeout=a.drain_timeout,
            api_key_file=a.api_key_file,
            allow_client_cache_salt=a.allow_client_cache_salt,
            shared_prefix_cache=a.shared_prefix_cache,
            limit_images_per_request=a.limit_images_per_request,
            limit_videos_per_request=a.limit_videos_per_request,
            max_video_bytes=a.max_video_bytes,
            max_video_duration=a.max_video_duration,
            max_video_frames=a.max_video_frames,
            max_video_bytes_in_flight=a.max_video_bytes_in_flight,
            limit_audios_per_request=a.limit_audios_per_request,
            max_audio_bytes=a.max_audio_bytes,
            max_audio_duration=a.max_audio_duration,
            allow_private_media_urls=a.allow_private_media_urls,
            allowed_local_media_path=a.allowed_local_media_path,
            media_fetch_timeout=a.media_fetch_timeout,
            body_timeout=a.body_timeout,
            header_timeout=a.header_timeout,
            max_connections=a.max_connections,
            keep_alive_timeout=a.keep_alive_timeout,
            input_timeout=a.input_timeout,
            trust_request_chat_template=a.trust_request_chat_template,
            max_request_image_pixels=a.max_request_image_pixels,
            max_image_pixels_in_flight=a.max_image_pixels_in_flight,
        )
        ecfg = EngineConfig.from_kwargs(serving=True, **_engine_kwargs(a))
        logging.getLogger(__name__).info("engine config: %s", ecfg)
        engine, processor = build_engine(ecfg, progress=True)  # the model loads before the port opens
    except (ValueError, ModelLoadError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(engine, processor, scfg)
    serve(  # uvicorn, draining the engine on SIGTERM first (server/serve.py)
        app,
        drain_timeout=scfg.drain_timeout,
        host=scfg.host,
        port=scfg.port,
        log_level=a.log_level.lower(),
        access_log=False,  # foveal.access logs each request with its request id instead
        # header deadline, keep-alive idle timeout and connection cap (the body deadline is the app's)
        **uvicorn_config_kwargs(
            header_timeout=scfg.header_timeout,
            keep_alive_timeout=scfg.keep_alive_timeout,
            max_connections=scfg.max_connections,
        ),
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foveal", description="Foveal serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text offline for one prompt")
    _engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="bearer token for /v1/* (default: $FOVEAL_API_KEY)")
    s.add_argument(
        "--api-key-file", default=None, help='JSON {"key": "tenant"}: several keys, one prefix cache each'
    )
    s.add_argument(
        "--allow-client-cache-salt",
        action="store_true",
        help="let clients split their prefix cache further (X-Tenant-Id header or cache_salt field)",
    )
    s.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="share the cached blocks of a chat's leading system message(s) across tenants (opt-in: a "
        "tenant can then tell that another used the same system prompt)",
    )
    s.add_argument("--served-model-name", default=None)
    s.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="tokens a request may generate: its max_tokens when it sends none, and the cap on what it "
        "asks for (/v1/models shows it); 0: up to the context",
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="waiting sequences over this: 429 (a request of more: 400); 0: unbounded",
    )
    s.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds without output, queueing included: 504; 0: none",
    )
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests get to finish before they end with an error",
    )
    s.add_argument(
        "--input-timeout",
        type=float,
        default=10.0,
        help="seconds a request's input work (template, tokenizing, images) may take: then a 400",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept chat templates sent in requests (chat_template): they are code the server runs",
    )
    s.add_argument(
        "--max-request-image-pixels",
        type=int,
        default=64 * 2**20,
        help="decoded pixels of all images in one request: 413 over it",
    )
    s.add_argument(
        "--max-image-pixels-in-flight",
        type=int,
        default=128 * 2**20,
        help="decoded image pixels being processed at once across requests: over it a request waits, "
        "then gets a 429",
    )
    s.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    s.add_argument(
        "--no-ui", dest="ui", action="store_false", help="no built-in page at / (the chat and the dashboard)"
    )
    s.add_argument("--limit-images-per-request", type=int, default=8)
    s.add_argument("--limit-videos-per-request", type=int, default=2)
    s.add_argument(
        "--max-video-bytes-in-flight",
        type=int,
        default=2 * 2**30,
        help="decoded video frames held at once across requests: over it a request waits, then gets a 429",
    )
    s.add_argument("--limit-audios-per-request", type=int, default=4)
    s.add_argument("--max-audio-bytes", type=int, default=25 * 2**20, help="encoded bytes of one audio clip")
    s.add_argument(
        "--max-audio-duration",
        type=float,
        default=600.0,
        help="seconds of one audio clip (refused before decoding)",
    )
    s.add_argument("--max-video-bytes", type=int, default=64 * 2**20, help="encoded bytes of one video")
    s.add_argument(
        "--max-video-duration",
        type=float,
        default=600.0,
        help="seconds of one video (refused before decoding)",
    )
    s.add_argument(
        "--max-video-frames",
        type=int,
        default=256,
        help="frames sampled from one video (a request may ask fewer)",
    )
    s.add_argument(
        "--allow-private-media-urls", action="store_true", help="fetch image URLs on private addresses"
    )
    s.add_argument("--allowed-local-media-path", default=None, help="serve local image files under this dir")
    s.add_argument("--media-fetch-timeout", type=float, default=10.0, help="seconds per image URL fetch")
    s.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds for a request's headers to arrive (from connect or the last response); then closed",
    )
    s.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds for a whole request body to arrive: 408"
    )
    s.add_argument(
        "--keep-alive-timeout", type=float, default=5.0, help="seconds an idle keep-alive connection stays"
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections at most; more are refused (503 and closed)",
    )
    s.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
