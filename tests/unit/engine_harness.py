"""Running the real engine in-process for the engine tests: build one, submit a request,
collect its outputs."""

from __future__ import annotations

import threading

from llm_engine.config import Settings
from llm_engine.errors import EngineError
from llm_engine.params import parse_sampling_parameters
from llm_engine.sequence import Request


def build(dtype="float32", cpu_kernels="auto", linear_weights="auto", **schedule):
    from llm_engine.factory import build_engine

    s = Settings()
    s.model.dtype = dtype
    s.model.cpuKernels = cpu_kernels
    s.model.cpuLinearWeights = linear_weights
    for k, v in schedule.items():
        setattr(s.schedule, k, v)
    eng = build_engine(s)
    eng.start()
    return eng



class Run:
    """Submit a request and collect its outputs."""

    def __init__(self, eng, prompt, stream=True, cancel=None, **params):
        self.outputs, self.error, self.done = [], None, threading.Event()
        ids = eng.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        self.req = Request(f"t{id(self)}", ids, parse_sampling_parameters(params), self._emit, stream=stream,
                           is_cancelled=cancel or (lambda: False))
        eng.prepare(self.req)
        eng.submit(self.req)

    def _emit(self, out):
        if isinstance(out, EngineError):
            self.error = out
            self.done.set()
            return
        self.outputs.append(out)
        if out.final:
            self.done.set()

    def wait(self, timeout=120):
        assert self.done.wait(timeout), "request did not finish"
        return self

    def text(self, index=0):
        return "".join(o.text for o in self.outputs if o.index == index)

    def finals(self):
        return {o.index: o for o in self.outputs if o.finish_reason}
