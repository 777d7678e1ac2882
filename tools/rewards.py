"""List the rewards, score a folder of images with one before spending a cluster on it, or serve rewards over HTTP.

    python -m tools.rewards --list
    python -m tools.rewards score --reward hpsv2 --images DIR --prompts prompts.txt [--option version=v2.0 ...]
    python -m tools.rewards serve CONFIG --host 0.0.0.0 --port 8000 [--device cuda:0]

score: the prompts file has one prompt per line: either one line (used for every image) or one line per image, in
the order of the image file names sorted. Prints one "file<TAB>score" line per image, then the mean.

serve: loads the rewards of CONFIG (a recipe preset, whose `rewards:` map is used, or a YAML file holding just such a
map) and scores them for `remote` rewards of training runs on other machines (grpo/rewards/service.py), so the
reward models take no memory on the training devices. Bad config or a busy port: one line, exit 2, before loading.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

import torch

from grpo.errors import ConfigError
from grpo.rewards.registry import build_rewards, check_rewards, describe_rewards
from grpo.schema import read_preset

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def _list() -> None:
    print("\n".join(describe_rewards()))


def _parse_option(text: str) -> tuple[str, object]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--option {text!r}: expected key=value, e.g. --option version=v2.0")
    return key.strip(), yaml.safe_load(value)


def _read_images(folder: Path) -> list[tuple[Path, torch.Tensor]]:
    import numpy as np
    from PIL import Image

    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ConfigError(f"--images: no {'/'.join(IMAGE_SUFFIXES)} files in {folder}")
    out = []
    for path in files:
        array = np.asarray(Image.open(path).convert("RGB"), dtype=np.uint8)
        out.append((path, torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255))
    return out


def _read_prompts(path: Path, count: int) -> list[str]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(lines) == 1:
        return lines * count
    if len(lines) != count:
        raise ConfigError(f"--prompts: {path} has {len(lines)} prompts for {count} images; give one line per image "
                          f"(in sorted file-name order) or a single line for all")
    return lines


def _score(args: argparse.Namespace) -> None:
    options = dict(_parse_option(o) for o in args.option)
    if args.batch_size is not None:
        options["batch_size"] = args.batch_size
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rewards = build_rewards({args.reward: {"weight": 1.0, **options}}, device)
    items = _read_images(Path(args.images))
    prompts = _read_prompts(Path(args.prompts), len(items))
    scores: list[float] = []
    start = 0
    while start < len(items):
        # Batch consecutive images of one size (a batch is one tensor).
        end = start + 1
        while end < len(items) and items[end][1].shape == items[start][1].shape:
            end += 1
        batch = torch.stack([t for _, t in items[start:end]]).to(device)
        scores += rewards(batch, prompts[start:end])[:, 0].tolist()
        start = end
    for (path, _), score in zip(items, scores):
        print(f"{path.name}\t{score:.6f}")
    values = torch.tensor(scores)
    finite = torch.isfinite(values)
    print(f"mean\t{values[finite].mean().item():.6f}\t({len(scores)} images"
          + (f", {int((~finite).sum())} non-finite left out)" if not finite.all() else ")"))


def _served_spec(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"CONFIG: {path} is not a file; give a recipe preset or a YAML rewards map")
    raw = read_preset(path)  # a preset's rewards may come from the base it extends
    spec = raw.get("rewards", raw) if isinstance(raw, dict) else raw
    check_rewards(spec)
    return spec


def _check_port(host: str, port: int) -> None:
    # Before the models load (minutes for ViT-H): a busy port would otherwise end the server only after that.
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as err:
        raise ConfigError(f"--port: cannot listen on {host}:{port} ({err.strerror}); choose a free port or host")


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from grpo.rewards.service import Batcher, make_app

    spec = _served_spec(Path(args.config))
    if args.max_batch < 1 or args.batch_wait_ms < 0:
        raise ConfigError("--max-batch must be >= 1 and --batch-wait-ms >= 0")
    _check_port(args.host, args.port)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rewards = build_rewards(spec, device)
    rewards.load()  # a reward server keeps its models on its device: `offload` is for training devices
    batcher = Batcher(rewards, args.max_batch, args.batch_wait_ms / 1000)
    logging.getLogger(__name__).info("serving %s on http://%s:%d (%s)", ", ".join(rewards.names), args.host,
                                     args.port, device)
    try:
        uvicorn.run(make_app(batcher), host=args.host, port=args.port, log_level="warning")
    finally:
        batcher.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.rewards", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the registered rewards and their options")
    sub = parser.add_subparsers(dest="command")
    score = sub.add_parser("score", help="score a folder of images")
    score.add_argument("--reward", required=True, help="registered name or pkg.module:factory")
    score.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="reward option (YAML value), repeatable")
    score.add_argument("--images", required=True, help="folder of images")
    score.add_argument("--prompts", required=True, help="text file: one prompt, or one per image")
    score.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    score.add_argument("--batch-size", type=int, default=None, dest="batch_size")
    serve = sub.add_parser("serve", help="serve rewards over HTTP for `remote` rewards")
    serve.add_argument("config", help="recipe preset (its rewards: map) or a YAML rewards map")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    serve.add_argument("--max-batch", type=int, default=64, dest="max_batch",
                       help="images of concurrent requests scored together, at most")
    serve.add_argument("--batch-wait-ms", type=float, default=10.0, dest="batch_wait_ms",
                       help="how long a request waits for others to batch with")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if args.list:
            _list()
        elif args.command == "score":
            _score(args)
        elif args.command == "serve":
            _serve(args)
        else:
            parser.print_help()
            return 2
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
