"""NPU op audit: run a preset's rollout and train step on the CPU and list every op that would hurt on Ascend.

    python -m tools.npu_audit CONFIG [key=value ...]         # exit 0: clean, 1: findings, 2: bad config

What counts as a finding (each with the module that ran it and the Python call site):

* ``float64`` / ``complex``: an op reads or writes a float64 or complex tensor. Ascend lacks most float64 and complex
  kernels (huggingface/diffusers #10428, vllm-project/vllm-omni #4911): they fail ("not implemented for DT_DOUBLE")
  or run on the AI CPU.
* ``fp64-param``: a module that ran has a float64/complex parameter or buffer.
* ``unsupported-op`` / ``slow-op``: an op on :data:`NPU_OP_RULES` (unsupported on the NPU, or falls back to the CPU).
* ``sync`` (only inside the phases in ``sync_phases``, by default the rollout loop): an op whose result the host must
  wait for (``.item()``, ``float(t)``, ``if t:``, ``nonzero``, boolean-mask indexing, ``.cpu()``, ``.tolist()`` ...),
  which drains torch_npu's task queue and stalls the chip between kernels (:data:`SYNC_RULES`).

The device view. The audit runs on the CPU but reports what the same code would do on an NPU:

* Only tensors that would live on the accelerator count: parameters and buffers of modules that run, inputs of
  module calls, tensors made on or moved to the recipe's device, and everything computed from them (tracked op by
  op). Host tensors (the sigma table, noise drawn from CPU generators, numpy-derived schedules) may be float64 and
  may be read with ``.item()`` at no device cost. To see the recipe's own factory calls and moves, the CLI runs it
  with the device ``cpu:0`` (``emulate_device_on_cpu``): same CPU memory and kernels, but the index
  reaches the dispatcher (``device=cpu:0`` in ``torch.zeros``/``randn``/``_to_copy``), while host code says ``cpu``.
* diffusers decides some dtypes by device type: ``maybe_adjust_dtype_for_device(torch.float64, device)`` gives float32
  on npu (mps, neuron) and float64 elsewhere; Flux's RoPE table (``FluxPosEmbed``) is the main case. The audit makes
  diffusers treat the CPU like an NPU for float64 while it runs, so the float64 that diffusers builds on CPU/CUDA but
  never on NPU is not reported, and float64 that would reach the NPU is. ``--cpu-view`` turns all of this off (every
  tensor counts, diffusers keeps its CPU dtypes) for a raw listing.

Not visible on a CPU run: host copies written ``.to(torch.device("cpu"))`` or ``.to(t.device)`` (tensors do not keep
the ``cpu:0`` index, so these cannot be told from moves onto the device; ``.cpu()``, ``.to("cpu")``, ``.tolist()``
and ``.numpy()`` are seen), ``torch.tensor(data, device=d)`` (no device reaches the dispatcher), tensors DeepSpeed
creates itself (on its accelerator's plain ``cpu``, e.g. ZeRO-3's first-step trace checks), ops run in other threads
(dispatch modes are thread-local) and compiled code.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from grpo import device as grpo_device
from tools._recipe import RECIPE_PATH, REPO_ROOT, load_recipe, recipe_session  # noqa: F401

logger = logging.getLogger(__name__)
_THIS_FILE = str(Path(__file__).resolve())
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


@dataclasses.dataclass(frozen=True)
class OpRule:
    """One entry of the maintained op list.

    Attributes:
        ops: Op names, as ``namespace.op`` (every overload) or ``namespace.op.overload``.
        kind: ``unsupported-op`` (fails or is emulated on the NPU), ``slow-op`` (runs, but on the CPU or AI CPU), or
            ``sync`` (the host waits for the device).
        reason: What goes wrong, shown in the report.
        source: Where that is documented.
        when: Optional predicate on the op's tensor arguments (flattened, outputs last) and its args/kwargs; the rule
            applies only where it returns True.
    """

    ops: frozenset[str]
    kind: str
    reason: str
    source: str
    when: Callable[[Sequence[torch.Tensor], tuple, dict], bool] | None = None


def _any_dtype(*dtypes: torch.dtype) -> Callable[[Sequence[torch.Tensor], tuple, dict], bool]:
    return lambda tensors, args, kwargs: any(t.dtype in dtypes for t in tensors)


def _bool_index(tensors: Sequence[torch.Tensor], args: tuple, kwargs: dict) -> bool:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _no_output_size(tensors: Sequence[torch.Tensor], args: tuple, kwargs: dict) -> bool:
    return kwargs.get("output_size") is None


_COMPLEX_SOURCE = (
    "aclnnIndex lacks DT_COMPLEX64 (vllm-project/vllm-omni #4911), aclnnGather lacks "
    "DT_COMPLEX128 (vllm-omni PR #6571), complex128 runs on the AI CPU (modelscope/DiffSynth-Studio PR #1191), "
    "complex32 unsupported (flagos-ai/FlagGems #3267)"
)

# Ops that fail or crawl on Ascend. Maintained by hand: add an entry with its source when a new one is met (the
# NPU's own warning names it: "The operator 'aten::X' is not currently supported on the NPU backend and will fall back
# to run on the CPU"). float64/complex tensors in general are caught by the dtype check; the entries below name the
# ops whose failure has been reported.
NPU_OP_RULES: tuple[OpRule, ...] = (
    OpRule(
        frozenset({"aten.view_as_complex", "aten.view_as_real", "aten.polar", "aten.complex"}),
        "unsupported-op",
        "builds or unpacks complex tensors; keep rotary embeddings real (cos/sin), as Flux does with use_real=True",
        _COMPLEX_SOURCE + "; diffusers models/embeddings.py apply_rotary_emb, complex branch (use_real=False)",
    ),
    OpRule(
        frozenset({"aten.index", "aten.index_select"}),
        "unsupported-op",
        "indexing a complex tensor: aclnnIndex has no DT_COMPLEX64",
        "vllm-project/vllm-omni #4911",
        _any_dtype(torch.complex64, torch.complex128, torch.complex32),
    ),
    OpRule(
        frozenset({"aten.gather"}),
        "unsupported-op",
        "gather on a complex tensor: aclnnGather has no DT_COMPLEX128",
        "vllm-project/vllm-omni PR #6571",
        _any_dtype(torch.complex64, torch.complex128, torch.complex32),
    ),
    # repeat_interleave(int repeats) decomposes before the dispatcher (into expand/clone), so only the float64 check
    # sees that form; the rule catches the tensor-repeats overloads.
    OpRule(
        frozenset({"aten.repeat_interleave"}),
        "unsupported-op",
        "float64 repeat_interleave: aclnnRepeatInterleaveIntWithDim not implemented for DT_DOUBLE (old Flux RoPE)",
        "huggingface/diffusers #10428, fixed by PR #10123 / #10820",
        _any_dtype(torch.float64),
    ),
    # Not aten.isin: it fell back to the CPU on torch_npu 2.1 (Ascend/pytorch #40, hiyouga/LlamaFactory #4836), but
    # the torch_npu 2.12 that requirements-npu.txt installs registers an NPU kernel for it: flagging it was wrong.
    OpRule(
        frozenset({"torchvision.nms"}),
        "slow-op",
        "no NPU kernel: torch_npu falls back to the CPU",
        "opendatalab/MinerU #1695 (910B)",
    ),
)

_SYNC_SOURCE = (
    "PyTorch docs: torch.cuda.set_sync_debug_mode and CUDA semantics (ops with data-dependent output shapes or "
    "host-side results synchronize); torch_npu queues kernels (TASK_QUEUE_ENABLE) and drains the queue the same way"
)

# Host-device synchronisations: the host blocks until the device has finished everything queued so far.
SYNC_RULES: tuple[OpRule, ...] = (
    OpRule(frozenset({"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal"}), "sync",
           "reads a device value on the host: .item(), float(t), int(t), bool(t), `if t:`, torch.equal", _SYNC_SOURCE),
    OpRule(frozenset({"aten.nonzero", "aten.argwhere", "aten.masked_select", "aten._unique", "aten._unique2",
                      "aten.unique_dim", "aten.unique_consecutive", "aten.unique_dim_consecutive"}), "sync",
           "output shape depends on the data (nonzero, torch.where(cond), masked_select, unique)", _SYNC_SOURCE),
    OpRule(frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}), "sync",
           "boolean-mask indexing runs nonzero on the mask; use torch.where(mask, a, b) or index with positions",
           _SYNC_SOURCE, _bool_index),
    OpRule(frozenset({"aten.repeat_interleave.Tensor", "aten.repeat_interleave.self_Tensor"}), "sync",
           "tensor repeats without output_size: the output length is read on the host",
           "PyTorch docs of torch.repeat_interleave (output_size avoids a stream synchronization)", _no_output_size),
)

# Tensor methods that copy to the host without dispatching an op on a CPU tensor (so the dispatch mode cannot see them);
# for .to() only the literal "cpu" counts.
_HOST_COPY_METHODS = ("cpu", "tolist", "numpy", "to")


@dataclasses.dataclass
class Finding:
    """One reported problem, aggregated over identical occurrences.

    Attributes:
        kind: ``float64``, ``complex``, ``fp64-param``, ``unsupported-op``, ``slow-op`` or ``sync``.
        op: The aten op (``aten.polar``), tensor method (``Tensor.cpu``) or tensor name (for ``fp64-param``).
        detail: Dtypes involved or the rule's reason.
        module: Qualified name of the innermost module running, ``backward of <Node>`` in autograd, or ``-``.
        site: Innermost call site in the repository or diffusers (``path:line in function``).
        phase: The audit phase (``rollout``, ``train``, ...) of the first occurrence.
        count: Number of occurrences.
        source: Where the rule is documented (empty for dtype findings).
    """

    kind: str
    op: str
    detail: str
    module: str
    site: str
    phase: str
    count: int = 1
    source: str = ""


class _Mode(TorchDispatchMode):
    """Forwards every dispatched op to the auditor after running it."""

    def __init__(self, auditor: Auditor):
        super().__init__()
        self.auditor = auditor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.auditor._on_op(func, args, kwargs, out)
        return out


class Auditor:
    """Context manager that records NPU-hostile ops, module by module, while code runs on the CPU.

    Example::

        auditor = Auditor()
        with auditor, auditor.phase("rollout"):
            model(x)
        print(auditor.format_table())

    The auditor may be entered several times (e.g. around the rollout and then around the train step, with setup code
    outside); findings accumulate. Modules are named automatically from the first module called (the root,
    named by its class) or explicitly with :meth:`watch`.

    Args:
        device_view: Report what the code would do on an NPU (see the module docstring); False reports every
            float64/complex/sync op of the CPU run.
        sync_phases: Phases in which host-device syncs are reported (None: every phase).
        project_dirs: Directories whose frames count as call sites, besides diffusers (default: the repository).
        accelerator_device: The indexed CPU device (``cpu:0``) that the audited code uses as its accelerator, from
            ``emulate_device_on_cpu``. With it, factory calls and ``.to()`` moves onto that device create
            device tensors, and copies from a device tensor to plain ``cpu`` count as syncs. Without it only module
            parameters, module inputs and what is computed from them count as device tensors.
    """

    def __init__(self, device_view: bool = True, sync_phases: Sequence[str] | None = ("rollout",),
                 project_dirs: Sequence[str | Path] = (), accelerator_device: torch.device | None = None):
        self.device_view = device_view
        self.accelerator_device = accelerator_device
        self.sync_phases = None if sync_phases is None else frozenset(sync_phases)
        self.project_dirs = tuple(str(Path(p).resolve()) for p in (REPO_ROOT, *project_dirs))
        self._site_dirs = self.project_dirs + tuple(self._package_dirs("diffusers"))
        self.findings: dict[tuple, Finding] = {}
        self.phases_seen: set[str] = set()
        self._phase = "-"
        self._stack: list[str] = []
        # Keyed weakly by module identity: ids of freed modules are reused by new ones.
        self._names = WeakIdKeyDictionary()  # module -> qualified name
        self._hooked = WeakIdKeyDictionary()  # modules carrying our hooks while the auditor is active
        self._checked = WeakIdKeyDictionary()  # modules whose own parameters/buffers were checked (once per auditor)
        self._handles: list[Any] = []
        self._device = WeakIdKeyDictionary()  # tensor -> True (device) / False (copied to the host)
        self._mode: _Mode | None = None
        self._exit_stack: contextlib.ExitStack | None = None
        self._rules = self._index_rules(NPU_OP_RULES + SYNC_RULES)

    # ------------------------------------------------------------------------------------------- public API
    def __enter__(self) -> Auditor:
        if self._exit_stack is not None:
            raise RuntimeError("Auditor is already active")
        stack = contextlib.ExitStack()
        self._exit_stack = stack
        try:
            stack.callback(self._drop_module_hooks)
            handle = torch.nn.modules.module.register_module_forward_pre_hook(self._global_pre_hook)
            stack.callback(handle.remove)
            if self.device_view:
                stack.enter_context(_diffusers_npu_dtypes())
            for name in _HOST_COPY_METHODS:
                stack.enter_context(self._patch_host_copy(name))
            self._mode = _Mode(self)
            stack.enter_context(self._mode)
        except BaseException:
            self._exit_stack = None
            stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        stack, self._exit_stack, self._mode = self._exit_stack, None, None
        self._stack.clear()
        stack.close()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Labels findings with ``name``; syncs are reported only in the phases of ``sync_phases``."""
        previous, self._phase = self._phase, name
        self.phases_seen.add(name)
        try:
            yield
        finally:
            self._phase = previous

    def watch(self, module: torch.nn.Module, name: str) -> None:
        """Names ``module`` and its submodules in the report (``name.sub.layer``) before they first run."""
        for sub_name, sub in module.named_modules():
            if sub not in self._names:
                self._names[sub] = f"{name}.{sub_name}" if sub_name else name

    def mark_device(self, *tensors: torch.Tensor) -> None:
        """Declares tensors to live on the accelerator (e.g. made by a factory call with ``device=``)."""
        for tensor in tree_leaves(tensors):
            if isinstance(tensor, torch.Tensor):
                self._device[tensor] = True

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.findings

    def sorted_findings(self) -> list[Finding]:
        """Findings ordered by kind severity, then module and op."""
        order = {"unsupported-op": 0, "complex": 1, "float64": 2, "fp64-param": 3, "slow-op": 4, "sync": 5}
        return sorted(self.findings.values(), key=lambda f: (order.get(f.kind, 9), f.module, f.op, f.site))

    def format_table(self, max_width: int = 48) -> str:
        """The findings as a plain-text table (one row per finding; long op/detail cells cut to ``max_width``), or a
        one-line all-clear."""
        if not self.findings:
            return "npu_audit: no NPU-hostile ops found"
        header = ("kind", "op", "detail", "module", "site", "phase", "n")
        rows = [(f.kind, f.op, f.detail, f.module, f.site, f.phase, str(f.count)) for f in self.sorted_findings()]

        def cut(text: str) -> str:
            return text if len(text) <= max_width else text[: max_width - 3] + "..."

        rows = [(kind, cut(op), cut(detail), *rest) for kind, op, detail, *rest in rows]
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        line = "  ".join("{:<%d}" % w for w in widths)
        out = [line.format(*header), line.format(*("-" * w for w in widths))]
        out += [line.format(*row) for row in rows]
        sources: dict[str, set[str]] = {}
        for f in self.findings.values():
            if f.source:
                sources.setdefault(f.source, set()).add(f.op)
        if sources:
            out.append("")
            out += [f"[{', '.join(sorted(ops))}] {source}" for source, ops in sorted(sources.items())]
        out.append(f"npu_audit: {len(self.findings)} finding(s), {sum(f.count for f in self.findings.values())} "
                   "occurrence(s)")
        return "\n".join(out)

    # ------------------------------------------------------------------------------------------ module hooks
    def _global_pre_hook(self, module: torch.nn.Module, args: tuple) -> None:
        """First sight of a module: name its subtree, hook it (with kwargs), and handle this one call by hand."""
        if module in self._hooked:
            return
        parent = self._stack[-1] if self._stack else None
        if module not in self._names:
            root = type(module).__name__ if parent is None else f"{parent}/{type(module).__name__}"
            self.watch(module, root)
        for sub in module.modules():
            if sub in self._hooked:
                continue
            self._hooked[sub] = True
            if sub not in self._names:
                self._names[sub] = f"{self._names[module]}/{type(sub).__name__}"
            if sub not in self._checked:
                self._checked[sub] = True
                self._check_own_tensors(sub)
            self._handles.append(sub.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(sub.register_forward_hook(self._post_hook, always_call=True))
        # Its own pre-hook was added too late for this call (torch snapshots the hooks); its post-hook runs.
        self._pre_hook(module, args, {})

    def _pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._stack.append(self._names.get(module, type(module).__name__))
        for tensor in tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor) and tensor not in self._device:
                self._device[tensor] = True  # a module's inputs sit on the module's device
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            self._device[tensor] = True

    def _post_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def _drop_module_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()

    def _check_own_tensors(self, module: torch.nn.Module) -> None:
        named = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in named:
            if tensor.dtype == torch.float64 or tensor.is_complex():
                try:
                    where = f"{Path(inspect.getsourcefile(type(module))).name}: class {type(module).__name__}"
                except (TypeError, OSError):
                    where = type(module).__name__
                self._add("fp64-param", name, str(tensor.dtype).replace("torch.", ""), self._names[module],
                          where, "")

    # ---------------------------------------------------------------------------------------------- ops
    @staticmethod
    def _index_rules(rules: Sequence[OpRule]) -> dict[str, list[OpRule]]:
        index: dict[str, list[OpRule]] = {}
        for rule in rules:
            for op in rule.ops:
                index.setdefault(op, []).append(rule)
        return index

    def _is_device(self, tensor: torch.Tensor) -> bool:
        return not self.device_view or bool(self._device.get(tensor, False))

    def _on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        packet = str(func.overloadpacket)
        name = str(func).removesuffix(".default")
        # Made on / moved to the emulated accelerator (device=cpu:0), else computed from a device tensor.
        on_device = self._targets_accelerator(kwargs) or any(self._is_device(t) for t in inputs)
        if not on_device:
            return
        if self.device_view:
            for tensor in outputs:
                if tensor not in self._device:  # in-place/alias results keep an explicit host mark
                    self._device[tensor] = True
        tensors = inputs + outputs
        dtypes = {t.dtype for t in tensors}
        bad = sorted(str(d).replace("torch.", "") for d in dtypes if d == torch.float64 or d.is_complex)
        # Casting a float64 value down is the fix, not the problem: report only float64 that is produced or used.
        downcast = packet in ("aten._to_copy", "aten.copy_", "aten.to") and not any(
            t.dtype == torch.float64 or t.is_complex() for t in outputs)
        if bad and not downcast:
            kind = "complex" if any("complex" in b for b in bad) else "float64"
            self._add(kind, name, ",".join(bad), self._module(), self._site(), "", merge_ops=True)
        rules = self._rules.get(packet, []) + (self._rules.get(name, []) if name != packet else [])
        for rule in rules:
            if rule.when is not None and not rule.when(tensors, args, kwargs):
                continue
            if rule.kind == "sync" and not self._syncs_reported():
                continue
            self._add(rule.kind, name, rule.reason, self._module(), self._site(), rule.source)

    @property
    def _emulating(self) -> bool:
        return self.device_view and self.accelerator_device is not None

    def _targets_accelerator(self, kwargs: dict) -> bool:
        """True when an op's ``device=`` names the emulated accelerator (``cpu:0``; host code never writes an index).

        The reverse cannot be read from ``device=cpu``: ``x.to(y.device)`` gives plain ``cpu`` for a device tensor
        ``y`` too (tensors do not keep the index), so host copies are recognised only by ``.cpu()``, ``.to("cpu")``,
        ``.tolist()`` and ``.numpy()``.
        """
        device = kwargs.get("device")
        return self._emulating and isinstance(device, torch.device) and device == self.accelerator_device

    def _syncs_reported(self) -> bool:
        return self.sync_phases is None or self._phase in self.sync_phases

    def _patch_host_copy(self, method: str) -> contextlib.AbstractContextManager:
        """Wraps ``Tensor.<method>`` (a device-to-host copy that dispatches nothing for a CPU tensor)."""
        original = getattr(torch.Tensor, method)
        auditor = self

        def wrapper(tensor, *args, **kwargs):
            # .to(): only the literal "cpu" is a host copy for sure (a torch.device may be some device tensor's).
            if method == "to" and (args[:1] or (kwargs.get("device"),))[0] != "cpu":
                return original(tensor, *args, **kwargs)
            active = auditor._mode is not None and auditor._is_device(tensor)
            if active and auditor._syncs_reported():
                auditor._add("sync", f"Tensor.{method}", "copies a device tensor to the host", auditor._module(),
                             auditor._site(), _SYNC_SOURCE)
            result = original(tensor, *args, **kwargs)
            if active and isinstance(result, torch.Tensor):
                if result is tensor:  # the CPU no-op returns self: give the host copy an identity of its own
                    result = tensor.view_as(tensor)
                auditor._device[result] = False
            return result

        @contextlib.contextmanager
        def patched() -> Iterator[None]:
            setattr(torch.Tensor, method, wrapper)
            try:
                yield
            finally:
                setattr(torch.Tensor, method, original)

        return patched()

    # ----------------------------------------------------------------------------------------- reporting
    def _module(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            return f"backward of {node.name()}"
        return self._stack[-1] if self._stack else "-"

    def _site(self) -> str:
        """The innermost frame in the repository or diffusers, plus the innermost other library frame if deeper."""
        frame = sys._getframe(1)
        origin = None
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename != _THIS_FILE and not filename.startswith(_TORCH_DIR):
                where = f"{self._short(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
                if filename.startswith(self._site_dirs):
                    return where if origin is None else f"{where} (via {origin})"
                if origin is None and not filename.startswith("<"):
                    origin = where
            frame = frame.f_back
        return origin or "-"

    def _short(self, filename: str) -> str:
        for base in self.project_dirs:
            if filename.startswith(base + os.sep):
                return os.path.relpath(filename, base)
        marker = f"{os.sep}site-packages{os.sep}"
        return filename.split(marker, 1)[1] if marker in filename else filename

    @staticmethod
    def _package_dirs(name: str) -> list[str]:
        spec = importlib.util.find_spec(name)
        return [str(Path(p).resolve()) for p in (spec.submodule_search_locations or [])] if spec else []

    def _add(self, kind: str, op: str, detail: str, module: str, site: str, source: str,
             merge_ops: bool = False) -> None:
        """Records one occurrence. ``merge_ops``: one row per call site, listing its ops (a float64 line of Python
        typically dispatches several aten ops)."""
        key = (kind, "" if merge_ops else op, detail, module, site)
        found = self.findings.get(key)
        if found is None:
            self.findings[key] = Finding(kind, op, detail, module, site, self._phase, 1, source)
            return
        found.count += 1
        if merge_ops and op not in found.op.split(","):
            found.op += f",{op}"


@contextlib.contextmanager
def _diffusers_npu_dtypes() -> Iterator[None]:
    """Makes diffusers pick its NPU dtypes on the CPU: ``maybe_adjust_dtype_for_device`` turns float64 into float32.

    Only float64 is emulated; diffusers' int64 -> int32 downcast on npu is harmless to leave out.
    """
    try:
        from diffusers.utils import torch_utils
    except ImportError:
        yield
        return
    table = getattr(torch_utils, "_DTYPE_UNSUPPORTED_DEVICES", None)
    if not isinstance(table, dict) or torch.float64 not in table:
        logger.warning("diffusers has no _DTYPE_UNSUPPORTED_DEVICES table: its CPU-only float64 will be reported")
        yield
        return
    original = table[torch.float64]
    table[torch.float64] = frozenset(original) | {"cpu"}
    try:
        yield
    finally:
        table[torch.float64] = original


# ------------------------------------------------------------------------------------------------- recipe hook
@contextlib.contextmanager
def emulate_device_on_cpu(index: int = 0) -> Iterator[torch.device]:
    """On the CPU accelerator, gives ranks the device ``cpu:<index>`` instead of ``cpu`` while the context is open.

    ``cpu:0`` tensors are ordinary CPU tensors, but factory calls and ``.to()`` moves that name it carry the index
    into the dispatcher, so the audit can tell "would be on the NPU" (``cpu:0``) from "stays on the host" (``cpu``).
    It swaps the device that ``grpo.device.device_for_local_rank`` returns on the CPU accelerator; DistInfo objects
    made inside the context keep the indexed device.

    Yields:
        The emulated accelerator device.
    """
    previous, grpo_device._cpu_accelerator_device = grpo_device._cpu_accelerator_device, torch.device("cpu", index)
    try:
        yield grpo_device._cpu_accelerator_device
    finally:
        grpo_device._cpu_accelerator_device = previous


def run_recipe_step(config_path: str, overrides: Sequence[str], auditor: Auditor,
                    recipe_path: str | Path = RECIPE_PATH) -> None:
    """Runs one rollout and one train step of a preset, on the CPU, under ``auditor``.

    The hook between the audit and the recipe (recipes/flux_grpo.py, ``FluxGRPORecipe``, driven through
    tools/_recipe.py): setup (model loading, prompt caches, DeepSpeed engines) runs outside the audit; the
    rollout, scoring/advantages and the update run inside it, each in its own phase, so syncs are reported for the
    rollout only. With ``auditor.accelerator_device`` set, the recipe's device is that indexed CPU device
    (``emulate_device_on_cpu``), so the tensors the recipe creates on or moves to its device are tracked
    as device tensors. The run writes into a temporary output_dir unless the overrides name one.

    Args:
        config_path: YAML preset.
        overrides: Dotted ``key=value`` overrides.
        auditor: The auditor to enter around the audited phases.
        recipe_path: The recipe script.
    """
    with contextlib.ExitStack() as stack:
        if auditor.accelerator_device is not None:
            stack.enter_context(emulate_device_on_cpu(auditor.accelerator_device.index or 0))
        recipe = stack.enter_context(recipe_session(config_path, overrides, recipe_path))
        auditor.watch(recipe.engine.module, "transformer")
        auditor.watch(recipe.vae, "vae")
        with auditor:
            recipe.step(0, auditor.phase)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: audit one rollout + train step of CONFIG; exit 0 when clean, 1 with findings, 2 on a bad config."""
    parser = argparse.ArgumentParser(prog="python -m tools.npu_audit", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML preset, e.g. recipes/configs/tiny/grpo_lora.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--cpu-view", action="store_true",
                        help="report every float64/complex/sync op of the CPU run, not only what would reach an NPU")
    parser.add_argument("--syncs-everywhere", action="store_true",
                        help="report host-device syncs in every phase, not only in the rollout")
    parser.add_argument("--recipe", default=str(RECIPE_PATH), help="recipe script (default: recipes/flux_grpo.py)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")

    # The audit is a CPU run by definition; DeepSpeed reads DS_ACCELERATOR when it is first imported.
    if "deepspeed" in sys.modules and os.environ.get("DS_ACCELERATOR") != "cpu":
        logger.warning("deepspeed was imported before the audit set DS_ACCELERATOR=cpu")
    os.environ["DS_ACCELERATOR"] = "cpu"

    from grpo.errors import ConfigError

    auditor = Auditor(device_view=not args.cpu_view, sync_phases=None if args.syncs_everywhere else ("rollout",),
                      project_dirs=[Path(args.recipe).resolve().parent],
                      accelerator_device=None if args.cpu_view else torch.device("cpu", 0))
    try:
        run_recipe_step(args.config, args.overrides, auditor, args.recipe)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.syncs_everywhere and "rollout" not in auditor.phases_seen:
        print("npu_audit: warning: no rollout phase ran, so host-device syncs were not checked", file=sys.stderr)
    print(auditor.format_table())
    return 0 if auditor.ok else 1


if __name__ == "__main__":
    sys.exit(main())
