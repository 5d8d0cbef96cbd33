"""Triton decoupled Python model: tensors in, engine.submit(), responses streamed back.

``execute()`` never waits for generation. It turns each request into an engine
:class:`~llm_engine.sequence.Request` and returns; the engine thread produces
outputs, and a sender thread turns them into Triton responses. Every request
ends with exactly one ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``, on success, error
or cancellation alike.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils
from cancel_flags import CancelFlags
from llm_engine.config import load_settings
from llm_engine.cpu_cores import instance_count, pin_current_thread
from llm_engine.errors import EngineError, InvalidParameter
from llm_engine.params import parse_sampling_parameters
from llm_engine.sequence import Request, StepOutput
from response_outputs import read_selection, response_of

log = logging.getLogger("llm_engine.model")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How often the sender thread asks Triton which running requests were cancelled. Each
# ask is an IPC round trip per request (~90 us measured); asking from the engine thread
# at every step cost it ~5% of its time at 32 streams.
CANCEL_POLL_SECONDS = 0.05


def _configure_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=os.environ.get("MINDIE_TRITON_LOG_LEVEL", "INFO"), stream=sys.stderr,
            format="%(asctime)s %(levelname)s [model] %(name)s: %(message)s",
        )


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        _configure_logging()
        faulthandler.enable(all_threads=True)  # a crash prints every thread's Python stack to Triton's log
        import torch  # noqa: F401  (fail loudly here if the execution env is wrong)

        log.info("python %s, torch %s, model dir %s", sys.version.split()[0], torch.__version__,
                 args.get("model_repository"))
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("model 'llm' must use the decoupled transaction policy")
        settings = load_settings(os.environ.get("MINDIE_TRITON_CONFIG") or None)
        from llm_engine.factory import build_engine
        from triton_metrics import EngineMetrics

        self.metrics = EngineMetrics(args["model_name"], settings.model.modelName,
                                     args.get("model_instance_name", ""))
        device_id = self._device_id(args, settings)
        self.engine = build_engine(settings, device_id=device_id, metrics=self.metrics,
                                   instances=instance_count(self.model_config))
        if self.engine.cores:  # this thread and the ones it starts below stay off the engine's cores
            pin_current_thread(self.engine.cores.rest, "the Python stub's other threads")
        self.max_n = settings.schedule.maxN
        self._flags = CancelFlags()
        # One sender thread: the Python backend's response senders are not safe to use
        # from several threads at once (measured: concurrent send() crashed tritonserver).
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._busy_since = 0.0  # when the sender thread began its current call into Triton (0: idle)
        self._finalizing = False
        self._sender = threading.Thread(target=self._send_loop, name="llm-sender", daemon=True)
        self._sender.start()
        # A response_format's grammar can take a second to compile (llguidance releases the
        # GIL meanwhile): those requests are admitted here, so execute() never waits for one.
        self._grammar_admission = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-grammar")
        self.metrics.start(self.engine)
        self.engine.start()
        threading.Thread(target=_exit_with_tritonserver, args=(os.getppid(),), name="llm-parent-watch",
                         daemon=True).start()
        threading.Thread(target=_exit_when_dead, args=(self._health,), name="llm-engine-watch",
                         daemon=True).start()

    def _health(self) -> str:
        """Why this model cannot serve any more ("" while it can): the engine's reasons
        (``Engine.health``), or the sender thread gone or stuck in one call into Triton (a
        send or a cancel poll) for longer than ``stepTimeout``. A stuck sender leaves every
        stream without its next token while the engine and Triton's readiness look fine."""
        reason = self.engine.health()
        if reason or self._finalizing:
            return reason
        if not self._sender.is_alive():
            return "the response sender thread has ended"
        busy, limit = self._busy_since, self.engine.step_timeout
        if limit and busy and time.monotonic() - busy > limit:
            return f"a call into Triton from the response sender has been blocked for more than {limit:g} s"
        return ""

    @staticmethod
    def _device_id(args: dict, settings) -> int:
        """Instance i on an accelerator uses npuDeviceIds[0][i % len]; Triton's id on KIND_GPU."""
        if args.get("model_instance_kind") == "GPU":
            return int(args.get("model_instance_device_id", 0))
        ids = settings.BackendConfig.npuDeviceIds[0] if settings.BackendConfig.npuDeviceIds else [0]
        name = args.get("model_instance_name", "")
        try:
            index = int(name.rsplit("_", 1)[-1])
        except ValueError:
            index = 0
        return ids[index % len(ids)] if ids else 0

    # -- requests in ---------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except EngineError as exc:
                self._end_with_error(sender, exc)
            except Exception as exc:  # never leave a request without its FINAL
                log.exception("could not submit a request")
                self._end_with_error(sender, EngineError(f"internal error: {exc}"))
        return None

    def _submit(self, request, sender) -> None:
        _check_one_row(request)
        stop_id = _scalar(request, "stop_request_id")
        if stop_id is not None:
            self._stop(stop_id, sender)
            return
        prompt_ids = self._prompt_ids(request)
        raw = _scalar(request, "sampling_parameters")
        params = parse_sampling_parameters(raw, max_n=self.max_n)
        stream_flag = _scalar(request, "stream")
        stream = True if stream_flag is None else bool(stream_flag)
        req_id = request.request_id() or f"triton-{id(request):x}"
        selection = read_selection(request)
        cancelled = threading.Event()
        req = Request(
            request_id=req_id, prompt_ids=prompt_ids, params=params, stream=stream,
            emit=lambda out, s=sender, t0=time.monotonic(): self._outbox.put((s, out, t0, selection)),
            is_cancelled=cancelled.is_set,
        )
        if params.structured:
            self._grammar_admission.submit(self._admit_guarded, req, sender, cancelled, selection)
        else:
            self._admit(req, sender, cancelled, selection)

    def _admit_guarded(self, req: Request, sender, cancelled: threading.Event, selection) -> None:
        """:meth:`_admit` off the execute thread, where its errors must still end the request."""
        try:
            self._admit(req, sender, cancelled, selection)
        except EngineError as exc:
            self._end_with_error(sender, exc)
        except Exception as exc:
            log.exception("could not submit a request")
            self._end_with_error(sender, EngineError(f"internal error: {exc}"))

    def _admit(self, req: Request, sender, cancelled: threading.Event, selection) -> None:
        """Check the request against the engine's limits (``prepare``) and queue it."""
        prompt_tokens = len(req.prompt_ids)  # as received (prepare may truncate it)
        self.engine.prepare(req)
        # From here on only the sender thread touches this sender: it polls it for a
        # cancel until it has sent the FINAL, and never after (querying a finished
        # sender crashed tritonserver).
        self._outbox.put((sender, _Watch(sender.is_cancelled, cancelled, req.request_id), 0.0, selection))
        self.metrics.on_request(prompt_tokens, id(sender))  # before its outputs can be sent
        try:
            self.engine.submit(req)
        except EngineError as exc:
            self._end_with_error(sender, exc)

    def _stop(self, raw, sender) -> None:
        """MindIE's stopInfer: the running requests with this id end as cancelled, with what
        they generated, on whichever instance runs them (:mod:`cancel_flags`); this call's
        one response is final and empty."""
        stop_id = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        if not stop_id:
            raise InvalidParameter("stop_request_id must not be empty")
        try:
            self._flags.raise_stop(stop_id)
        except OSError as exc:
            raise EngineError(f"could not stop request {stop_id!r}: {exc}") from None
        log.info("stop requested for request id %r", stop_id)
        self._outbox.put((sender, _STOPPED, 0.0, None))

    def _prompt_ids(self, request) -> list[int]:
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids is not None:
            arr = ids.as_numpy().reshape(-1)
            return [int(t) for t in arr]
        text = _scalar(request, "text_input")
        if text is None:
            raise InvalidParameter("either text_input or input_ids must be given")
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidParameter("text_input must be UTF-8") from None
        return self.engine.tokenizer(text).input_ids

    def _end_with_error(self, sender, exc: EngineError) -> None:
        """Queue the request's error FINAL: like every response, it goes out on the sender thread."""
        self._outbox.put((sender, exc, 0.0, None))

    # -- responses out -------------------------------------------------------------
    def _send_loop(self) -> None:
        """Send what the engine produced, in order, and poll running requests for cancels."""
        watched: dict[int, _Watch] = {}
        failed: dict[int, object] = {}
        next_poll = time.monotonic() + CANCEL_POLL_SECONDS
        while True:
            try:
                item = self._outbox.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                self._busy_since = time.monotonic()
                self._handle(item, watched, failed)
                self._busy_since = 0.0
            if time.monotonic() >= next_poll:
                self._busy_since = time.monotonic()
                _poll_cancels(watched, self._flags)
                self._busy_since = 0.0
                next_poll = time.monotonic() + CANCEL_POLL_SECONDS

    def _handle(self, item: tuple, watched: dict[int, _Watch], failed: dict[int, object]) -> None:
        """Send one item. ``failed`` holds the senders whose send() raised while their request
        still ran: the engine is dropping those, and what it still emits for them is not sent."""
        sender, out, t0, selection = item
        key = id(sender)
        last = isinstance(out, Exception) or out is _STOPPED or (isinstance(out, StepOutput) and out.final)
        if key in failed:
            if last:
                del failed[key]
            return
        try:
            if isinstance(out, _Watch):
                watched[key] = out
                return
            if out is _STOPPED:  # a control call: nothing to count
                try:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
                except Exception:
                    log.exception("failed to answer a stop call")
                return
            if isinstance(out, Exception):
                watched.pop(key, None)
                self.metrics.forget(key)
                self._send_error(sender, out)
                return
            if out.final:  # counted before the FINAL: a client that saw the end finds it in /metrics
                watched.pop(key, None)
                self.metrics.on_output(out, t0, key)
            ending = out.final or bool(out.finish_reason)
            sender.send(response_of(out, selection.ending if ending else selection.running),
                        flags=FINAL if out.final else 0)
            if not out.final:  # after the send: a first token's TTFT and queue-time observations are
                self.metrics.on_output(out, t0, key)  # two round trips to Triton it need not wait for
        except Exception as exc:
            # The request must still end: an error FINAL (refused if it was already closed),
            # and the engine must stop generating for it.
            log.exception("failed to send a response")
            watch = watched.pop(key, None)
            if watch is not None:
                watch.cancelled.set()
            if not last:
                failed[key] = sender  # held, so that its id is not reused before the last item
            self.metrics.forget(key)
            self._send_error(sender, EngineError(f"internal error: {exc}"))

    @staticmethod
    def _send_error(sender, exc: Exception) -> None:
        message = exc.wire() if isinstance(exc, EngineError) else str(exc)
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
        except Exception:
            log.exception("failed to send an error response")

    def finalize(self) -> None:
        log.info("finalizing: stopping the engine")
        self._finalizing = True  # the sender thread ends below: not a reason to exit
        self._grammar_admission.shutdown(wait=True)  # what it admits, engine.stop() then ends
        self.engine.stop()  # fails what is still queued or running: their FINALs go out below
        self._outbox.put(None)
        self._sender.join(timeout=10)
        self.metrics.close()
        # Free the engine's state now, while the stub is still there for the destructors of
        # the Triton objects it holds (response senders). Left to the interpreter's exit
        # (the engine's objects form reference cycles), they ran after the stub was gone
        # and segfaulted it at every shutdown that followed traffic.
        self.__dict__.clear()
        gc.collect()
        atexit.register(_exit_now)


