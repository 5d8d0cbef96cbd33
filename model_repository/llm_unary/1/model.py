"""Unary front of the decoupled ``llm`` model: one request in, exactly one response out.

Triton's HTTP ``infer`` and ``/generate`` refuse decoupled models, so this default-mode
model answers them (and gRPC unary ``infer``). ``execute()`` copies each request's
inputs, queues it for a worker thread and returns at once; the worker calls ``llm``
through BLS with ``stream=false`` (one response per sequence, at its end), gathers the
sequences and sends the single response through the request's response sender (allowed
in the default mode since Triton 24.06). Requests therefore reach the one engine of
``llm`` as soon as they arrive, whatever batch Triton put them in, and are batched there.

Cancellation (Python backend 2.51 / r24.10): a request cancelled before its BLS call
starts never reaches the engine. A running BLS call cannot be cancelled directly (the
BLS response iterator has no ``cancel()`` before r25.04), so a watcher thread polls the
senders of running calls and, for a cancelled one, creates a flag file named after the
call's request id (``llm_unary-<32 hex>``) in a folder of this tritonserver process;
every ``llm`` instance checks that file for such requests at each engine step (a control
request would reach just one of several instances). Triton's request ``timeout``
(tritonclient ``infer(timeout=µs)``) runs from the request's arrival here: what is left
of it when the BLS call starts goes to the engine as ``sampling_parameters.timeout``, and
a request whose time ran out while it waited for a worker ends with the engine's error.
"""

from __future__ import annotations

import faulthandler
import json
import os
import queue
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

TARGET = "llm"
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
FORWARDED = ("text_input", "input_ids", "sampling_parameters")
BLS_OUTPUTS = ["text_output", "index", "token_ids", "finish_reason", "prompt_tokens", "cached_tokens",
               "completion_tokens", "cumulative_logprob", "seed", "batch_size", "logprobs"]
BLS_ID_PREFIX = "llm_unary-"  # + 32 hex digits: llm_engine.contract.CANCELLABLE_ID
CANCEL_POLL_S = 0.1  # how often running calls are checked for cancellation
READY_WAIT_S = 60.0  # how long a request waits for "llm" to be (re)loaded
ENGINE_TIMEOUT_MAX_S = 65535.0  # sampling_parameters.timeout's upper bound
TIMED_OUT = "[504] Engine callback timeout: client timeout"  # llm_engine.errors.RequestTimeout's wire form
_STATUS = re.compile(r"\[(\d{3})\] ")


@dataclass
class _Job:
    request_id: str
    inputs: list[Any]  # pb_utils.Tensor, copied out of the request
    wanted: set[str]  # requested output names (Triton passes all of them when none were named)
    keep: int | None  # best_of > n: return the n best sequences
    params: dict | None = None  # sampling_parameters, to get what is left of the deadline as its timeout
    deadline: float = 0.0  # time.monotonic() when the caller's timeout runs out (with params)

    def call_inputs(self) -> list[Any] | None:
        """The inputs of the BLS call; ``None`` when the caller's timeout has already run out."""
        if self.params is None:
            return self.inputs
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        params = dict(self.params, timeout=min(max(left, 1e-3), ENGINE_TIMEOUT_MAX_S))
        encoded = np.array([[json.dumps(params).encode()]], dtype=np.object_)
        return [t for t in self.inputs if t.name() != "sampling_parameters"] + [
            pb_utils.Tensor("sampling_parameters", encoded)]


