"""Resumable checkpoints: DeepSpeed ZeRO-3 state plus the run's own state, written atomically, verified on resume.

Layout under ``output_dir/checkpoints/``::

    step_00000010/                              the state after 10 completed GRPO steps
        zero_pp_rank_{r}_mp_rank_00_model_states.pt       DeepSpeed, one per rank (module buffers, counters)
        [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt  DeepSpeed, one per rank (fp32 master shard, Adam
                                                          moments, LR scheduler); LoRA: trainable weights only
        zero_to_fp32.py                                   DeepSpeed's recovery script
        grpo_rank{r:05d}.safetensors                      ours: RNG states of rank r, its EMA and lagging-policy
                                                          shards; rank 0's also the objective's state (grpo's
                                                          replay buffer "replay/*", the same on every rank)
        meta.json                                         ours, written last: step, world size, resolved config,
                                                          size + sha256 of every file above
    latest                                      name of the newest complete checkpoint (DeepSpeed's convention,
                                                so zero_to_fp32.py finds it); written after the rename
    .tmp-step_00000012/                         a checkpoint being written; never read, removed by the next save
    .universal-step_00000010/step_00000010/     DeepSpeed's universal conversion of a checkpoint resumed on another
                                                world size (possibly another run's); removed by the next save

Atomicity: every rank writes into ``.tmp-<name>``; after a barrier the ranks hash their share of the files (and fsync
them), rank 0 writes ``meta.json`` and renames the folder into place, then updates ``latest``. A kill at any moment
leaves either the previous checkpoints untouched or the new one complete. A checkpoint damaged later (truncated,
overwritten, a rank file lost) fails verification; ``resume: auto`` then warns and takes the previous one.

Resume is exact because everything random in a step is a pure function of (seed, step, sample index)
(grpo/data.py): restoring the step counter, the optimizer, the LR scheduler, the weights and each rank's global RNG
states continues the run as if it had never stopped.

World size: a checkpoint resumes on any number of processes that its global batch splits over (grpo/compat.py
refuses the others, naming the valid counts). On the writer's world size the load is DeepSpeed's own, bit for bit.
On another one, rank 0 first converts the checkpoint with DeepSpeed's ``ds_to_universal`` (a subprocess) into
``checkpoints/.universal-<name>/<name>/``, leaving the checkpoint itself untouched, and the engine, built with
``"checkpoint": {"load_universal": true}`` (:func:`engine_config`), re-partitions the fp32 master weights and Adam
moments for its ranks; the EMA and lagging-policy shards are re-cut from every writer's rank file by flat index
(:meth:`grpo.ema.ShardedEMA.load_resharded`). RNG: rank r restores the writer's rank r where it existed, a new rank
keeps its fresh ``seed + rank`` state (only LoRA dropout draws from them: samples are pure functions of the global
index). The converted folder is reused by a rerun on the same count and deleted by the next complete save.

The package, by concern: files.py (names, meta.json, atomic writes, a full disk), damage.py (damage checks),
resume.py (the resume point, setting damaged ones aside), universal.py (the conversion for another world size),
writer.py (:class:`Checkpointer`: save, prune, load). This module keeps the names the recipe and the tools import.

Security: DeepSpeed's own ``load_checkpoint`` and ``zero_to_fp32`` unpickle their ``.pt`` files with
``torch.load(weights_only=False)``; everything this module writes and reads itself is JSON or safetensors. Only load
checkpoints you wrote.
"""

from grpo.checkpoint.files import (FORMAT, LATEST, META, checkpoint_name, checkpoint_step, list_checkpoints, rank_file,
                                   read_meta)
from grpo.checkpoint.resume import find_checkpoint, newest_valid, resume_point, set_aside_newer
from grpo.checkpoint.universal import CONVERSION_FACTOR, SOURCE, UNIVERSAL, engine_config
from grpo.checkpoint.damage import structure, verify, verify_share
from grpo.checkpoint.writer import Checkpointer, RunState, Saved, Stateful

__all__ = ["CONVERSION_FACTOR", "Checkpointer", "FORMAT", "LATEST", "META", "RunState", "SOURCE", "Saved", "Stateful",
           "UNIVERSAL", "checkpoint_name", "checkpoint_step", "engine_config", "find_checkpoint", "list_checkpoints",
           "newest_valid", "rank_file", "read_meta", "resume_point", "set_aside_newer", "structure", "verify",
           "verify_share"]
