"""What the llm model's responses carry: the outputs a request asked for, and one engine
output turned into a Triton response with only those."""

from __future__ import annotations

import json
from typing import NamedTuple

import numpy as np
import triton_python_backend_utils as pb_utils
from llm_engine.contract import FINISH_ONLY_OUTPUTS, OUTPUT_NAMES, finish_only_outputs
from llm_engine.sequence import StepOutput


class Selection(NamedTuple):
    """The outputs a request's responses carry: ``ending`` on a response that ends a
    sequence (a finish reason) or the request (FINAL), ``running`` on the others."""

    ending: frozenset[str]
    running: frozenset[str]


def read_selection(request) -> Selection:
    """The outputs the request asked for (all when it names none), less its
    ``finish_only_outputs`` parameter's on the responses that end nothing."""
    wanted = frozenset(request.requested_output_names()) or OUTPUT_NAMES
    try:
        parameters = json.loads(request.parameters() or "{}")
    except ValueError:
        parameters = {}
    at_finish = finish_only_outputs(parameters.get(FINISH_ONLY_OUTPUTS))
    return Selection(wanted, wanted - at_finish)


def response_of(out: StepOutput, wanted: frozenset[str]):
    """Only the outputs in ``wanted``. ``send()`` drops the others itself, but it
    does so with the GIL released, and dropping a tensor frees its numpy array: under
    load that corrupted the stub's heap (a segfault in libpython's allocator, seen with
    llm_unary's BLS calls, which do not ask for ``queue_wait_us``)."""
    def t(name, value, dtype):
        if name not in wanted:
            return None
        return pb_utils.Tensor(name, np.asarray(value, dtype=dtype).reshape(1, -1))

    tensors = [
        t("text_output", [out.text.encode("utf-8")], np.object_),
        t("index", [out.index], np.int32),
        t("token_ids", out.token_ids, np.int64),
        t("finish_reason", [out.finish_reason.encode()], np.object_),
        t("prompt_tokens", [out.prompt_tokens], np.int32),
        t("cached_tokens", [out.cached_tokens], np.int32),
        t("completion_tokens", [out.completion_tokens], np.int32),
        t("cumulative_logprob", [out.cumulative_logprob], np.float32),
        t("seed", [out.seed], np.uint64),
        t("batch_size", out.batch_size, np.int32),
        t("queue_wait_us", out.queue_wait_us, np.int64),
        t("logprobs", [json.dumps(out.logprobs).encode() if out.logprobs is not None else b""], np.object_),
    ]
    return pb_utils.InferenceResponse(output_tensors=[tensor for tensor in tensors if tensor is not None])