@dataclass
class _Sequence:
    text: bytes = b""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    finish_reason: bytes = b""
    completion_tokens: int = 0
    cumulative_logprob: float = 0.0


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        faulthandler.enable(all_threads=True)  # a crash prints every thread's Python stack to Triton's log
        config = json.loads(args["model_config"])
        if pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("model 'llm_unary' must not be decoupled")
        params = config.get("parameters", {})
        workers = int(params.get("max_in_flight", {}).get("string_value", "24"))
        self._llm_ready = False
        self._jobs: queue.SimpleQueue[tuple[_Job, Any] | None] = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"llm-unary-{i}", daemon=True)
                         for i in range(workers)]
        for worker in self._workers:
            worker.start()
        self._cancel_flags = _cancel_flag_dir()
        _remove_stale_flag_dirs(self._cancel_flags)
        os.makedirs(self._cancel_flags, mode=0o700, exist_ok=True)
        self._running: dict[str, tuple[Any, str]] = {}  # BLS request id -> (caller's sender, its id)
        self._running_lock = threading.Lock()
        self._stopped = threading.Event()
        self._watcher = threading.Thread(target=self._watch_cancellations, name="llm-unary-cancel",
                                         daemon=True)
        self._watcher.start()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._jobs.put((self._job(request), sender))
            except Exception as exc:  # a malformed request: answer it now
                _send(sender, _error(str(exc)))
        return None

    def finalize(self) -> None:
        """Stop the threads and wait for them: each holds Triton objects (a response sender,
        a BLS call) whose destructors need the stub. A worker still exiting when the stub
        tore down segfaulted it (at every shutdown after the 600-call stress test)."""
        self._stopped.set()
        for _ in self._workers:
            self._jobs.put(None)
        for thread in [*self._workers, self._watcher]:
            thread.join(timeout=5)
        shutil.rmtree(self._cancel_flags, ignore_errors=True)

    # -- requests in -------------------------------------------------------------------
    def _job(self, request) -> _Job:
        inputs = []
        for name in FORWARDED:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                continue
            array = tensor.as_numpy()
            if array.shape[0] != 1:
                raise ValueError(f"[400] {name}: send one prompt per request (batch dimension 1), "
                                 f"got {array.shape[0]}")
            inputs.append(pb_utils.Tensor(name, np.array(array, copy=True)))
        timeout_us = request.timeout()
        keep, params = _plan(_scalar(inputs, "sampling_parameters"), timeout_us)
        inputs.append(pb_utils.Tensor("stream", np.array([[False]], dtype=np.bool_)))
        return _Job(request_id=request.request_id(), inputs=inputs, wanted=set(request.requested_output_names()),
                    keep=keep, params=params, deadline=time.monotonic() + timeout_us / 1e6)

    # -- the worker: BLS to llm, one response back ---------------------------------------
    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            self._serve(*item)
            del item  # the request's sender goes now, not when the next job comes

    def _serve(self, job: _Job, sender) -> None:
        try:
            response = self._generate(job, sender)
        except Exception as exc:
            response = _error(f"[500] llm_unary: {exc}")
        _send(sender, response)

    def _generate(self, job: _Job, sender) -> Any:
        if not self._wait_for_llm(sender):
            if sender.is_cancelled():
                return _cancelled()
            return _error(f"[503] model '{TARGET}' is not ready")
        if sender.is_cancelled():  # cancelled while queued: the engine never sees it
            return _cancelled()
        inputs = job.call_inputs()
        if inputs is None:
            return _error(TIMED_OUT)
        bls_id = f"{BLS_ID_PREFIX}{uuid.uuid4().hex}"
        bls = pb_utils.InferenceRequest(model_name=TARGET, inputs=inputs,
                                        requested_output_names=BLS_OUTPUTS, request_id=bls_id)
        with self._running_lock:
            self._running[bls_id] = (sender, job.request_id)
        try:
            return self._gather(job, bls, sender)
        finally:
            with self._running_lock:
                self._running.pop(bls_id, None)
            try:
                os.unlink(os.path.join(self._cancel_flags, bls_id))
            except FileNotFoundError:
                pass

    def _gather(self, job: _Job, bls, sender) -> Any:
        seqs: dict[int, _Sequence] = {}
        meta = {"prompt_tokens": 0, "cached_tokens": 0, "seed": 0, "max_step_batch_size": 0}
        for response in bls.exec(decoupled=True):
            if response.has_error():
                message = response.error().message()
                if "not ready" in message or "unknown model" in message:
                    self._llm_ready = False
                return _error(message)
            if not response.output_tensors():  # a flags-only final response
                continue
            out = {t.name(): t.as_numpy().reshape(-1) for t in response.output_tensors()}
            seq = seqs.setdefault(int(out["index"][0]), _Sequence())
            seq.text += bytes(out["text_output"][0])
            seq.token_ids += [int(t) for t in out["token_ids"]]
            if out["logprobs"][0]:
                seq.logprobs = (seq.logprobs or []) + json.loads(out["logprobs"][0])
            seq.finish_reason = bytes(out["finish_reason"][0])
            seq.completion_tokens = int(out["completion_tokens"][0])
            seq.cumulative_logprob = float(out["cumulative_logprob"][0])
            for name in ("prompt_tokens", "cached_tokens", "seed"):
                meta[name] = int(out[name][0])
            meta["max_step_batch_size"] = max(meta["max_step_batch_size"], *map(int, out["batch_size"]), 0)
        if sender.is_cancelled():
            return _cancelled()
        if not seqs:
            return _error(f"[500] model '{TARGET}' returned no sequence")
        chosen = sorted(seqs.items())
        if job.keep is not None and len(chosen) > job.keep:
            best = sorted(chosen, key=lambda kv: kv[1].cumulative_logprob, reverse=True)[: job.keep]
            chosen = sorted(best, key=lambda kv: kv[0])
        return _response(chosen, meta, job.wanted)

    # -- cancellation of running calls --------------------------------------------------
    def _watch_cancellations(self) -> None:
        # The scan holds _running_lock: a worker takes its call out of _running (under the
        # lock) before it sends the response, and a sender must never be queried once its
        # final response is sent (measured: is_cancelled() on a finished request crashed
        # tritonserver in TRITONBACKEND_ResponseFactoryIsCancelled).
        flagged: set[str] = set()
        while not self._stopped.wait(CANCEL_POLL_S):
            with self._running_lock:
                flagged &= self._running.keys()
                for bls_id, (sender, request_id) in self._running.items():
                    if bls_id not in flagged and self._cancelled(sender, bls_id):
                        flagged.add(bls_id)
                        pb_utils.Logger.log_info(f"llm_unary: request {request_id!r} was cancelled by its "
                                                 f"client; stopping its generation {bls_id}")

    def _cancelled(self, sender, bls_id: str) -> bool:
        """Whether the caller cancelled; if so, raise the flag ``llm`` checks at each step."""
        try:
            if not sender.is_cancelled():
                return False
            with open(os.path.join(self._cancel_flags, bls_id), "w"):
                pass
            return True
        except Exception as exc:  # keep watching the others
            pb_utils.Logger.log_warn(f"llm_unary: cancelling {bls_id} failed: {exc}")
            return False

    def _wait_for_llm(self, sender) -> bool:
        """Triton loads every model at once; a BLS call to a model still loading fails."""
        deadline = time.monotonic() + READY_WAIT_S
        while not self._llm_ready:
            self._llm_ready = pb_utils.is_model_ready(model_name=TARGET)
            if self._llm_ready:
                break
            if sender.is_cancelled() or time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True