def _exit_now() -> None:
    """End the stub process at the interpreter's exit, which comes after the stub has
    finished with Triton. The rest of the interpreter's teardown (torch's included) took
    1.3 s, and Triton waits for the process: with a short ``--exit-timeout-secs`` it gave
    up ("Exit timeout expired")."""
    _flush_logs()
    os._exit(0)


class _Watch:
    """A running request's cancel check (an IPC to Triton), the flag the engine reads, and
    the id the cancel flags name."""

    __slots__ = ("check", "cancelled", "request_id")

    def __init__(self, check, cancelled: threading.Event, request_id: str):
        self.check, self.cancelled, self.request_id = check, cancelled, request_id


_STOPPED = object()  # the outbox item that answers a stop_request_id call


def _poll_cancels(watched: dict[int, _Watch], flags: CancelFlags) -> None:
    flags.refresh()
    for key, watch in list(watched.items()):
        try:
            cancelled = watch.check()
        except Exception:  # the request is gone on Triton's side
            cancelled = True
        if cancelled or flags.cancelled(watch.request_id):
            watch.cancelled.set()
            del watched[key]  # the engine ends it; its FINAL still comes through the outbox


def _exit_when_dead(health, interval: float = 1.0) -> None:
    """End the stub once ``health()`` names a reason (``TritonPythonModel._health``: the
    engine's thread ended, a step hung past ``stepTimeout``, ``maxFailedSteps`` steps failed
    in a row, or the sender thread is gone or stuck). Triton then ends every open request
    with an error and the launcher restarts tritonserver, as after a crash; a hung or broken
    engine would instead hold requests until their timeouts while /health said all was well."""
    while True:
        time.sleep(interval)
        reason = health()
        if reason:
            log.critical("%s; exiting so that the model is restarted", reason)
            _flush_logs()
            os._exit(1)


def _flush_logs() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def _exit_with_tritonserver(parent: int) -> None:
    """Leave as soon as tritonserver is gone. Seen once on the development machine: this
    stub still alive, holding the weights and KV cache, an hour after its tritonserver
    had been stopped with its launcher (not reproduced since)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    log.error("tritonserver (pid %d) is gone; exiting", parent)
    os._exit(1)


def _check_one_row(request) -> None:
    """One prompt per request: with ``max_batch_size`` > 0 every input has a batch dimension,
    and a second row would be merged into the first prompt (input_ids) or ignored."""
    for tensor in request.inputs():
        shape = tensor.as_numpy().shape
        rows = shape[0] if shape else 1
        if rows != 1:
            raise InvalidParameter(f"{tensor.name()}: send one prompt per request (batch dimension 1), got {rows}")


def _scalar(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    arr = tensor.as_numpy().reshape(-1)
    return arr[0] if arr.size else None
