"""Precompute a preset's prompt-embedding caches (train and eval prompt files or datasets) before training, and the
source-image caches of datasets with images (FLUX.1-Kontext: grpo/references.py).

    python -m tools.prompts CONFIG [key=value ...]
"""

from __future__ import annotations

import logging
import resource
import sys
import time

from grpo.config import load_config
from grpo.device import accelerator, device_for_local_rank, local_devices
from grpo.errors import run_command
from grpo.inputs import resolve_model_path
from grpo.models import family_of
from grpo.prompts import ensure_cache, ensure_negative, ensure_references, read_prompt_set

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.prompts CONFIG [key=value ...]`: precompute the embedding caches of a preset."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0 if argv else 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def body() -> str:
        cfg = load_config(argv[0], argv[1:])
        model_path = resolve_model_path(cfg.model.path, cfg.model.revision)
        device = device_for_local_rank(0)  # NPU, GPU or CPU, as the recipe picks it
        files = [("data.train_prompts", cfg.data.train_prompts), ("data.eval_prompts", cfg.data.eval_prompts)]
        start = time.perf_counter()
        out = []
        for setting, f in files:
            if f:
                rows = read_prompt_set(f, setting)
                family_of(model_path).check_references(rows, setting, f, model_path)
                out.append(str(ensure_cache(model_path, f, setting, cfg.data, device, rows)))
                refs = ensure_references(model_path, f, rows, cfg.data.cache_dir, cfg.sampling.resolution, device)
                out += [str(refs)] if refs is not None else []
        negative = ensure_negative(model_path, cfg.sampling, cfg.data, device)  # true CFG's, when it is on
        out += [str(negative)] if negative is not None else []
        out = "\n".join(out)
        log.info("%s", peak_line(time.perf_counter() - start))
        return out

    return run_command(body)


def peak_line(seconds: float) -> str:
    """The command's wall time and peak memory: host RSS, and the fullest accelerator's peak allocation."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    line = f"prompts: {seconds:.1f} s, peak host RSS {rss / 2**30:.2f} GiB"
    kind, count = local_devices()
    if kind == "cpu":
        return line
    acc = accelerator()
    peak = max(acc.max_memory_allocated(i) for i in range(count))  # a device map may use every visible device
    return f"{line}, peak {kind} memory allocated {peak / 2**30:.2f} GiB (the fullest of {count})"


if __name__ == "__main__":
    sys.exit(main())