def _cancel_flag_dir() -> str:
    """llm_engine.contract.cancel_flag_dir() (this model cannot import it): one per tritonserver."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"mindie-triton-cancel-{os.getppid()}")


def _remove_stale_flag_dirs(mine: str) -> None:
    """Folders of tritonserver processes that died without finalize()."""
    parent, name = os.path.split(mine)
    prefix = name.rsplit("-", 1)[0] + "-"
    for entry in os.listdir(parent):
        pid = entry.removeprefix(prefix)
        if entry.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _scalar(tensors: list, name: str) -> Any:
    for t in tensors:
        if t.name() == name:
            flat = t.as_numpy().reshape(-1)
            return flat[0] if flat.size else None
    return None


def _plan(raw: Any, timeout_us: int) -> tuple[int | None, dict | None]:
    """How many sequences to return, and the sampling_parameters that get the request's
    deadline as their ``timeout`` (``None``: forwarded as they came).

    Validation is left to ``llm`` (so its ``[400]`` messages reach the client unchanged);
    anything that is not a JSON object is forwarded as it came.
    """
    try:
        data = json.loads(raw) if raw else {}
    except (TypeError, ValueError, RecursionError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    n, best_of = data.get("n") or 1, data.get("best_of")
    keep = n if isinstance(n, int) and isinstance(best_of, int) and best_of > n else None
    if timeout_us > 0 and data.get("timeout") is None:
        return keep, data
    return keep, None


def _response(chosen: list[tuple[int, _Sequence]], meta: dict[str, int], wanted: set[str]) -> Any:
    seqs = [s for _, s in chosen]
    values: dict[str, tuple[list, Any]] = {
        "text_output": ([s.text for s in seqs], np.object_),
        "index": ([i for i, _ in chosen], np.int32),
        "finish_reason": ([s.finish_reason for s in seqs], np.object_),
        "completion_tokens": ([s.completion_tokens for s in seqs], np.int32),
        "cumulative_logprob": ([s.cumulative_logprob for s in seqs], np.float32),
        "token_ids": ([json.dumps(s.token_ids).encode() for s in seqs], np.object_),
        "logprobs": ([json.dumps(s.logprobs).encode() if s.logprobs is not None else b"" for s in seqs],
                     np.object_),
        "prompt_tokens": ([meta["prompt_tokens"]], np.int32),
        "cached_tokens": ([meta["cached_tokens"]], np.int32),
        "seed": ([meta["seed"]], np.uint64),
        "max_step_batch_size": ([meta["max_step_batch_size"]], np.int32),
    }
    tensors = [pb_utils.Tensor(name, np.array(v, dtype=dt).reshape(1, -1))
               for name, (v, dt) in values.items() if not wanted or name in wanted]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _error(message: str) -> Any:
    """A Triton error keeping ``llm``'s ``[status]`` prefix; 4xx become INVALID_ARG (HTTP 400)."""
    m = _STATUS.search(message)
    status = int(m.group(1)) if m else 500
    if 400 <= status < 500:
        code = pb_utils.TritonError.INVALID_ARG
    elif status in (503, 504):
        code = pb_utils.TritonError.UNAVAILABLE
    else:
        code = pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _cancelled() -> Any:
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError("[499] request cancelled", pb_utils.TritonError.CANCELLED))


def _send(sender, response) -> None:
    try:
        sender.send(response, flags=FINAL)
    except Exception as exc:
        pb_utils.Logger.log_error(f"llm_unary: could not send a response: {exc}")
