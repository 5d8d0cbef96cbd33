"""The Triton tensor contract of the ``llm`` model: a public, stable interface.

Every response of the decoupled model describes one step of one sequence
(``index`` says which of the request's ``n``/``best_of`` sequences). The request's
last response carries ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``; clients stop on it.
A failure is not a finish reason: it is a single error response (also final) whose
message starts with the HTTP status, ``[424] ...`` (:mod:`llm_engine.errors`).
Shapes below exclude the leading batch dimension (``max_batch_size`` > 0). Every
input is optional; ``input_ids`` wins when both it and ``text_input`` are given.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass

from .errors import InvalidParameter


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # Triton dtype name, e.g. "BYTES", "INT64"
    shape: tuple[int, ...]
    optional: bool = False
    doc: str = ""


INPUTS: tuple[Tensor, ...] = (
    Tensor("text_input", "BYTES", (1,), True, "UTF-8 prompt; give this or input_ids"),
    Tensor("input_ids", "INT64", (-1,), True, "prompt token ids; used when both are given"),
    Tensor("stream", "BOOL", (1,), True, "true: one response per step; false: one per sequence"),
    Tensor("sampling_parameters", "BYTES", (1,), True, "JSON object, see params.py"),
    Tensor("stop_request_id", "BYTES", (1,), True,
           "a control call (MindIE's stopInfer): the requests with this request id, running or arriving "
           "within 60 s, end as 'cancelled' with what they generated; this call gets one empty final response"),
)

OUTPUTS: tuple[Tensor, ...] = (
    Tensor("text_output", "BYTES", (1,), doc="text added by this response (whole text if stream=false)"),
    Tensor("index", "INT32", (1,), doc="sequence index within the request (0..best_of-1)"),
    Tensor("token_ids", "INT64", (-1,), doc="token ids generated in this response"),
    Tensor("finish_reason", "BYTES", (1,), doc="'' while running, else stop|length|cancelled (errors are error responses)"),
    Tensor("prompt_tokens", "INT32", (1,), doc="prompt length in tokens"),
    Tensor("cached_tokens", "INT32", (1,), doc="prompt tokens served from the prefix cache"),
    Tensor("completion_tokens", "INT32", (1,), doc="tokens generated so far by this sequence"),
    Tensor("cumulative_logprob", "FP32", (1,), doc="sum of the chosen tokens' logprobs"),
    Tensor("seed", "UINT64", (1,), doc="the seed in use (drawn when not given)"),
    Tensor("batch_size", "INT32", (-1,), doc="per generated token: requests in the step that produced it (n sequences count once)"),
    Tensor("queue_wait_us", "INT64", (-1,), doc="per generated token: µs from arrival or the previous token to its first step"),
    Tensor("logprobs", "BYTES", (1,), doc="JSON list of {token, logprob, top:[[token, logprob]...]} or ''"),
)

OUTPUT_NAMES = frozenset(t.name for t in OUTPUTS)

# A request parameter (Triton's request ``parameters``, not a tensor): a comma-separated
# list of the requested outputs that only responses ending a sequence (finish_reason set)
# or the request (FINAL) carry. The other responses of a stream leave them out, which
# saves every streamed token their encoding, transport and decoding; a client reading
# totals such as usage at the end loses nothing.
FINISH_ONLY_OUTPUTS = "finish_only_outputs"


def finish_only_outputs(value) -> frozenset[str]:
    """The output names a ``finish_only_outputs`` parameter value gives (absent: none)."""
    if value is None or value == "":
        return frozenset()
    if not isinstance(value, str):
        raise InvalidParameter(f"{FINISH_ONLY_OUTPUTS} must be a comma-separated string of output names")
    names = frozenset(name.strip() for name in value.split(",") if name.strip())
    unknown = sorted(names - OUTPUT_NAMES)
    if unknown:
        raise InvalidParameter(f"{FINISH_ONLY_OUTPUTS} names unknown outputs: {', '.join(unknown)}")
    return names


# llm_unary names its BLS calls llm_unary-<32 hex digits>. A BLS call cannot be cancelled in
# this Triton, so llm_unary cancels one by creating a file of that name in cancel_flag_dir().
CANCELLABLE_ID = re.compile(r"llm_unary-[0-9a-f]{32}")


CANCEL_FLAG_DIR_PREFIX = "mindie-triton-cancel-"  # + the tritonserver pid


def cancel_flag_dir() -> str:
    """One folder per tritonserver process (the parent of every Python stub)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"{CANCEL_FLAG_DIR_PREFIX}{os.getppid()}")


FINISH_STOP = "stop"  # EOS, stop string or stop token id
FINISH_LENGTH = "length"  # max tokens, maxIterTimes, maxSeqLen, max_position_embeddings
FINISH_CANCELLED = "cancelled"  # the client cancelled; the engine dropped the sequence


def input_names() -> list[str]:
    return [t.name for t in INPUTS]


def output_names() -> list[str]:
    return [t.name for t in OUTPUTS]
