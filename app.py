"""Chat with a model in the browser and watch EAGLE speculative decoding at work: `python app.py [options]`.

The same port serves an OpenAI-compatible API under /v1 (app/api.py); `--api-only` serves the API alone.
Also the Hugging Face Spaces entry point: Spaces runs this file as it is (host and port come from the
GRADIO_SERVER_NAME / GRADIO_SERVER_PORT environment variables that Spaces sets).
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from app.zerogpu import on_gpu  # before torch: on ZeroGPU hardware `spaces` must patch CUDA first

from engine import CheckpointError, Engine, LoadOptions, freeze_heap

from app.api import Access, Api, serve
from app.chat import ChatService, EngineThread
from app.models import ModelFolders, default_data_dir
from app.store import ChatStore
from app.ui import CSS, build_demo, poll_queue_gently


ON_SPACES = "SPACE_ID" in os.environ  # a Hugging Face Space is a public page, as --share is


def parse_auth(value: str) -> tuple[str, str]:
    user, colon, password = value.partition(":")
    if not colon or not user or not password:
        raise argparse.ArgumentTypeError("--auth takes user:password")
    return user, password


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    LoadOptions.add_arguments(parser, only=("base", "head", "device", "dtype", "quantization", "kernels", "corpus",
                                            "chat_template", "max_memory"))
    add("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    add("--port", type=int, help="port (default 7860, or the next free one)")
    add("--share", action="store_true", help="also serve through a temporary public gradio.live link")
    add("--auth", type=parse_auth, action="append",
        help="user:password required to open the app (recommended with --share); repeat it for several users, each "
             "of whom sees only their own chats")
    add("--data-dir", type=Path, default=default_data_dir(),
        help="where the app keeps its chats (chats.sqlite3) and, by default, its models folder (default: %(default)s)")
    add("--models-dir", type=Path, default=None,
        help="a folder of .gguf files and EAGLE heads the Models tab lists (default: DATA_DIR/models)")
    add("--max-new-tokens", type=int, default=None,
        help="longest answer a user may ask for (default: what the model's context holds): the settings slider's "
             "maximum, and where the API cuts a longer max_tokens")
    add("--api-key", help="key the OpenAI-compatible API at /v1 requires (Authorization: Bearer KEY); "
        "--auth's user:password is a key too")
    add("--api-only", action="store_true",
        help="serve the API alone, without the UI: up at once, answering 503 until the model is loaded")
    args = parser.parse_args(argv)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.api_only and args.share:
        parser.error("--share makes a link to the UI, which --api-only does not serve")
    return args


def load_service(args: argparse.Namespace, engine_thread: EngineThread) -> ChatService:
    """The engine the arguments name, loaded on the engine thread, behind the ChatService that UI and API share."""
    try:
        options = LoadOptions.from_args(args)
        engine = engine_thread.call(Engine.from_options, options)
    except (CheckpointError, ValueError, OSError, ImportError, MemoryError) as err:  # paths, sizes, devices, packages
        raise SystemExit(f"app.py: error: {err}") from None
    freeze_heap()
    service = ChatService(engine, engine_thread, options)
    service.stream = on_gpu(service.stream)  # the generation function, under spaces.GPU on ZeroGPU hardware
    return service


def folders(args: argparse.Namespace) -> ModelFolders:
    return ModelFolders.default(models=args.models_dir or args.data_dir / "models")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # --api-only serves clients that name the model they were given: no request swaps it for everyone else
    api = Api(Access.from_options(args.api_key, args.auth, args.share), args.max_new_tokens,
              folders=None if args.api_only else folders(args))
    if warning := api.access.warning(args.host or os.environ.get("GRADIO_SERVER_NAME")):
        logging.warning("⚠ %s", warning)
    engine_thread = EngineThread()  # loads the model and runs every step of every answer (see app/chat.py)
    if args.api_only:
        serve(api, args.host, args.port, lambda: api.attach(load_service(args, engine_thread)))
        return
    service = load_service(args, engine_thread)
    api.attach(service)
    store = ChatStore(args.data_dir / "chats.sqlite3")
    if store.problem:
        logging.warning("⚠ %s", store.problem)
    demo = build_demo(service, args.max_new_tokens, store=store, folders=folders(args),
                      shared=(args.share or ON_SPACES) and not args.auth)
    freeze_heap()  # gradio's objects too: no full collection over them mid-answer
    demo.queue(max_size=64)
    poll_queue_gently(demo)
    demo.launch(
        server_name=args.host, server_port=args.port, share=args.share, auth=args.auth, css_paths=[CSS],
        footer_links=["gradio", "settings"], app_kwargs={"routes": api.routes()},  # /v1 first, then Gradio's
        # Gradio's run history keeps every answer in the browser's localStorage and writes the whole of it again on
        # each streamed update: the page's work per update grew with every answer, and chats outlived Clear.
        run_history=False,
    )


if __name__ == "__main__":
    main()
