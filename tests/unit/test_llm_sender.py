"""The llm model's sender thread logic (``_handle``), with stand-ins for Triton's response
senders: what happens when a send fails. The real senders are exercised end to end in
tests/e2e (test_triton_clients.py, test_reliability.py)."""

from __future__ import annotations

import importlib.util
import json
import queue
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
from llm_engine.contract import OUTPUT_NAMES
from llm_engine.errors import EngineError
from llm_engine.sequence import StepOutput

from tests.conftest import ROOT

FINAL = 1


class Sender:
    """Records what was sent; ``fail_on`` = indexes of send() calls that raise."""

    def __init__(self, fail_on: tuple[int, ...] = ()):
        self.sent: list[tuple[object, int]] = []
        self.fail_on = fail_on
        self.calls = 0

    def send(self, response, flags=0):
        self.calls += 1
        if self.calls - 1 in self.fail_on:
            raise RuntimeError("the response could not be sent")
        self.sent.append((response, flags))


class Metrics:
    def __init__(self):
        self.outputs, self.forgotten = 0, []

    def on_output(self, out, t0, key):
        self.outputs += 1

    def forget(self, key):
        self.forgotten.append(key)


@pytest.fixture
def model(monkeypatch):
    fake = types.ModuleType("triton_python_backend_utils")
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.output_tensors, self.error = list(output_tensors), error

    class TritonError:
        def __init__(self, message):
            self.message = message

    fake.Tensor, fake.InferenceResponse, fake.TritonError = Tensor, InferenceResponse, TritonError
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.delitem(sys.modules, "response_outputs", raising=False)  # imported again with this fake
    spec = importlib.util.spec_from_file_location("llm_model_under_test", ROOT / "model_repository/llm/1/model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    instance = module.TritonPythonModel.__new__(module.TritonPythonModel)
    instance.metrics = Metrics()
    return module, instance


def outputs_module():
    """``response_outputs``, as the model under test imported it (with the fake pb_utils)."""
    return sys.modules["response_outputs"]


def every(module):
    """A request that names no outputs: all of them, on every response."""
    return outputs_module().Selection(OUTPUT_NAMES, OUTPUT_NAMES)


def output(final: bool, text: str = "x") -> StepOutput:
    return StepOutput(index=0, text=text, token_ids=[1], finish_reason="length" if final else "", prompt_tokens=3,
                      cached_tokens=0, completion_tokens=1, cumulative_logprob=-0.5, seed=7, batch_size=[1],
                      queue_wait_us=[10], logprobs=None, final=final)


def test_a_failed_send_cancels_the_request_and_ends_it_once(model):
    module, m = model
    watched, failed = {}, {}
    sender = Sender(fail_on=(1,))
    cancelled = threading.Event()
    m._handle((sender, module._Watch(lambda: False, cancelled, "r1"), 0.0, every(module)), watched, failed)
    m._handle((sender, output(False, "a"), 0.0, every(module)), watched, failed)
    assert [r.output_tensors[0].array.tolist() for r, _ in sender.sent] == [[[b"a"]]]
    m._handle((sender, output(False, "b"), 0.0, every(module)), watched, failed)  # send() raises
    # the engine is told to drop the request, and the client gets one error FINAL
    assert cancelled.is_set() and not watched and id(sender) in failed
    (error, flags), = sender.sent[1:]
    assert flags == FINAL and "internal error" in error.error.message
    # what the engine still emits before it drops the request is not sent
    m._handle((sender, output(False, "c"), 0.0, every(module)), watched, failed)
    m._handle((sender, output(True, ""), 0.0, every(module)), watched, failed)
    assert len(sender.sent) == 2 and not failed
    assert m.metrics.forgotten == [id(sender)]


def test_a_token_goes_out_before_its_metrics_and_the_final_after_them(model):
    """A metric observation is a round trip to Triton: a running response (a first token
    makes two, TTFT and queue time) does not wait for them; the FINAL does, so that a client
    that saw the end finds the request counted."""
    module, m = model
    events = []
    sender = Sender()
    sender.send = lambda response, flags=0: events.append(("send", flags))
    m.metrics.on_output = lambda out, t0, key: events.append(("metrics", out.final))
    for final in (False, False, True):
        m._handle((sender, output(final), 0.0, every(module)), {}, {})
    assert events == [("send", 0), ("metrics", False), ("send", 0), ("metrics", False),
                      ("metrics", True), ("send", FINAL)]


def test_a_failed_last_send_leaves_nothing_behind(model):
    module, m = model
    watched, failed = {}, {}
    sender = Sender(fail_on=(0,))
    m._handle((sender, module._Watch(lambda: False, threading.Event(), "r2"), 0.0, every(module)), watched, failed)
    m._handle((sender, output(True), 0.0, every(module)), watched, failed)
    assert not watched and not failed
    (error, flags), = sender.sent
    assert flags == FINAL and error.error is not None
    other = Sender()  # the next request is served as usual
    text_only = outputs_module().Selection(frozenset({"text_output"}), frozenset({"text_output"}))
    m._handle((other, output(True, "ok"), 0.0, text_only), watched, failed)
    (response, flags), = other.sent
    assert flags == FINAL and [t.name for t in response.output_tensors] == ["text_output"]


class Request:
    """What ``read_selection`` reads of a Triton request."""

    def __init__(self, outputs=(), parameters=None):
        self.outputs, self.params = list(outputs), parameters

    def requested_output_names(self):
        return self.outputs

    def parameters(self):
        return json.dumps(self.params or {})


def test_finish_only_outputs_travel_only_on_responses_that_end_a_sequence_or_the_request(model):
    """The ``finish_only_outputs`` request parameter: a running response leaves those out; a
    sequence's last one (n > 1: a finish reason before the request's FINAL) and the FINAL
    carry every requested output."""
    module, m = model
    wanted = ["text_output", "index", "finish_reason", "prompt_tokens", "batch_size"]
    selection = outputs_module().read_selection(Request(wanted, {"finish_only_outputs": "finish_reason, prompt_tokens,batch_size"}))
    sender = Sender()
    sequence_end = output(False, "b")
    sequence_end.finish_reason = "stop"
    for out in (output(False, "a"), sequence_end, output(True, "c")):
        m._handle((sender, out, 0.0, selection), {}, {})
    names = [[t.name for t in response.output_tensors] for response, _ in sender.sent]
    assert names == [["text_output", "index"], wanted, wanted]
    assert [flags for _, flags in sender.sent] == [0, 0, FINAL]


def test_without_finish_only_outputs_every_response_carries_what_was_asked_for(model):
    module, _ = model
    assert outputs_module().read_selection(Request()) == (OUTPUT_NAMES, OUTPUT_NAMES)
    asked = outputs_module().read_selection(Request(["text_output", "seed"], {"other": 1}))
    assert asked.ending == asked.running == {"text_output", "seed"}
    # a name the request did not ask for changes nothing; only asked-for outputs are sent
    some = outputs_module().read_selection(Request(["text_output"], {"finish_only_outputs": "seed"}))
    assert some.ending == some.running == {"text_output"}


@pytest.mark.parametrize("value, message", [
    ("text_output,usage", "unknown outputs: usage"),
    (["seed"], "comma-separated string"),
])
def test_a_bad_finish_only_outputs_parameter_is_a_400_naming_it(model, value, message):
    module, _ = model
    with pytest.raises(module.InvalidParameter, match="finish_only_outputs") as err:
        outputs_module().read_selection(Request(["text_output"], {"finish_only_outputs": value}))
    assert message in str(err.value) and err.value.wire().startswith("[400]")


def test_a_stop_raises_a_flag_the_poll_turns_into_the_engines_cancel(model, tmp_path):
    """stop_request_id: the call gets one empty FINAL, and the running request with that id
    is cancelled at the next poll, the others are not."""
    import queue

    from cancel_flags import CancelFlags

    module, m = model
    m._flags = CancelFlags(str(tmp_path / "flags"))
    m._outbox = queue.SimpleQueue()
    watched, failed = {}, {}
    target, other = threading.Event(), threading.Event()
    for sender, event, rid in ((Sender(), target, "req-7#0"), (Sender(), other, "req-7#1")):
        m._handle((sender, module._Watch(lambda: False, event, rid), 0.0, every(module)), watched, failed)
    control = Sender()
    m._stop(b"req-7#0", control)
    m._handle(m._outbox.get_nowait(), watched, failed)
    (response, flags), = control.sent
    assert flags == FINAL and response.output_tensors == []
    module._poll_cancels(watched, m._flags)
    assert target.is_set() and not other.is_set() and len(watched) == 1
    assert not m.metrics.forgotten  # a control call is not a request: nothing counted
    with pytest.raises(module.InvalidParameter):
        m._stop(b"", Sender())


def test_a_stop_whose_answer_fails_leaves_nothing_behind(model, tmp_path):
    import queue

    from cancel_flags import CancelFlags

    module, m = model
    m._flags = CancelFlags(str(tmp_path / "flags"))
    m._outbox = queue.SimpleQueue()
    watched, failed = {}, {}
    control = Sender(fail_on=(0,))
    m._stop(b"req-9#0", control)
    m._handle(m._outbox.get_nowait(), watched, failed)
    assert not watched and not failed and not control.sent


def test_an_engine_error_is_sent_as_the_error_final(model):
    _, m = model
    sender = Sender()
    m._handle((sender, EngineError("[424] too long"), 0.0, None), {}, {})
    (error, flags), = sender.sent
    assert flags == FINAL and "too long" in error.error.message


def test_the_stub_exits_when_the_engine_is_dead(model, monkeypatch):
    module, _ = model

    class Engine:
        def __init__(self):
            self.answers = iter(["", "", "3 engine steps failed in a row"])

        def health(self):
            return next(self.answers)

    codes = []

    def fake_exit(code):
        codes.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(module.os, "_exit", fake_exit)
    monkeypatch.setattr(module, "_flush_logs", lambda: None)
    with pytest.raises(SystemExit):
        module._exit_when_dead(Engine().health, interval=0.01)
    assert codes == [1]


class Alive:
    def __init__(self, alive=True):
        self.alive = alive

    def is_alive(self):
        return self.alive


def test_a_sender_stuck_in_a_call_into_triton_makes_the_model_unhealthy(model):
    module, m = model
    m.engine = types.SimpleNamespace(health=lambda: "", step_timeout=5.0)
    m._sender, m._finalizing, m._busy_since = Alive(), False, 0.0
    assert m._health() == ""
    m._busy_since = module.time.monotonic() - 1.0  # busy, but not for long
    assert m._health() == ""
    m._busy_since = module.time.monotonic() - 6.0
    assert "blocked for more than 5 s" in m._health()
    m.engine.step_timeout = 0.0  # the check is off
    assert m._health() == ""


def test_a_sender_thread_that_ended_makes_the_model_unhealthy_except_while_finalizing(model):
    _, m = model
    m.engine = types.SimpleNamespace(health=lambda: "", step_timeout=5.0)
    m._sender, m._finalizing, m._busy_since = Alive(False), False, 0.0
    assert m._health() == "the response sender thread has ended"
    m._finalizing = True
    assert m._health() == ""
    m.engine.health = lambda: "the engine thread has ended"
    assert m._health() == "the engine thread has ended"


def test_the_sender_loop_marks_itself_busy_only_during_a_call(model):
    _, m = model
    seen = []

    class Watching(Sender):
        def send(self, response, flags=0):
            seen.append(m._busy_since)
            super().send(response, flags)

    m._outbox = queue.SimpleQueue()
    m._flags = types.SimpleNamespace(refresh=lambda: None, cancelled=lambda _id: False)
    m._busy_since = 0.0
    sender = Watching()
    m._outbox.put((sender, EngineError("[424] too long"), 0.0, None))
    m._outbox.put(None)
    m._send_loop()
    assert seen and seen[0] > 0 and m._busy_since == 0.0


class Submitting:
    """What ``_submit`` reads: stand-ins for the Triton request, the engine and the metrics."""

    class Request:
        def __init__(self, request_id: str, params: dict):
            self.id, self.params = request_id, json.dumps(params)

        def request_id(self):
            return self.id

        def inputs(self):  # its tensors are read through the stand-in _scalar below
            return []

    class Sender(Sender):
        def is_cancelled(self):
            return False

    def __init__(self, module, m, monkeypatch, prepare):
        self.order = []
        order = self.order

        class Engine:
            def prepare(self, req):
                prepare(req)
                order.append(("prepare", req.request_id))

            def submit(self, req):
                order.append(("submit", req.request_id))

        m.engine, m.max_n, m._outbox = Engine(), 8, queue.SimpleQueue()
        m._grammar_admission = ThreadPoolExecutor(max_workers=1)
        m.metrics.on_request = lambda prompt_tokens, key: None
        monkeypatch.setattr(module, "_scalar",
                            lambda request, name: request.params if name == "sampling_parameters" else None)
        monkeypatch.setattr(module, "read_selection", lambda request: None)
        monkeypatch.setattr(m, "_prompt_ids", lambda request: [1, 2])


def test_a_structured_request_is_admitted_off_the_execute_thread(model, monkeypatch):
    module, m = model
    release = threading.Event()
    s = Submitting(module, m, monkeypatch, lambda req: req.params.response_format and release.wait(5))
    m._submit(s.Request("a", {"response_format": {"type": "json_object"}}), s.Sender())
    m._submit(s.Request("b", {}), s.Sender())
    assert s.order == [("prepare", "b"), ("submit", "b")]  # not held behind a's grammar
    release.set()
    m._grammar_admission.shutdown(wait=True)
    assert s.order[2:] == [("prepare", "a"), ("submit", "a")]


def test_a_structured_request_refused_off_the_execute_thread_still_gets_its_error_final(model, monkeypatch):
    module, m = model

    def prepare(req):
        raise module.InvalidParameter("response_format cannot be used: boom")

    s = Submitting(module, m, monkeypatch, prepare)
    sender = s.Sender()
    m._submit(s.Request("a", {"response_format": {"type": "json_object"}}), sender)
    m._grammar_admission.shutdown(wait=True)
    (item,) = [m._outbox.get_nowait() for _ in range(m._outbox.qsize())]
    assert item[0] is sender and isinstance(item[1], EngineError) and "boom" in str(item[1])
    assert s.order == []
